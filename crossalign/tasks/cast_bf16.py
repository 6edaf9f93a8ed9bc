"""Step 2 (cpu): cast the base checkpoint to bf16, the weights both alignment runs start from."""

from __future__ import annotations

from typing import Any

from crossalign.checkpoint.cast import cast_bf16 as cast
from crossalign.dag import StepSpec
from crossalign.sides.protocol import StepCallback
from crossalign.site import SiteConfig
from crossalign.store import Run
from crossalign.tasks.command import step_command


def cast_bf16(run: Run, spec: StepSpec, site: SiteConfig, on_step: StepCallback | None = None) -> dict[str, Any]:
    with run.commit(spec.name, command=step_command(run, spec.name)) as out:
        report = cast(run.step_dir(spec.inputs[0]) / "checkpoint", out.dir / "checkpoint")
        out.details.update(checkpoint="checkpoint", tensors=report.tensors, cast=report.cast,
                           bytes_in=report.bytes_in, bytes_out=report.bytes_out, buffers_kept=report.buffers,
                           optimizer_files_kept=len(report.optimizer_files))
    return run.manifest(spec.name)
