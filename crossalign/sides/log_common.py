"""What the Megatron and MindFormers parsers share: reading, number conversion, the result frame.

A parsed log is a pandas DataFrame with one row per step (sorted, unique) and the columns
``step, lm_loss, mtp_1_loss .. mtp_K_loss, aux_loss, lr, grad_norm, step_time_ms``. What the
comparison needs to know about the log travels in ``DataFrame.attrs``:

- ``path``, ``format`` ("megatron", "mindformers-pynative", "mindformers-graph");
- ``logged``: the series the log actually printed (a column of NaN not listed here was never logged);
- ``lr_step_offset``: the logged lr at step s is the lr applied at step s + offset
  (1 for Megatron and MindFormers pynative, which print the next step's lr; 0 for graph mode);
- ``notes``: sentences for the report (restarts, corrections, totals);
- ``invalid``: reasons that make the run invalid whatever its losses (a failed Megatron load);
- ``corrections``: the Megatron >= 0.16 first-two-iterations corrections, raw and corrected values;
- ``duplicate_steps`` / ``restart_steps``: steps logged more than once (identical / different values);
- ``extra_losses``: columns of losses the log printed besides lm, MTP and the MoE aux loss (``z_loss``,
  ``nsp_loss``, ``indexer_loss``, ...), kept under their own names after ``aux_loss``;
- ``unreadable``: lines that look like step records but could not be read, each
  ``{"line", "why", "text"}`` (more than ``MAX_UNREADABLE`` of them fail the parse);
- Megatron only: ``core_version``, ``log_interval``, ``iteration2`` (both readings of the second line
  after a process start when the core version is unknown); graph mode only: ``loss_is_total`` (only
  the total loss was printed) and ``unusable`` (series printed in a form that cannot be compared).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd

NAN = float("nan")
MAX_REPORTED_RESTARTS = 10
MAX_UNREADABLE = 3  # more step-like lines than this that cannot be read fail the parse
# A launcher's rank tag at the start of a line: ``[default3]:`` (torchrun --tee), ``[rank7]:``,
# ``[lrdn3321:3]:`` (srun --label with the host name).
RANK_TAG_RE = re.compile(r"^\s*\[([^\]\s]+)\]:")


class LogFormatError(ValueError):
    """A log file that cannot be read as a Megatron or MindFormers training log; names the file."""


def mtp_column(k: int) -> str:
    return f"mtp_{k}_loss"


def frame_columns(mtp_count: int, extras: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The column order of a parsed log."""
    return ["step", "lm_loss", *(mtp_column(k) for k in range(1, mtp_count + 1)),
            "aux_loss", *extras, "lr", "grad_norm", "step_time_ms"]


def loss_column(label: str) -> str:
    """The column of an extra loss printed under ``label``: ``"nsp loss"`` -> ``"nsp_loss"``."""
    return re.sub(r"[^0-9a-z]+", "_", label.lower()).strip("_")


def line_of(text: str, offset: int) -> tuple[int, str]:
    """The 1-based line number at ``offset`` and that line's text (cut to 160 characters)."""
    start = text.rfind("\n", 0, offset) + 1
    end = text.find("\n", offset)
    line = text[start: end if end >= 0 else len(text)]
    return text.count("\n", 0, start) + 1, line[:160]


def unreadable_notes(path: Path, fmt: str, unreadable: list[dict]) -> list[str]:
    """Notes naming the step-like lines that could not be read; a LogFormatError when they are many.

    A line that holds a step marker but cannot be read is never dropped silently: a few are reported
    (a line garbled by two ranks writing at once happens), more mean the log is not what the parser
    thinks it is, and no verdict should rest on it.
    """
    if not unreadable:
        return []
    first = unreadable[0]
    if len(unreadable) > MAX_UNREADABLE:
        raise LogFormatError(
            f"{path}: {len(unreadable)} lines look like {fmt} step records but cannot be read; the first is "
            f"line {first['line']} ({first['why']}): {first['text']!r}")
    return [f"{path.name} line {u['line']}: looks like a step record but cannot be read ({u['why']}); "
            f"left out: {u['text']!r}" for u in unreadable]


def pick_rank(tags: list[str], usable: np.ndarray, notes: list[str]) -> np.ndarray:
    """Rows of one launcher rank tag when several tags printed step records.

    The last rank prints Megatron's line and the last pipeline stage MindFormers' loss, so the tag
    with the highest rank number among those that printed usable rows is taken; rows without a tag
    count as their own group. Returns the mask of rows to keep.
    """
    candidates = sorted({t for t, ok in zip(tags, usable) if ok}, key=_rank_order)
    if len(candidates) <= 1:
        return usable
    chosen = candidates[-1]
    notes.append(f"{len(candidates)} launcher rank tags printed step records ({', '.join(candidates)}); "
                 f"those of [{chosen}] (the highest rank: the last pipeline stage) are used")
    return usable & np.array([t == chosen for t in tags], dtype=bool)


