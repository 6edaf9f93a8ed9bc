"""Step 3 (cpu): convert the bf16 MindFormers checkpoint to a Megatron checkpoint for the configured core version."""

from __future__ import annotations

from typing import Any

from crossalign.checkpoint.convert import convert_checkpoint
from crossalign.dag import StepSpec
from crossalign.sides.protocol import StepCallback
from crossalign.site import SiteConfig
from crossalign.store import Run
from crossalign.tasks.command import step_command


def convert(run: Run, spec: StepSpec, site: SiteConfig, on_step: StepCallback | None = None) -> dict[str, Any]:
    config = run.config
    with run.commit(spec.name, command=step_command(run, spec.name)) as out:
        layout = config.parallel.megatron  # a legacy checkpoint loads only into the layout it was written for
        report = convert_checkpoint(config.model, "ms2mg", run.step_dir(spec.inputs[0]) / "checkpoint",
                                    out.dir / "checkpoint", core_version=config.training.megatron_core_version,
                                    tp=layout.tensor, pp=layout.pipeline, ep=layout.expert, etp=layout.expert_tensor)
        out.details.update(checkpoint="checkpoint", core_version=config.training.megatron_core_version,
                           layout=layout.ranks,
                           iteration=report.iteration, keys_in=report.keys_in, keys_out=report.keys_out,
                           dtype=report.dtype, output_validated=report.output_validated, notes=report.notes)
    return run.manifest(spec.name)
