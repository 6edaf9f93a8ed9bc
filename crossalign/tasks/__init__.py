"""The six steps of the DAG as plain functions: ``fn(run, spec, site, on_step) -> manifest``.

Each reads its inputs from the run store and commits its outputs there (see ``crossalign.store``);
none needs Prefect. The flows decide where a step runs; ``run_step`` is the one entry point for
all of them (in-process, as ``python -m crossalign.tasks`` locally, or over SSH). Which function
carries a step out is the DAG's table (``crossalign.dag``, ``StepSpec.function``).
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

from crossalign.dag import StepSpec
from crossalign.sides.protocol import StepCallback
from crossalign.site import SiteConfig
from crossalign.store import Run


class StepFunction(Protocol):
    def __call__(self, run: Run, spec: StepSpec, site: SiteConfig,
                 on_step: StepCallback | None = None) -> dict[str, Any]: ...


def step_function(spec: StepSpec) -> StepFunction:
    """The function of ``spec`` (its ``"module:name"``), imported now: a step imports its frameworks only here."""
    module, _, name = spec.function.partition(":")
    return getattr(importlib.import_module(module), name)


def run_step(run: Run, step: str, site: SiteConfig, on_step: StepCallback | None = None) -> dict[str, Any]:
    """Carry out ``step`` of ``run`` here, as the run's spec of it says, and return its manifest."""
    spec = run.spec(step)
    return step_function(spec)(run, spec, site, on_step)
