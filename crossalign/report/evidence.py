"""The generator family the co-movement statistic and its thresholds are chosen from, and the real path
that judges one generated pair.

Every member is a shape of loss curve that real runs take (a warmup then a fall, a steep early fall, a
plateau, a slow drift, shared loss spikes, the benign step-2 transient, a quiet stretch whose changes are
near the print resolution). A pair is two runs of that curve:

- ``different``: fed different samples (SPEC pitfall 1): the same trend and the same step 1, each side its
  own step-to-step fluctuation (the loss of its own batches);
- ``aligned``: fed the same samples: the same fluctuation, plus what each side's arithmetic adds (fp32:
  ~1e-5; bf16: ~1e-3 relative per step, growing from near 0 at step 1 as bf16 runs part, on one side or
  on both), and the benign step-2 transient where the member has it.

Each pair is written as a MindFormers pynative log and a Megatron core 0.16.1 log (so the print
rounding and the iteration-2 mean of the real formats are in the numbers), parsed and judged by
``build_summary``: the path ``crossalign compare`` takes.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from crossalign.logs import parse_log
from crossalign.logs.synthetic import megatron_lines, mindformers_lines, write_log
from crossalign.report.compare import CompareOptions, build_summary
from crossalign.report.summary import Summary

CORE_VERSION = "0.16.1"
KINDS = ("different", "aligned")
NOISES = ("fp32", "bf16_one_side", "bf16_both_sides")


@dataclass(frozen=True)
class Pair:
    """One generated pair: per-step values of each side and how they are logged and judged."""

    member: str
    kind: str               # "different" or "aligned"
    seed: int
    npu: np.ndarray         # per-step lm loss, steps 1..n
    gpu: np.ndarray
    log_interval: int
    noise: str              # what the arithmetic adds: one of NOISES
    fluctuation: float      # the step-to-step fluctuation of the loss, relative

    @property
    def precision(self) -> str:
        return "fp32" if self.noise == "fp32" else "bf16"


def _log_uniform(rng: np.random.Generator, low: float, high: float) -> float:
    return float(np.exp(rng.uniform(np.log(low), np.log(high))))


def _fall(rng: np.random.Generator, k: np.ndarray, start: float = 0.0) -> np.ndarray:
    """An exponential fall by 1-3 nats with a time constant of 2-50 steps, from step ``start`` on."""
    depth, tau = rng.uniform(1.0, 3.0), _log_uniform(rng, 2.0, 50.0)
    return depth * (1 - np.exp(-np.clip(k - start, 0, None) / tau))


def _steep_fall(rng, k):
    return 11.9 - _fall(rng, k)


def _warmup_fall(rng, k):
    return 11.9 - _fall(rng, k, start=rng.uniform(3, 40))


def _plateau(rng, k):
    """A fall, a flat stretch, then a second fall (a staircase)."""
    second = rng.uniform(0.3, 0.8) * len(k)
    return 11.9 - _fall(rng, k) - 0.5 * _fall(rng, k, start=second)


def _slow_drift(rng, k):
    """A nearly flat loss drifting by 0.5-5% over the run, either way."""
    return 6.0 * (1 + rng.choice([-1, 1]) * rng.uniform(0.005, 0.05) * k / max(len(k) - 1, 1))


def _shared_spikes(rng, k):
    """A fall with loss spikes (+5% to +40%) that both runs take and recover from in 1-5 steps: one, and about one
    more per 300 steps (at most three)."""
    curve = 11.9 - _fall(rng, k)
    for at in rng.integers(3, max(len(k) - 1, 4), size=min(3, 1 + rng.poisson(len(k) / 300))):
        curve *= 1 + rng.uniform(0.05, 0.4) * np.exp(-np.clip(k - at, 0, None) / rng.uniform(0.5, 2.5)) * (k >= at)
    return curve


@dataclass(frozen=True)
class Member:
    name: str
    trend: Callable[[np.random.Generator, np.ndarray], np.ndarray]
    fluctuation: tuple[float, float] = (1e-3, 5e-2)  # relative step-to-step fluctuation, log-uniform
    steps: tuple[int, int] = (10, 1000)               # run length, log-uniform
    step2_transient: bool = False


FAMILY = (
    Member("steep_fall", _steep_fall),
    Member("warmup_then_fall", _warmup_fall),
    Member("plateau", _plateau),
    Member("slow_drift", _slow_drift),
    Member("shared_spikes", _shared_spikes),
    # the source's benign transient: one step ~10% off; below 20 steps it alone puts the mean past 1%
    Member("step2_transient", _steep_fall, steps=(20, 1000), step2_transient=True),
    # fluctuations down to the print resolution: co-movement can often not be told (invalid, not pass)
    Member("quiet", _slow_drift, fluctuation=(1e-7, 1e-3)),
)
MEMBERS = {m.name: m for m in FAMILY}


def _arithmetic_noise(rng: np.random.Generator, n: int, level: float) -> np.ndarray:
    """What one side's arithmetic adds to each step's relative loss: near 0 at step 1, growing
    exponentially to ``level`` within 5-200 steps (two runs parting), fresh per batch, with a slow part
    (the runs' weights have parted, so every batch is off a little in the same direction)."""
    k = np.arange(n)
    saturate = _log_uniform(rng, 5, 200)
    amplitude = level * 10 ** (-2 + 2 * np.minimum(1.0, k / saturate))
    slow = np.zeros(n)
    for i in range(1, n):
        slow[i] = 0.98 * slow[i - 1] + 0.2 * rng.normal()
    return amplitude * (rng.normal(size=n) + 0.5 * slow)


def _fluctuation(rng: np.random.Generator, n: int, sigma: float, tails: float) -> np.ndarray:
    """Per-batch relative fluctuations: normal, or Student-t (df 4) for heavier tails."""
    if tails:
        return sigma * rng.standard_t(4, size=n) / np.sqrt(2.0)
    return sigma * rng.normal(size=n)


def make_pair(member: Member, kind: str, seed: int) -> Pair:
    """One seeded pair of a family member."""
    rng = np.random.default_rng([seed, KINDS.index(kind), list(MEMBERS).index(member.name)])
    n = int(round(_log_uniform(rng, *member.steps)))
    k = np.arange(n, dtype=float)
    trend = member.trend(rng, k)
    sigma = _log_uniform(rng, *member.fluctuation)
    tails = bool(rng.random() < 0.3)
    noise = NOISES[rng.integers(len(NOISES))]
    interval = int(rng.integers(1, 11))
    level = 1e-5 if noise == "fp32" else _log_uniform(rng, 2e-4, 1e-3)
    shared = _fluctuation(rng, n, sigma, tails)
    gpu = trend * (1 + shared)
    if kind == "different":
        npu = trend * (1 + _fluctuation(rng, n, sigma * rng.uniform(0.8, 1.25), tails))
        npu[0] = gpu[0]  # the same weights and the same first batch
    else:
        npu = gpu.copy()
    npu = npu * (1 + _arithmetic_noise(rng, n, level))
    if noise == "bf16_both_sides":
        gpu = gpu * (1 + _arithmetic_noise(rng, n, level))
    if member.step2_transient:
        npu[1] *= 1 + rng.choice([-1, 1]) * rng.uniform(0.05, 0.12)
    return Pair(member.name, kind, seed, npu, gpu, interval, noise, sigma)


def pairs(member: Member, kind: str, count: int, first_seed: int = 0) -> list[Pair]:
    return [make_pair(member, kind, seed) for seed in range(first_seed, first_seed + count)]


def _interval_means(values: np.ndarray, interval: int) -> np.ndarray:
    """Per step, the value a log line covering that step shows: Megatron 0.16 prints step 1 alone and then
    the mean over 1..interval (its sums are not reset after the first line), then each next interval."""
    out = values.astype(float).copy()
    if interval == 1:
        return out
    n = len(values)
    for end in range(interval, n + 1, interval):
        start = 0 if end == interval else end - interval
        out[max(start, 1):end] = values[start:end].mean()
    return out


def write_pair(pair: Pair, folder: Path) -> tuple[Path, Path]:
    """The pair as logs: MindFormers pynative (each step the mean of the interval it falls in, as a log of
    that interval shows it) and Megatron core 0.16.1 with the pair's --log-interval."""
    npu = write_log(folder / "npu.log", mindformers_lines(list(_interval_means(pair.npu, pair.log_interval))))
    gpu = write_log(folder / "gpu.log", megatron_lines(list(pair.gpu), core_version=CORE_VERSION,
                                                       log_interval=pair.log_interval))
    return npu, gpu


def judge(pair: Pair, folder: Path | None = None) -> Summary:
    """Write, parse and judge a pair the way ``crossalign compare`` does (without the plot and report)."""
    with tempfile.TemporaryDirectory() as scratch:
        npu_log, gpu_log = write_pair(pair, Path(folder or scratch))
        options = CompareOptions(megatron_core_version=CORE_VERSION, log_interval=pair.log_interval,
                                 precision=pair.precision, plot=False)
        npu = parse_log(npu_log, core_version=CORE_VERSION, log_interval=pair.log_interval)
        gpu = parse_log(gpu_log, core_version=CORE_VERSION, log_interval=pair.log_interval)
        summary, _ = build_summary(npu, gpu, options)
    return summary
