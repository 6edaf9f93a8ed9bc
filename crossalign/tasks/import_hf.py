"""Step 1 (cpu) of a run started from Hugging Face weights: import them as a MindFormers checkpoint.

It takes base-train's place in the DAG (its folder, ``01-base-train``, holds the checkpoint
step 2 casts), so everything downstream is unchanged. The checkpoint is fp32 with the
zero-centred HF norms as plain gammas (1 + w), at iteration 0: nothing was trained here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from crossalign.site import SiteConfig
from crossalign.store import Run
from crossalign.tasks.command import step_command

STEP = "base-train"


def import_hf(run: Run, site: SiteConfig | None = None) -> dict[str, Any]:
    from crossalign.checkpoint.convert import convert_checkpoint

    config, start = run.config, run.start
    with run.commit(STEP, command=step_command(run, STEP)) as out:
        report = convert_checkpoint(config.model, "hf2ms", Path(start["path"]), out.dir / "checkpoint", dtype="fp32",
                                    global_batch_size=config.training.global_batch_size)
        out.details.update(start="huggingface", source=start["path"], checkpoint="checkpoint",
                           iteration=report.iteration, keys_in=report.keys_in, keys_out=report.keys_out,
                           dtype=report.dtype, notes=report.notes)
    return run.manifest(STEP)
