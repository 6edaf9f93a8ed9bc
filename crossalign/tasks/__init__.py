"""The six steps of the DAG as plain functions: ``fn(run, site, [on_step]) -> manifest``.

Each reads its inputs from the run store and commits its outputs there (see ``crossalign.store``);
none needs Prefect. The flows decide where a step runs; ``run_step`` is the one entry point for
all of them (in-process, as ``python -m crossalign.tasks`` locally, or over SSH).
"""

from __future__ import annotations

from typing import Any, Callable

from crossalign.sides.protocol import StepCallback
from crossalign.site import SiteConfig
from crossalign.store import Run, step_spec
from crossalign.tasks.base_train import base_train
from crossalign.tasks.cast_bf16 import cast_bf16
from crossalign.tasks.compare import compare
from crossalign.tasks.convert import convert
from crossalign.tasks.import_hf import import_hf
from crossalign.tasks.megatron_train import megatron_train
from crossalign.tasks.pynative_train import pynative_train

TRAINING_STEPS = ("base-train", "megatron-train", "pynative-train")

STEP_FUNCTIONS: dict[str, Callable[..., dict[str, Any]]] = {
    "base-train": base_train,
    "cast-bf16": cast_bf16,
    "convert": convert,
    "megatron-train": megatron_train,
    "pynative-train": pynative_train,
    "compare": compare,
}


def run_step(run: Run, step: str, site: SiteConfig, on_step: StepCallback | None = None) -> dict[str, Any]:
    """Carry out ``step`` of ``run`` here and return its manifest."""
    name = step_spec(step).name
    if name == "base-train" and run.start["from"] == "huggingface":
        return import_hf(run, site)  # step 1 of a run started from Hugging Face weights
    function = STEP_FUNCTIONS[name]
    if name in TRAINING_STEPS:
        return function(run, site, on_step=on_step)
    return function(run, site)
