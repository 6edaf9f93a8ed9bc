"""Step 1 (cpu) of a run started from Hugging Face weights: import them as a MindFormers checkpoint.

It takes base-train's place in the DAG (``crossalign.dag.HF_IMPORT``: its folder, ``01-base-train``,
holds the checkpoint step 2 casts), so everything downstream is unchanged. The checkpoint is fp32
with the zero-centred HF norms as plain gammas (1 + w), at iteration 0: nothing was trained here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from crossalign.checkpoint.convert import convert_checkpoint
from crossalign.dag import StepSpec
from crossalign.sides.protocol import StepCallback
from crossalign.site import SiteConfig
from crossalign.store import Run
from crossalign.tasks.command import step_command


def import_hf(run: Run, spec: StepSpec, site: SiteConfig, on_step: StepCallback | None = None) -> dict[str, Any]:
    config, start = run.config, run.start
    with run.commit(spec.name, command=step_command(run, spec.name)) as out:
        report = convert_checkpoint(config.model, "hf2ms", Path(start["path"]), out.dir / "checkpoint", dtype="fp32",
                                    global_batch_size=config.training.global_batch_size)
        out.details.update(start="huggingface", source=start["path"], checkpoint="checkpoint",
                           iteration=report.iteration, keys_in=report.keys_in, keys_out=report.keys_out,
                           dtype=report.dtype, notes=report.notes)
    return run.manifest(spec.name)
