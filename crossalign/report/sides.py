"""What was handed to the comparison: the same log on both sides, a side in the other framework's format,
or the logs of two different models.

Each of these passes, or fails with a wrong diagnosis, if nobody looks: the same log given twice agrees
exactly ("gold standard"); a Megatron log given as the NPU side compares like any other; a MoE run
against a dense one disagrees, and the disagreement gets read as an lr or a sample-order problem. The
parsers know each log's format and which series it printed, which is all these checks need.
"""

from __future__ import annotations

import filecmp
import os
from pathlib import Path

import pandas as pd

from crossalign.logs import FORMAT_NAMES
from crossalign.report.metrics import STEP1_LIMIT, LrCheck, SeriesMetrics
from crossalign.sides.registry import SIDES

SIDE_FORMATS = {side.pool: side.log_formats for side in SIDES.values()}  # the comparison's sides are pools
OPTION = {"npu": "--npu-log", "gpu": "--gpu-log"}
# Step-1 lm losses this far apart (relative) come from different models or weights: a conversion fault of
# the kind SPEC names is about 5% at step 1, two different first batches a few percent.
SCALE_APART = 0.2
# Diagnoses of the training dynamics, which mean nothing when the two runs train different models.
DYNAMICS_PATTERNS = ("lr_mismatch", "step2_spike", "uncorrelated", "growing_divergence", "routing_drift")


class SideFormatError(ValueError):
    """A log given as one side is in the other framework's format; names the file and the option."""


def same_log(npu: pd.DataFrame, gpu: pd.DataFrame) -> str | None:
    """The reason the two sides are one log (the same bytes, or the same records in the same format), else None."""
    paths = [Path(frame.attrs["path"]) for frame in (npu, gpu)]
    if all(path.is_file() for path in paths) and (os.path.samefile(*paths) or filecmp.cmp(*paths, shallow=False)):
        what = "the same file" if os.path.samefile(*paths) else "the same bytes"
        return f"both sides are the same log: {paths[0]} and {paths[1]} are {what}, so they agree by construction"
    if npu.attrs["format"] == gpu.attrs["format"] and set(npu.attrs["logged"]) == set(gpu.attrs["logged"]):
        columns = ["step", *sorted(npu.attrs["logged"])]
        if npu[columns].reset_index(drop=True).equals(gpu[columns].reset_index(drop=True)):
            framework = FORMAT_NAMES.get(npu.attrs["format"], npu.attrs["format"])
            return (f"both sides are the same log: {paths[0]} and {paths[1]} hold the same {framework} records, "
                    "so they agree by construction")
    return None


def check_formats(npu: pd.DataFrame, gpu: pd.DataFrame, allow_any_format: bool = False) -> None:
    """Refuse a side whose log is the other framework's (sides swapped, or one framework on both), unless
    ``allow_any_format`` says it is intended (MindSpeed on Ascend prints Megatron's records; two Megatron runs)."""
    if allow_any_format or same_log(npu, gpu):
        return  # the same log twice is judged invalid by the comparison, with that reason
    wrong = {side: frame for side, frame in (("npu", npu), ("gpu", gpu))
             if frame.attrs["format"] not in SIDE_FORMATS[side]}
    if not wrong:
        return
    words = [f"{OPTION[side]} {frame.attrs['path']} is a {FORMAT_NAMES.get(frame.attrs['format'], frame.attrs['format'])}"
             f" log, the {'GPU' if side == 'npu' else 'NPU'} side's format" for side, frame in wrong.items()]
    fix = "the sides look swapped: exchange --npu-log and --gpu-log" if len(wrong) == 2 else (
        "the NPU side is MindFormers' log and the GPU side Megatron's")
    raise SideFormatError(f"{'; '.join(words)}: {fix}, or pass --allow-any-format if this is intended")


def different_models(series: dict[str, SeriesMetrics], frames: dict[str, pd.DataFrame], lr: LrCheck) -> dict | None:
    """A finding when the two logs are of different models: the lm loss of step 1 far apart
    (``SCALE_APART``), or apart beyond the step-1 limit while a series of the model's structure (the MoE
    aux loss, the MTP losses) is printed by one side only. None otherwise."""
    lm = series.get("lm_loss")
    if lm is None or lm.step1_rel_err is None:
        return None
    structure = []
    logged = {side: set(frame.attrs["logged"]) for side, frame in frames.items()}
    aux = [side for side in logged if "aux_loss" in logged[side]]
    if len(aux) == 1:
        structure.append(f"the MoE load-balancing loss is printed by {aux[0]} only (a MoE model against a dense one)")
    mtp = {side: sorted(c for c in names if c.startswith("mtp_")) for side, names in logged.items()}
    if mtp["npu"] != mtp["gpu"]:
        structure.append(f"the MTP losses differ (npu {len(mtp['npu'])}, gpu {len(mtp['gpu'])} MTP layer(s))")
    apart = lm.step1_rel_err
    if apart < SCALE_APART and not (structure and apart >= STEP1_LIMIT):
        return None
    values = {side: frame.loc[frame["step"] == lm.step1, "lm_loss"] for side, frame in frames.items()}
    scale = (f"the lm loss of step {lm.step1} is npu {float(values['npu'].iloc[0]):.6g} against gpu "
             f"{float(values['gpu'].iloc[0]):.6g} ({100 * apart:.3g}% apart, before any update)")
    evidence = [*structure, scale]
    if lr.first_mismatch_step is not None:
        evidence.append(f"the lr schedules differ too (first at step {lr.first_mismatch_step})")
    return {"pattern": "different_models", "series": "lm_loss", "step": lm.step1, "message": (
        "the two logs look like runs of different models: " + "; ".join(evidence) + ". Differences in the "
        "lr or the sample order cannot be read from such a pair: give both sides the same model config and "
        "checkpoint" + ("" if structure else " (or one side did not load the checkpoint, or converted it wrong)"))}


def name_different_models(series: dict[str, SeriesMetrics], frames: dict[str, pd.DataFrame], lr: LrCheck,
                          findings: list[dict]) -> list[dict]:
    """The findings with a ``different_models`` one first when the logs are of different models; the
    diagnoses of the training dynamics (lr, step-2 spike, sample order, divergence) are then left out."""
    found = different_models(series, frames, lr)
    if found is None:
        return findings
    return [found, *(f for f in findings if f["pattern"] not in DYNAMICS_PATTERNS)]
