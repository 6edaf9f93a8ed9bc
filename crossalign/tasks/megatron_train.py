"""Step 4 (gpu): Megatron training from the converted checkpoint of step 3 (finetune, no optimizer or RNG state)."""

from __future__ import annotations

from typing import Any

from crossalign.sides.protocol import StepCallback
from crossalign.site import SiteConfig
from crossalign.store import Run
from crossalign.tasks.training import train_step

STEP = "megatron-train"


def megatron_train(run: Run, site: SiteConfig, on_step: StepCallback | None = None) -> dict[str, Any]:
    return train_step(run, STEP, pool="gpu", side="megatron", mode="align", site=site,
                      init_checkpoint=run.step_dir("convert") / "checkpoint", save=False, on_step=on_step)
