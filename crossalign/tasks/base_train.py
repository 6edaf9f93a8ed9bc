"""Step 1 (npu): train the model from a random init for ``base_train_iters`` steps and save a MindFormers checkpoint."""

from __future__ import annotations

from typing import Any

from crossalign.sides.protocol import StepCallback
from crossalign.site import SiteConfig
from crossalign.store import Run
from crossalign.tasks.training import train_step

STEP = "base-train"


def base_train(run: Run, site: SiteConfig, on_step: StepCallback | None = None) -> dict[str, Any]:
    return train_step(run, STEP, pool="npu", side="mindformers", mode="base", site=site,
                      init_checkpoint=None, save=True, on_step=on_step)
