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
# Co-movement: runs fed the same batches share their step-to-step fluctuations, runs fed other samples share
# only the trend. The difference of the two runs holds no trend whatever its shape, so its step-to-step
# spread is set against each side's own fluctuation (see ``comovement``). The numbers below are chosen from
# the generator family of ``crossalign.report.evidence`` (benchmarks/verdict_family.py measures them).
COMOVE_Z = 18.0          # a pass needs co-movement >= 1 - exp(-COMOVE_Z / sqrt(lines)) (``comove_min``)
COMOVE_MIN_STEPS = 20    # compared lines: fewer cannot tell co-movement from chance, so no pass rests on them
MIN_STEPS = 4            # fewer compared steps than this cannot be judged at all
PRINT_PRECISION = 1e-6   # relative resolution of printed losses (%.6E; 6 decimals of a loss >= 1)
RESOLUTION_FACTOR = 20   # an own fluctuation below this many print resolutions cannot be measured
# How far aligned runs part step to step (the per-step spread of their relative difference) through
# arithmetic alone: fp32 runs agree to ~1e-5, bf16 runs part by up to ~1e-3 per side. Only a difference
# beyond it proves that runs which do not co-move saw different samples; an unknown precision is taken as
# bf16 (the real job's).
ARITHMETIC_NOISE = {"fp32": 1e-4, "bf16": 2e-3}
SMOOTH_EDGE = 3          # values at either end without a smooth curve (running median of 5, then 1-2-1)
REJECT = 3.0             # residuals beyond this many robust sigmas (spikes) are left out of a fluctuation
MAD_TO_SIGMA = 1.4826    # the median absolute deviation of white noise times this is its sigma
MEDIAN_TO_SIGMA = 1.211  # white noise: its sigma over the root mean square of the kept residuals (median curve)
HANNING_TO_SIGMA = 1.239  # ... from the 1-2-1 mean of the running medians
SPIKE_FACTOR = 10.0      # step 2 stands out when its error is this many times the others'
SPIKE_FLOOR = 1e-4       # ... and at least 0.01%
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
    comove_min: float | None = None
    fluctuation: float | None = None
    difference_spread: float | None = None
    comove_undecided: str | None = None
    comove_from_step: int | None = None
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


def _running_median(x: np.ndarray) -> np.ndarray:
    """The median of each 5 consecutive values: values 2 .. n-3 of a curve through ``x``. The median of a window
    on a monotone stretch is its centre, so a fall of any steepness and a bend (the end of a warmup) pass
    through it unchanged; a lone spike does not move it."""
    return np.median(np.lib.stride_tricks.sliding_window_view(x, 5), axis=1)


def _hanning(median: np.ndarray) -> np.ndarray:
    """Tukey's 1-2-1 mean of the running medians (values 3 .. n-4): smoother, so white noise leaves residuals
    of a steadier spread, but a sharp bend leaves a quarter of its second difference in them."""
    return (median[:-2] + 2 * median[1:-1] + median[2:]) / 4


def _rejecting_rms(residual: np.ndarray, to_sigma: float) -> float:
    """Root mean square of the residuals about their median, those beyond REJECT robust sigmas (MAD) left out
    (spikes, however many, up to half), scaled by ``to_sigma`` to the standard deviation of white noise."""
    residual = np.abs(residual - np.median(residual))
    bound = REJECT * MAD_TO_SIGMA * float(np.median(residual))
    kept = residual[residual <= bound] if bound > 0 else residual
    return to_sigma * float(np.sqrt(np.mean(kept ** 2)))


def _fluctuation(x: np.ndarray, scale: np.ndarray | None = None, *, trend_free: bool = False) -> float:
    """The per-step fluctuation of ``x`` around a smooth curve through it (each residual relative to ``|scale|``
    at its step: the loss falls). Of the two curves (running median; with the 1-2-1 mean) the smaller
    fluctuation is taken, so neither a bend nor a spike can make a side look more fluctuating than it is;
    a ``trend_free`` series (the runs' difference) uses the steadier 1-2-1 curve alone."""
    if len(x) <= 2 * SMOOTH_EDGE:
        return 0.0
    median = _running_median(x)
    curves = [(x[3:-3] - _hanning(median), HANNING_TO_SIGMA)]
    if not trend_free:
        curves.append((x[2:-2] - median, MEDIAN_TO_SIGMA))
    found = []
    for residual, to_sigma in curves:
        if scale is not None:
            edge = (len(x) - len(residual)) // 2
            residual = residual / np.abs(scale[edge:len(x) - edge])
        found.append(_rejecting_rms(residual, to_sigma))
    return min(found)


def comove_min(lines: int) -> float:
    """The co-movement a pass needs with this many compared lines: runs fed other samples reach
    ``1 - exp(-9 / sqrt(lines))`` once in a thousand pairs by chance (white noise), so the bar is set
    at COMOVE_Z instead of 9 (the margin the generator family confirms)."""
    return float(1.0 - np.exp(-COMOVE_Z / np.sqrt(lines)))


