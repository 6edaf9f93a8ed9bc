"""Step 3 (cpu): convert the bf16 MindFormers checkpoint to a Megatron checkpoint for the configured core version."""

from __future__ import annotations

from typing import Any

from crossalign.site import SiteConfig
from crossalign.store import Run
from crossalign.tasks.command import step_command

STEP = "convert"


def convert(run: Run, site: SiteConfig | None = None) -> dict[str, Any]:
    from crossalign.checkpoint.convert import convert_checkpoint

    config = run.config
    with run.commit(STEP, command=step_command(run, STEP)) as out:
        layout = config.parallel.megatron  # a legacy checkpoint loads only into the layout it was written for
        report = convert_checkpoint(config.model, "ms2mg", run.step_dir("cast-bf16") / "checkpoint",
                                    out.dir / "checkpoint", core_version=config.training.megatron_core_version,
                                    tp=layout.tensor, pp=layout.pipeline, ep=layout.expert, etp=layout.expert_tensor)
        out.details.update(checkpoint="checkpoint", core_version=config.training.megatron_core_version,
                           layout=layout.ranks,
                           iteration=report.iteration, keys_in=report.keys_in, keys_out=report.keys_out,
                           dtype=report.dtype, output_validated=report.output_validated, notes=report.notes)
    return run.manifest(STEP)