def _rank_order(tag: str) -> tuple[int, str]:
    digits = re.findall(r"\d+", tag)
    return (int(digits[-1]) if digits else -1, tag)


def read_log_text(path: Path) -> tuple[str, bool]:
    """The text of a log and whether its last line was cut off (then dropped: a partial line lies)."""
    path = Path(path)
    if not path.is_file():
        raise LogFormatError(f"{path}: no such log file")
    text = path.read_text(encoding="utf-8", errors="replace")
    if text and not text.endswith("\n"):
        cut = text.rfind("\n")
        return (text[: cut + 1] if cut >= 0 else ""), True
    return text, False


def floats(values: tuple[str, ...] | list[str]) -> np.ndarray:
    """Strings captured by a regex -> float64; an empty capture (field not printed) is NaN.

    Python's float() reads every spelling the frameworks print: ``1.2E+01``, ``nan``, ``NaN``, ``INF``.
    """
    if "" in values:
        values = ["nan" if not v else v for v in values]
    return np.fromiter(map(float, values), dtype=np.float64, count=len(values))


def step_ranges(steps) -> str:
    """``[2, 3, 4, 9]`` -> ``"2-4, 9"`` for messages."""
    steps = sorted(int(s) for s in steps)
    if not steps:
        return ""
    out, start, prev = [], steps[0], steps[0]
    for s in steps[1:]:
        if s == prev + 1:
            prev = s
            continue
        out.append(f"{start}-{prev}" if prev > start else f"{start}")
        start = prev = s
    out.append(f"{start}-{prev}" if prev > start else f"{start}")
    return ", ".join(out)


def finish_frame(path: Path, fmt: str, steps: np.ndarray, columns: dict[str, np.ndarray],
                 mtp_count: int, logged: list[str], attrs: dict, extras: list[str] | tuple[str, ...] = ()) -> pd.DataFrame:
    """Rows in log order -> one row per step, the last occurrence winning, sorted by step.

    A step printed more than once with identical values is a duplicate (several ranks in one
    file); with different values it is a restart that re-ran the step, and the report says so.
    """
    if len(steps) == 0:
        raise LogFormatError(f"{path}: no {fmt} step line with a loss value")
    data = {"step": steps.astype(np.int64)}
    for name in frame_columns(mtp_count, extras)[1:]:
        data[name] = columns.get(name, np.full(len(steps), NAN))
    df = pd.DataFrame(data)
    notes = list(attrs.pop("notes", []))
    drops = np.flatnonzero(np.diff(steps) < 0) + 1
    if 0 < len(drops) <= MAX_REPORTED_RESTARTS:
        for i in drops:
            notes.append(f"the log goes back from step {int(steps[i - 1])} to step {int(steps[i])} "
                         "(a restart); the last occurrence of each step is used")
    elif len(drops):
        notes.append(f"the step numbers go back {len(drops)} times (interleaved ranks or many restarts); "
                     "the last occurrence of each step is used")
    repeated = df["step"].duplicated(keep=False)
    duplicate_steps: list[int] = []
    restart_steps: list[int] = []
    if repeated.any():
        losses = [c for c in df.columns if c.endswith("_loss") or c == "lr"]
        varying = df[repeated].fillna(-1.0).groupby("step")[losses].nunique().max(axis=1) > 1
        restart_steps = [int(s) for s in varying.index[varying]]
        duplicate_steps = [int(s) for s in varying.index[~varying]]
        df = df.drop_duplicates("step", keep="last")
    df = df.sort_values("step", kind="stable").reset_index(drop=True)
    if restart_steps:
        notes.append(f"step(s) {step_ranges(restart_steps)} were logged more than once with different values "
                     "(re-run after a restart); the last occurrence of each is used")
    if duplicate_steps:
        notes.append(f"step(s) {step_ranges(duplicate_steps)} were logged more than once with identical values "
                     "(several ranks in one file, or a restart that reproduced them)")
    df.attrs.update({
        "path": str(path), "format": fmt, "logged": logged, "notes": notes,
        "invalid": attrs.pop("invalid", []), "corrections": attrs.pop("corrections", []),
        "duplicate_steps": duplicate_steps, "restart_steps": restart_steps, "extra_losses": list(extras),
        "unreadable": attrs.pop("unreadable", []), **attrs,
    })
    return df
