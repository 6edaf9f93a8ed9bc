"""Step 3 (cpu): convert the bf16 MindFormers checkpoint to a Megatron checkpoint for the configured core version."""

from __future__ import annotations

import time
from typing import Any

from crossalign.checkpoint.convert import convert_checkpoint
from crossalign.dag import StepSpec
from crossalign.sides.protocol import StepCallback
from crossalign.site import SiteConfig
from crossalign.store import Run
from crossalign.tasks.command import step_command


PROGRESS_INTERVAL_S = 1.0


class ConversionProgress:
    """A conversion's progress by bytes as the step's ``on_step`` progress: at most one report a second (and the
    last), each with the bytes read and the time left at the rate so far."""

    def __init__(self, on_step: StepCallback, interval_s: float = PROGRESS_INTERVAL_S):
        self.on_step, self.interval_s = on_step, interval_s
        self._start = time.monotonic()
        self._last = float("-inf")

    def __call__(self, done: int, total: int, what: str) -> None:
        now = time.monotonic()
        if done < total and now - self._last < self.interval_s:
            return
        self._last = now
        left = (now - self._start) * (total - done) / done if done else float("nan")
        self.on_step(done, total, {"GB_read": done / 1e9, "seconds_left": left})


def convert(run: Run, spec: StepSpec, site: SiteConfig, on_step: StepCallback | None = None) -> dict[str, Any]:
    config = run.config
    with run.commit(spec.name, command=step_command(run, spec.name)) as out:
        layout = config.parallel.megatron  # a legacy checkpoint loads only into the layout it was written for
        report = convert_checkpoint(config.model, "ms2mg", run.step_dir(spec.inputs[0]) / "checkpoint",
                                    out.dir / "checkpoint", core_version=config.training.megatron_core_version,
                                    tp=layout.tensor, pp=layout.pipeline, ep=layout.expert, etp=layout.expert_tensor,
                                    progress=ConversionProgress(on_step) if on_step else None)
        out.details.update(checkpoint="checkpoint", core_version=config.training.megatron_core_version,
                           layout=layout.ranks,
                           iteration=report.iteration, keys_in=report.keys_in, keys_out=report.keys_out,
                           dtype=report.dtype, output_validated=report.output_validated, notes=report.notes)
    return run.manifest(spec.name)
