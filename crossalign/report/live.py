"""The comparison of steps 4 and 5 while they train, and whether its outcome is already decided.

Both training steps write their logs into their staging folders in the run store while they run
(``.04-megatron-train.partial-<host>-<pid>-<nonce>/train.log``), into their step folders once
committed, or keep them in ``live/`` when stopped (``crossalign.stop``). The live
comparison reads from wherever the log is now, only the complete lines (a line being written is
read on the next look), and judges what both sides logged so far with the comparison of step 6
(``build_summary``: the same parsers, the same metrics, whatever co-movement statistic it uses).

An outcome is decided (the run cannot pass, whatever the remaining steps log) when:
- step 1 is off by at least its limit on every judged series (lm loss and each MTP loss);
- a judged series is NaN or infinite on one side;
- the errors summed so far, spread over all N steps, already reach the mean limit: the mean
  over N steps can only grow from there, even if every remaining step agrees exactly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from crossalign.dag import COMPARED, step_spec
from crossalign.logs import parse_log_text
from crossalign.report.compare import DAG_LOG_INTERVAL, CompareOptions, build_summary, options_from_config
from crossalign.report.metrics import MEAN_LIMIT, STEP1_LIMIT
from crossalign.report.summary import Summary
from crossalign.sides.log_common import LogFormatError
from crossalign.stop import kept_log_path
from crossalign.store import Run

SIDES = {spec.pool: spec.name for spec in COMPARED}  # the comparison's sides (gpu, npu) and the steps that log them


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.4g}%"


def current_log(run: Run, step: str) -> Path | None:
    """Where the training log of ``step`` is now: the staging folder of its running attempt, its committed
    step folder, or the copy a stopped attempt kept; None before it exists."""
    spec = step_spec(step)
    attempt = run.attempt(step) or {}
    if attempt.get("status") == "running":
        staging = sorted(run.path.glob(f".{spec.dirname}.partial-{attempt.get('host')}-{attempt.get('pid')}-*"))
        if staging and (staging[-1] / "train.log").is_file():
            return staging[-1] / "train.log"
    manifest = run.manifest(step)
    if manifest is not None:
        return run.step_dir(step) / manifest.get("details", {}).get("log", "train.log")
    kept = kept_log_path(run, step)
    return kept if kept.is_file() else None


class GrowingLog:
    """The complete lines of a log that is still being written, read a little at a time.

    The file may move (its staging folder is renamed into place when the step commits) or be
    replaced by another attempt's log: a file that does not hold what was read where it was read is
    read anew.
    """

    TAIL = 512  # the last bytes read must be where they were: the lines of the last iterations

    def __init__(self) -> None:
        self.path: Path | None = None
        self.text = ""
        self._data = b""

    def read(self, path: Path | None) -> bool:
        """Read the lines completed since the last look; True if there are any (or the file changed)."""
        if path is None:
            return False
        try:
            with open(path, "rb") as fh:
                seen = self._data[-self.TAIL:]
                fh.seek(len(self._data) - len(seen))
                fresh = fh.read(len(seen)) != seen
                if fresh:
                    self._data, self.text = b"", ""
                fh.seek(len(self._data))
                chunk = fh.read()
        except FileNotFoundError:  # renamed into place or removed between the look and the read
            return False
        self.path = path
        cut = chunk.rfind(b"\n")
        if cut >= 0:
            self._data += chunk[: cut + 1]
            self.text = self._data.decode("utf-8", errors="replace")
        return fresh or cut >= 0


@dataclass(frozen=True)
class Decision:
    """Why the run cannot pass any more, decided at ``step`` (the steps both sides had logged)."""

    rule: str  # "step1", "nan", "mean", "failed"
    reason: str
    step: int


@dataclass
class Snapshot:
    """What both sides logged so far and how it compares."""

    total: int
    logged: dict[str, int]  # side -> last step logged (0: none yet)
    compared: int = 0  # steps both sides logged
    summary: Summary | None = None
    merged: pd.DataFrame | None = None
    decision: Decision | None = None
    paths: dict[str, str] = field(default_factory=dict)
    frames: dict[str, pd.DataFrame] = field(default_factory=dict)  # side -> its parsed log so far

    def judged(self) -> list:
        if self.summary is None:
            return []
        return [m for m in self.summary.series.values() if m.required and m.status == "compared"]

    def rows(self) -> list[dict[str, object]]:
        """One row per series compared so far (the live artifact's table and the CLI's)."""
        if self.summary is None:
            return []
        return [{"series": m.name, "steps": m.steps_compared,
                 "step1_rel_err": _pct(m.step1_rel_err) if m.step1 == 1 else "n/a",
                 "mean_rel_err_so_far": _pct(m.mean_rel_err),
                 "comove_so_far": "n/a" if m.comove is None else round(m.comove, 4),
                 "comove_needed": "n/a" if m.comove_min is None else round(m.comove_min, 4),
                 "nan": ", ".join(f"{side} step {s}" for side, s in m.first_nan_step.items() if s is not None)
                 or "none"}
                for m in self.summary.series.values() if m.status == "compared"]

    def headline(self) -> str:
        shown = ", ".join(f"{step} at {self.logged[side]}" for side, step in SIDES.items())
        return f"steps 1-{self.compared} of {self.total} compared ({shown})" if self.compared \
            else f"waiting for both sides to log step 1 ({shown})"


def decide(summary: Summary, total: int, mtp_expected: bool) -> Decision | None:
    """The rule that makes a pass impossible, from what both sides logged so far; None while it is open."""
    judged = [m for m in summary.series.values() if m.required and m.status == "compared"]
    if not judged:
        return None
    at = max(m.steps_compared for m in judged)
    for m in judged:
        for side, step in m.first_nan_step.items():
            if step is not None:
                return Decision("nan", f"{m.name} is NaN/inf on {side} ({SIDES[side]}) at step {step}", step)
    has_mtp = any(m.name.startswith("mtp_") for m in judged)
    if (has_mtp or not mtp_expected) and all(m.step1 == 1 and m.step1_rel_err is not None
                                             and m.step1_rel_err >= STEP1_LIMIT for m in judged):
        errors = ", ".join(f"{m.name} {_pct(m.step1_rel_err)}" for m in judged)
        return Decision("step1", f"step-1 relative error >= {_pct(STEP1_LIMIT)} on every series ({errors})", 1)
    for m in judged:
        if m.mean_rel_err is None:
            continue
        spread = m.mean_rel_err * m.steps_compared / total
        if spread >= MEAN_LIMIT:
            return Decision("mean", f"{m.name}: the relative errors of its first {m.steps_compared} steps sum to "
                                    f"{_pct(m.mean_rel_err * m.steps_compared)}, so the mean over all {total} steps "
                                    f"is at least {_pct(spread)} >= {_pct(MEAN_LIMIT)} even if every remaining "
                                    "step agrees exactly", at)
    return None


class LiveComparison:
    """Compares the two training logs of a run as they grow; ``update()`` after each look."""

    def __init__(self, run: Run):
        self.run = run
        config = run.config
        self.options: CompareOptions = options_from_config(config, log_interval=DAG_LOG_INTERVAL, plot=False)
        self.total = config.training.train_iters
        self.logs = {side: GrowingLog() for side in SIDES}
        self.snapshot = Snapshot(self.total, {side: 0 for side in SIDES})

    def update(self) -> Snapshot | None:
        """Read what the logs gained; the new snapshot, or None when nothing changed."""
        changed = [self.logs[side].read(current_log(self.run, step)) for side, step in SIDES.items()]
        if not any(changed):
            return None
        frames = {side: self._frame(side) for side in SIDES}
        logged = {side: 0 if frame is None or frame.empty else int(frame["step"].max())
                  for side, frame in frames.items()}
        snapshot = Snapshot(self.total, logged,
                            paths={side: str(log.path) for side, log in self.logs.items() if log.path},
                            frames={side: frame for side, frame in frames.items() if frame is not None})
        if all(frame is not None and not frame.empty for frame in frames.values()):
            summary, merged = build_summary(frames["npu"], frames["gpu"], self.options)
            snapshot.summary, snapshot.merged = summary, merged
            snapshot.compared = max((m.steps_compared for m in snapshot.judged()), default=0)
            snapshot.decision = decide(summary, self.total, bool(self.options.mtp_expected))
        self.snapshot = snapshot
        return snapshot

    def _frame(self, side: str) -> pd.DataFrame | None:
        log = self.logs[side]
        if not log.text:
            return None
        try:
            return parse_log_text(log.path, log.text, self.options.megatron_core_version,
                                  self.options.mtp_loss_scaling_factor, self.options.log_interval)
        except LogFormatError:  # no step line yet
            return None


def titled(summary: Summary, title: str) -> Summary:
    """The summary under another headline (the plots of a comparison still going say how far it is)."""
    return dataclasses.replace(summary, verdict=title)