@dataclass
class CoMovement:
    """How much of the two runs' step-to-step fluctuation they share; ``undecided`` says why it cannot be told."""

    value: float | None
    fluctuation: float | None = None  # each side's own per-step fluctuation, relative (root mean square of both)
    difference: float | None = None   # per-step spread of the two runs' relative difference
    needed: float | None = None       # the value a pass needs with this many lines (``comove_min``)
    undecided: str | None = None


def isolated_step2_spike(steps: np.ndarray, rel: np.ndarray) -> bool:
    """Step 2 alone stands out: its error is SPIKE_FACTOR times step 1's and the later steps' median (and
    at least SPIKE_FLOOR), while the later steps agree (median within the mean limit)."""
    if len(steps) < 3 or steps[0] != 1 or steps[1] != 2:
        return False
    rest = float(np.median(rel[2:]))
    return bool(rel[1] >= SPIKE_FLOOR and rel[1] >= SPIKE_FACTOR * max(rel[0], rest) and rest <= MEAN_LIMIT)


def comovement(a: np.ndarray, b: np.ndarray, precision: str = "bf16") -> CoMovement:
    """The share of each run's own step-to-step fluctuation that the other run has too.

    ``d = (a - b) / |b|`` holds no trend, whatever the curve's shape, so its fluctuation ``s_d`` is what the
    runs do not share; ``s_a``, ``s_b`` are each side's own (relative) fluctuation. Each is measured around a
    robust smooth curve, the largest residuals left out (``_fluctuation``), so a trend, a bend, a shared
    spike or one odd step cannot make a side look more fluctuating than it is. ``1 - s_d^2 / (s_a^2 + s_b^2)``
    is near 1 for runs fed the same batches and near 0 for runs fed other samples, whose difference
    fluctuates as much as both runs together.

    A pass needs ``comove_min(lines)``. Below it, the runs do not co-move (a fail) only if they differ by
    more than their arithmetic (``precision``) makes aligned runs part; otherwise it cannot be told, and
    neither with too few lines or own fluctuations within ``RESOLUTION_FACTOR`` print resolutions.
    """
    n = len(a)
    if n < COMOVE_MIN_STEPS:
        return CoMovement(None, undecided=f"{n} steps compared, at least {COMOVE_MIN_STEPS} are needed to tell "
                                          "whether the two runs move together")
    scale = np.abs(b)
    own = [_fluctuation(x, scale) for x in (a, b)]
    fluctuation = float(np.sqrt((own[0] ** 2 + own[1] ** 2) / 2))
    difference = _fluctuation((a - b) / scale, trend_free=True)
    resolution = PRINT_PRECISION * max(1.0, 1.0 / float(np.median(np.minimum(np.abs(a), scale))))
    value = float(1.0 - difference ** 2 / (2 * fluctuation ** 2)) if fluctuation > 0 else None
    result = CoMovement(value, fluctuation, difference, comove_min(n))
    if difference > ARITHMETIC_NOISE[precision] and (value is None or value < result.needed):
        return result  # decided: the runs differ by more than arithmetic, and not in step with their fluctuations
    if fluctuation < RESOLUTION_FACTOR * resolution:
        result.undecided = (f"the runs' own step-to-step fluctuation ({_sci(fluctuation)}) is within "
                            f"{RESOLUTION_FACTOR} print resolutions ({_sci(resolution)}): no co-movement can be seen")
    elif value < result.needed:
        result.undecided = (f"co-movement {value:.3f} < {result.needed:.3f} needed with {n} steps, but the runs differ "
                            f"step to step by {_sci(difference)}, no more than {precision} arithmetic makes aligned "
                            f"runs part (up to {ARITHMETIC_NOISE[precision]:g}): their own fluctuation "
                            f"({_sci(fluctuation)}) is too small to show co-movement through it")
    return result


def _sci(x: float) -> str:
    return f"{x:.2g}"


def series_metrics(name: str, required: bool, merged: pd.DataFrame, logged: dict[str, bool],
                   excluded: set[int], step_threshold: float, precision: str = "bf16") -> SeriesMetrics:
    """Metrics of one series over the steps both logs hold; excluded steps leave mean/median/max/pearson
    and the co-movement, and so does an isolated step-2 spike (with step 1) from the co-movement."""
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
    moving = use.copy()
    if isolated_step2_spike(steps[use], used):
        moving &= steps > 2
    co = comovement(a[moving], b[moving], precision)
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
        comove=None if co.value is None else round(co.value, 6),
        comove_min=co.needed,
        fluctuation=co.fluctuation,
        difference_spread=co.difference,
        comove_undecided=co.undecided,
        comove_from_step=int(steps[moving][0]) if moving.any() else None,
        first_bad_step=first_bad,
        first_nan_step=nan_first,
    )
    step1_ok = metrics.step1_rel_err is not None and metrics.step1_rel_err < STEP1_LIMIT
    mean_ok = metrics.mean_rel_err is not None and metrics.mean_rel_err < MEAN_LIMIT
    if not (step1_ok and mean_ok) or nan_steps:
        metrics.passed = False
    elif co.undecided:
        metrics.passed = None  # the step and mean criteria hold, but nothing shows the runs saw the same batches
    else:
        metrics.passed = co.value is not None and co.value >= co.needed
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
