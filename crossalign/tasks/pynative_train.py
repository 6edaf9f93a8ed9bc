"""Step 5 (npu): MindFormers pynative training from the bf16 checkpoint of step 2; its log is one side of the comparison."""

from __future__ import annotations

from typing import Any

from crossalign.sides.protocol import StepCallback
from crossalign.site import SiteConfig
from crossalign.store import Run
from crossalign.tasks.training import train_step

STEP = "pynative-train"


def pynative_train(run: Run, site: SiteConfig, on_step: StepCallback | None = None) -> dict[str, Any]:
    return train_step(run, STEP, pool="npu", side="mindformers", mode="align", site=site,
                      init_checkpoint=run.step_dir("cast-bf16") / "checkpoint", save=False, on_step=on_step)
