"""Step 3 (cpu): convert the bf16 MindFormers checkpoint to a Megatron checkpoint for the configured core version.

The checkpoint is in the run's ``training.megatron_ckpt_format``: legacy rank files for the
run's Megatron layout, or torch_dist (one copy, resharded by Megatron at load). A torch_dist
conversion can be spread over the cpu pool (site ``convert_parts``): each part (a range of
layers, ``convert_part``) runs as a flow run of its own on any worker that shares the run
store and writes its data files into the run's parts folder; the step itself then writes the
index and commits the checkpoint (``convert``). Without parts, or when they are not all
there, the step converts the whole model in its own process, as it does for one worker.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from crossalign.checkpoint.convert import convert_checkpoint, convert_part as write_part, finish_parts
from crossalign.dag import StepSpec
from crossalign.sides.megatron.torch_dist_write import part_index
from crossalign.sides.protocol import StepCallback
from crossalign.site import SiteConfig
from crossalign.store import Run, sha256_json
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


def parts_dir(run: Run, spec: StepSpec) -> Path:
    """Where the parts of this run's torch_dist conversion are written: beside the step's folder, named by the
    digest of the step's inputs, so that parts of an older input are never finished into a checkpoint."""
    return run.path / f".{spec.dirname}.parts-{sha256_json(run.input_digests(spec.name))[:16]}"


def convert_part(run: Run, spec: StepSpec, part: int, parts: int,
                 on_step: StepCallback | None = None) -> dict[str, Any]:
    """Write part ``part`` of ``parts`` of the run's torch_dist conversion into the run's parts folder."""
    config = run.config
    folder = parts_dir(run, spec)
    for stale in run.path.glob(f".{spec.dirname}.parts-*"):
        if stale != folder:  # parts of an input that has changed since
            shutil.rmtree(stale, ignore_errors=True)
    report = write_part(config.model, run.step_dir(spec.inputs[0]) / "checkpoint", folder, part, parts,
                        core_version=config.training.megatron_core_version,
                        progress=ConversionProgress(on_step) if on_step else None)
    return {"part": part, "parts": parts, "files": [str(file) for file in report.files], "seconds": report.seconds,
            "bytes_in": report.bytes_in, "bytes_out": report.bytes_out}


def _parts_written(folder: Path, parts: int) -> bool:
    return all(any(folder.glob(f"iter_*/{part_index(part)}")) for part in range(parts))


def convert(run: Run, spec: StepSpec, site: SiteConfig, on_step: StepCallback | None = None) -> dict[str, Any]:
    config = run.config
    torch_dist = config.training.megatron_ckpt_format == "torch_dist"
    parts = site.convert_parts if torch_dist else 1
    folder = parts_dir(run, spec) if parts > 1 else None
    with run.commit(spec.name, command=step_command(run, spec.name)) as out:
        source, target = run.step_dir(spec.inputs[0]) / "checkpoint", out.dir / "checkpoint"
        core_version = config.training.megatron_core_version
        if folder is not None and _parts_written(folder, parts):
            report = finish_parts(config.model, source, folder, target, parts, core_version=core_version)
            out.details.update(parts=parts)
        else:
            # a legacy checkpoint loads only into the layout it was written for; torch_dist into any
            layout = config.parallel.megatron
            sizes = {} if torch_dist else dict(tp=layout.tensor, pp=layout.pipeline, ep=layout.expert,
                                               etp=layout.expert_tensor)
            report = convert_checkpoint(config.model, "ms2mg", source, target, core_version=core_version,
                                        progress=ConversionProgress(on_step) if on_step else None,
                                        ckpt_format=config.training.megatron_ckpt_format, **sizes)
        out.details.update(checkpoint="checkpoint", core_version=core_version, format=report.format,
                           layout="any (torch_dist)" if torch_dist else config.parallel.megatron.ranks,
                           iteration=report.iteration, keys_in=report.keys_in, keys_out=report.keys_out,
                           dtype=report.dtype, output_validated=report.output_validated, notes=report.notes)
    return run.manifest(spec.name)
