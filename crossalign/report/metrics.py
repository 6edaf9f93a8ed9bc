"""Per-series agreement metrics between the NPU and GPU logs, and the applied-lr check.

The relative error of a step is ``|npu - gpu| / |gpu|``: the GPU (Megatron) side is the
reference, because Megatron is the framework the conversion targets and the one whose numbers
the criteria were stated against. Every error is a fraction (0.005 means 0.5%).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

STEP1_LIMIT = 0.005     # step-1 relative error must be below 0.5%
MEAN_LIMIT = 0.01       # mean relative error over the run must be below 1%
GOLD_LIMIT = 0.00005    # a bitwise-level conversion: step-1 relative error below 0.005%
LR_REL_TOLERANCE = 1e-5  # logged lrs carry 7 significant digits (%.6E, float32 repr)
# Co-movement: runs fed the same batches rise and fall together step by step (the concordance of
# their detrended changes is near 1); runs fed other samples share only the trend, and their changes
# do not agree (concordance at most 0.42 on 300 generated pairs of 120 steps, mean 0.12; aligned pairs
# at least 0.99: the generator of tests/test_compare_evidence.py).
COMOVE_MIN = 0.7
PRINT_PRECISION = 1e-6  # relative resolution of the printed losses: changes that agree within it agree
COMOVE_TRIM_FROM = 20   # from 20 changes on, the worst 1 in 20 (at least 2) are left out of the co-movement
COMOVE_MIN_STEPS = 4    # 3 changes: fewer cannot show co-movement, so no pass rests on them
DETREND_WINDOW = 9      # the slow drift of the changes (the curve's bend) is this centred moving mean
SIDES = ("npu", "gpu")


@dataclass
class SeriesMetrics:
    """How one loss series of the two logs agrees; ``status`` says whether it could be compared."""

    name: str
    required: bool
    status: str  # "compared", "missing_on_npu", "missing_on_gpu", "no_common_steps"
    steps_compared: int = 0
    step1: int | None = None
    step1_rel_err: float | None = None
    mean_rel_err: float | None = None
    median_rel_err: float | None = None
    max_rel_err: float | None = None
    max_rel_err_step: int | None = None
    pearson: float | None = None
    comove: float | None = None
    first_bad_step: int | None = None
    first_nan_step: dict[str, int | None] = field(default_factory=lambda: {"npu": None, "gpu": None})
    passed: bool | None = None
    gold: bool | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class LrCheck:
    """The lr each side applied per step (each framework's logging offset undone), compared."""

    status: str  # "compared", "not_logged", "no_common_steps"
    steps_compared: int = 0
    mismatched_steps: int = 0
    first_mismatch_step: int | None = None
    npu_lr: float | None = None
    gpu_lr: float | None = None
    max_rel_diff: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _num(x) -> float | None:
    """A JSON-safe float: None for NaN and infinity (JSON has neither)."""
    x = float(x)
    return x if math.isfinite(x) else None


def aligned_frame(npu: pd.DataFrame, gpu: pd.DataFrame, series: list[str]) -> pd.DataFrame:
    """Both sides' values of the given series by step (outer join), plus each side's applied lr."""
    def side(df: pd.DataFrame, name: str) -> pd.DataFrame:
        cols = {s: f"{s}_{name}" for s in series if s in df.columns}
        part = df[["step", *cols]].rename(columns=cols).assign(**{f"logged_{name}": True})
        applied = pd.DataFrame({"step": df["step"] + df.attrs.get("lr_step_offset", 0),
                                f"lr_applied_{name}": df["lr"]})
        return part.merge(applied, on="step", how="outer")

    merged = side(npu, "npu").merge(side(gpu, "gpu"), on="step", how="outer").sort_values("step")
    for name in SIDES:
        merged[f"logged_{name}"] = merged[f"logged_{name}"].fillna(False).astype(bool)
    for s in series:
        for name in SIDES:
            if f"{s}_{name}" not in merged.columns:
                merged[f"{s}_{name}"] = np.nan
        gpu_values = merged[f"{s}_gpu"].to_numpy()
        with np.errstate(divide="ignore", invalid="ignore"):
            merged[f"{s}_rel_err"] = np.abs(merged[f"{s}_npu"].to_numpy() - gpu_values) / np.abs(gpu_values)
    return merged.reset_index(drop=True)


def _pearson(a: np.ndarray, b: np.ndarray) -> float | None:
    if len(a) < 2 or np.std(a) == 0 or np.std(b) == 0:
        return None
    return float(np.corrcoef(a, b)[0, 1])


def detrended_changes(values: np.ndarray) -> np.ndarray:
    """The per-step changes with their slow drift taken out: first differences, minus their centred
    moving mean once there are enough of them (the bend of a decaying loss curve is shared by any
    two runs of the same model, so it must not count as co-movement)."""
    changes = np.diff(values)
    if len(changes) >= 2 * DETREND_WINDOW:
        drift = pd.Series(changes).rolling(DETREND_WINDOW, center=True, min_periods=1).mean().to_numpy()
        changes = changes - drift
    return changes


def comovement(a: np.ndarray, b: np.ndarray) -> float | None:
    """Concordance correlation of the two runs' detrended per-step changes (None with fewer than 3).

    The raw correlation of the curves is high through the shared trend alone; this is not. Lin's
    concordance, ``1 - mean((da-db)^2) / (var da + var db + (mean da - mean db)^2)``, equals the Pearson
    correlation for changes of equal spread, also counts a difference in their size, and stays
    defined for curves without fluctuations: the print resolution is added to the denominator, so
    changes that agree to the printed digits agree (1), whatever their spread.
    """
    if len(a) < COMOVE_MIN_STEPS:
        return None
    da, db = detrended_changes(a), detrended_changes(b)
    if len(da) >= COMOVE_TRIM_FROM:
        # a lone spike (one step off, two changes) is for the step and mean criteria to judge, not this one
        keep = np.sort(np.argsort((da - db) ** 2)[: len(da) - max(2, len(da) // COMOVE_TRIM_FROM)])
        da, db = da[keep], db[keep]
    floor = (PRINT_PRECISION * float(np.median(np.abs(b)))) ** 2
    spread = da.var() + db.var() + (da.mean() - db.mean()) ** 2 + floor
    return float(1.0 - np.mean((da - db) ** 2) / spread)


def series_metrics(name: str, required: bool, merged: pd.DataFrame, logged: dict[str, bool],
                   excluded: set[int], step_threshold: float) -> SeriesMetrics:
    """Metrics of one series over the steps both logs hold; excluded steps leave mean/median/max/pearson."""
    if not logged["npu"] or not logged["gpu"]:
        return SeriesMetrics(name, required, "missing_on_npu" if not logged["npu"] else "missing_on_gpu",
                             passed=False if required else None)
    steps = merged["step"].to_numpy()
    a, b = merged[f"{name}_npu"].to_numpy(), merged[f"{name}_gpu"].to_numpy()
    on_npu, on_gpu = merged["logged_npu"].to_numpy(), merged["logged_gpu"].to_numpy()
    nan_first = {}
    for side_name, values, on in (("npu", a, on_npu), ("gpu", b, on_gpu)):
        bad = on & ~np.isfinite(values)
        nan_first[side_name] = int(steps[bad][0]) if bad.any() else None
    both = on_npu & on_gpu
    if not both.any():
        return SeriesMetrics(name, required, "no_common_steps", first_nan_step=nan_first,
                             passed=False if required else None)
    rel = merged[f"{name}_rel_err"].to_numpy()
    use = both & np.isfinite(rel) & ~np.isin(steps, list(excluded))
    used = rel[use]
    over = both & ~(rel <= step_threshold)  # NaN and inf count as over
    first_bad = int(steps[over][0]) if over.any() else None
    nan_steps = [s for s in nan_first.values() if s is not None]
    metrics = SeriesMetrics(
        name, required, "compared",
        steps_compared=int(use.sum()),
        step1=int(steps[both][0]),
        step1_rel_err=_num(rel[both][0]),
        mean_rel_err=_num(used.mean()) if len(used) else None,
        median_rel_err=_num(np.median(used)) if len(used) else None,
        max_rel_err=_num(used.max()) if len(used) else None,
        max_rel_err_step=int(steps[use][int(np.argmax(used))]) if len(used) else None,
        pearson=_pearson(a[use], b[use]),
        comove=comovement(a[use], b[use]),
        first_bad_step=first_bad,
        first_nan_step=nan_first,
    )
    step1_ok = metrics.step1_rel_err is not None and metrics.step1_rel_err < STEP1_LIMIT
    mean_ok = metrics.mean_rel_err is not None and metrics.mean_rel_err < MEAN_LIMIT
    comove_ok = metrics.comove is not None and metrics.comove >= COMOVE_MIN
    metrics.passed = bool(step1_ok and mean_ok and comove_ok and not nan_steps)
    metrics.gold = bool(metrics.step1_rel_err is not None and metrics.step1_rel_err < GOLD_LIMIT)
    return metrics


def lr_check(merged: pd.DataFrame) -> LrCheck:
    """Compare the applied lr at the steps both runs trained, where both logs tell it.

    Logs that print the next step's lr never tell the lr of their first step.
    """
    if "lr_applied_npu" not in merged or "lr_applied_gpu" not in merged:
        return LrCheck("not_logged")
    a, b = merged["lr_applied_npu"].to_numpy(), merged["lr_applied_gpu"].to_numpy()
    trained = merged["logged_npu"].to_numpy() & merged["logged_gpu"].to_numpy()
    both = ~np.isnan(a) & ~np.isnan(b) & trained
    if merged["lr_applied_npu"].isna().all() or merged["lr_applied_gpu"].isna().all():
        return LrCheck("not_logged")
    if not both.any():
        return LrCheck("no_common_steps")
    diff = np.abs(a[both] - b[both])
    scale = np.maximum(np.abs(a[both]), np.abs(b[both]))
    rel = np.where(scale > 0, diff / np.where(scale > 0, scale, 1.0), 0.0)
    bad = rel > LR_REL_TOLERANCE
    check = LrCheck("compared", steps_compared=int(both.sum()), mismatched_steps=int(bad.sum()),
                    max_rel_diff=float(rel.max()))
    if bad.any():
        i = int(np.argmax(bad))
        check.first_mismatch_step = int(merged["step"].to_numpy()[both][i])
        check.npu_lr, check.gpu_lr = float(a[both][i]), float(b[both][i])
    return check
