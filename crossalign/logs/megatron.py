"""Parse a Megatron-LM training log (``training_log`` lines, SPEC section 7) into a DataFrame.

Everything that is not an iteration line (argument dumps, warnings, tracebacks, validation
blocks, other ranks' output) is skipped by the regex itself. Three Megatron habits matter:

- the printed ``learning rate`` is the lr of the *next* iteration (``lr_step_offset`` 1);
- from core 0.16 the second line after every process start holds the mean of that interval and
  the first iteration (the accumulators are not reset after the first line): the true value is
  recovered as ``((b-a+1)*printed(b) - printed(a)) / (b-a)`` for first line a and second line b,
  i.e. ``2*printed(2) - printed(1)`` with log interval 1;
- a loss whose average is NaN (or not positive in 0.16) is not printed at all: read as NaN.

A failed checkpoint load (``load_return: _IncompatibleKeys`` with real weights, "could not load
the checkpoint", a start from random weights) makes the run invalid: ``attrs["invalid"]``.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd

from crossalign.logs.common import (
    NAN, LogFormatError, finish_frame, floats, mtp_column, read_log_text, step_ranges,
)
from crossalign.logs.formats import megatron_averages_first_two

ITERATION_RE = re.compile(r"\] iteration\s+\d+/\s*\d+ \|")
_VALUE = r"([^\s|]+)"
_ANY = r"[^|\n]*"
# Printed once per process before its first iteration (rank 0 only).
_PROCESS_START_MARKERS = ("[before the start of training step]",
                          "------------------------ arguments ------------------------")
_INCOMPATIBLE_RE = re.compile(r"load_return: _IncompatibleKeys\(missing_keys=\[([^\]]*)\], "
                              r"unexpected_keys=\[([^\]]*)\]\)")
_NOT_LOADED_MESSAGES = ("could not load the checkpoint", "will not load any checkpoints and will start from random")
_GENERIC_RE = re.compile(r"\] iteration\s+(\d+)/\s*\d+ \|([^\n]*)")
_FIELD_NAMES = {"lm loss": "lm_loss", "load_balancing_loss": "aux_loss", "learning rate": "lr",
                "grad norm": "grad_norm", "elapsed time per iteration (ms)": "step_time_ms"}


def _field(name: str, value: str = _ANY) -> str:
    return rf"(?: {name}: {value} \|)?"


def _line_regex(mtp_count: int) -> re.Pattern:
    """The iteration line with every field Megatron may print, in print order, each optional."""
    pattern = (
        r"\] iteration\s+(\d+)/\s*\d+ \|"
        + _field("consumed samples") + _field("skipped samples")
        + _field(r"elapsed time per iteration \(ms\)", _VALUE)
        + _field(r"throughput per GPU \(TFLOP/s/GPU\)") + _field(r"energy per GPU \(J/iter/GPU\)")
        + _field(r"power per GPU \(W/GPU\)")
        + _field("learning rate", _VALUE) + _field("global batch size")
        + _field("lm loss", _VALUE) + _field("z_loss") + _field("load_balancing_loss", _VALUE)
        + _field("seq_load_balancing_loss") + _field("global_load_balancing_loss")
        + "".join(_field(f"mtp_{k} loss", _VALUE) for k in range(1, mtp_count + 1))
        + _field("loss scale") + _field("grad norm", _VALUE)
        + r"([^\n]*)"
    )
    return re.compile(pattern)


def _find_all(text: str, needles: tuple[str, ...]) -> list[int]:
    """Offsets of every occurrence of the literal needles (str.find is much faster than a regex here)."""
    found = []
    for needle in needles:
        at = text.find(needle)
        while at >= 0:
            found.append(at)
            at = text.find(needle, at + 1)
    return found


def _mtp_count(text: str) -> int:
    k = 0
    while f" mtp_{k + 1} loss: " in text:
        k += 1
    return k


def _first_line_regex(segment: str, mtp_count: int) -> tuple[re.Pattern, list[str]] | None:
    """A strict regex for lines laid out exactly like the segment's first iteration line (the common
    case, about twice as fast as the general one), and the columns its groups capture."""
    first = _GENERIC_RE.search(segment)
    if first is None:
        return None
    wanted = dict(_FIELD_NAMES, **{f"mtp_{k} loss": mtp_column(k) for k in range(1, mtp_count + 1)})
    pattern, names = r"\] iteration\s+(\d+)/\s*\d+ \|", []
    for part in first[2].split(" |")[:-1]:
        label = part.strip().split(": ", 1)[0]
        if label in wanted:
            pattern += rf" {re.escape(label)}: ([^\s|]+) \|"
            names.append(wanted[label])
        else:
            pattern += r"[^|\n]*\|"
    return re.compile(pattern), names


def _extract_fast(segment: str, mtp_count: int) -> tuple[np.ndarray, dict[str, np.ndarray]] | None:
    """One regex over the whole segment; None when some line does not fit it."""
    strict = _first_line_regex(segment, mtp_count)
    if strict is None:
        return np.empty(0, dtype=np.int64), {}
    regex, names = strict
    rows = regex.findall(segment)
    if len(rows) != segment.count("] iteration "):
        rows = _line_regex(mtp_count).findall(segment)
        names = ["step_time_ms", "lr", "lm_loss", "aux_loss",
                 *(mtp_column(k) for k in range(1, mtp_count + 1)), "grad_norm", "rest"]
        if any("loss: " in rest or "grad norm: " in rest for rest in (row[-1] for row in rows)):
            return None
    if not rows:
        return np.empty(0, dtype=np.int64), {}
    cols = list(zip(*rows))
    steps = np.fromiter(map(int, cols[0]), dtype=np.int64, count=len(rows))
    return steps, {name: floats(col) for name, col in zip(names, cols[1:]) if name != "rest"}


def _extract_generic(segment: str, mtp_count: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Field by field, for lines whose fields come in an unexpected order (slow, rarely needed)."""
    names = dict(_FIELD_NAMES, **{f"mtp_{k} loss": mtp_column(k) for k in range(1, mtp_count + 1)})
    steps, values = [], {name: [] for name in names.values()}
    for step, body in _GENERIC_RE.findall(segment):
        fields = dict(part.strip().split(": ", 1) for part in body.split(" |") if ": " in part)
        steps.append(int(step))
        for label, name in names.items():
            values[name].append(fields.get(label, "").strip())
    return np.array(steps, dtype=np.int64), {name: floats(v) for name, v in values.items()}


def _correct_first_two(steps: np.ndarray, cols: dict[str, np.ndarray], corrections: list[dict]) -> None:
    """Undo the core >= 0.16 mean over the first two logged lines of every process, in place."""
    starts = [0, *(int(i) for i in np.flatnonzero(np.diff(steps) <= 0) + 1)]
    averaged = [name for name in cols if name.endswith("_loss") or name == "step_time_ms"]
    for i in starts:
        j = i + 1
        if j >= len(steps) or j in starts:
            continue
        a, b = int(steps[i]), int(steps[j])
        raw, fixed = {}, {}
        for name in averaged:
            first, second = cols[name][i], cols[name][j]
            if np.isfinite(first) and np.isfinite(second):
                raw[name] = float(second)
                cols[name][j] = ((b - a + 1) * second - first) / (b - a)
                fixed[name] = float(cols[name][j])
        if raw:
            corrections.append({"step": b, "first_step": a, "raw": raw, "corrected": fixed})


def _load_problems(path: Path, text: str) -> tuple[list[str], list[str]]:
    """(reasons the run is invalid, notes) from the checkpoint-load messages in the log."""
    invalid, notes = [], []
    for match in _INCOMPATIBLE_RE.finditer(text):
        missing = re.findall(r"'([^']*)'", match[1])
        unexpected = re.findall(r"'([^']*)'", match[2])
        real_missing = [k for k in missing if not k.endswith("_extra_state")]
        real_unexpected = [k for k in unexpected if not k.endswith("_extra_state")]
        if real_missing or real_unexpected:
            invalid.append(
                f"{path.name}: Megatron fell back to a non-strict checkpoint load (load_return: _IncompatibleKeys): "
                f"{len(real_missing)} missing key(s){' e.g. ' + ', '.join(real_missing[:3]) if real_missing else ''}, "
                f"{len(real_unexpected)} unexpected key(s){' e.g. ' + ', '.join(real_unexpected[:3]) if real_unexpected else ''}"
                "; the missing weights kept their random init")
        else:
            notes.append("the Megatron load fell back to strict=False but listed only TransformerEngine "
                         "_extra_state keys: every weight was loaded")
    for message in _NOT_LOADED_MESSAGES:
        at = text.find(message)
        if at >= 0:
            end = text.find("\n", at)
            line = text[at: end if end >= 0 else len(text)].strip()
            invalid.append(f"{path.name}: Megatron did not load the checkpoint: {line}")
    return invalid, notes


def parse_megatron_text(path: Path, text: str, core_version: str = "0.16.1", truncated: bool = False) -> pd.DataFrame:
    """Parse the text of a Megatron log (``path`` only names it in messages and attrs)."""
    path = Path(path)
    mtp_count = _mtp_count(text)
    boundaries = sorted(_find_all(text, _PROCESS_START_MARKERS))
    segments = [text[lo:hi] for lo, hi in zip([0, *boundaries], [*boundaries, len(text)])]
    steps_parts, col_parts, corrections = [], [], []
    starts = 0
    averages = megatron_averages_first_two(core_version)
    for segment in segments:
        extracted = _extract_fast(segment, mtp_count) or _extract_generic(segment, mtp_count)
        steps, cols = extracted
        if len(steps) == 0:
            continue
        starts += 1 + int(np.count_nonzero(np.diff(steps) <= 0))
        if averages:
            _correct_first_two(steps, cols, corrections)
        steps_parts.append(steps)
        col_parts.append(cols)
    if not steps_parts:
        raise LogFormatError(f"{path}: no Megatron iteration line found")
    steps = np.concatenate(steps_parts)
    names = dict.fromkeys(name for cols in col_parts for name in cols)
    columns = {name: np.concatenate([c.get(name, np.full(len(s), NAN)) for c, s in zip(col_parts, steps_parts)])
               for name in names}
    logged = [name for name, col in columns.items() if name != "step_time_ms" and not np.isnan(col).all()]
    invalid, notes = _load_problems(path, text)
    if starts > 1:
        notes.append(f"the Megatron log holds {starts} process starts (restarts)")
    if corrections:
        notes.append(
            f"Megatron core {core_version} prints, on the second line after each process start, the mean over that "
            f"interval and the first iteration; recovered the true values at step(s) "
            f"{step_ranges(c['step'] for c in corrections)} (true = 2*printed(2) - printed(1) with log interval 1)")
    if truncated:
        notes.append(f"{path.name}: the last line was cut off and is ignored")
    df = finish_frame(path, "megatron", steps, columns, mtp_count, logged,
                      {"notes": notes, "invalid": invalid, "corrections": corrections,
                       "lr_step_offset": 1, "core_version": core_version})
    for name in logged:
        if name.endswith("_loss"):
            missing = df["step"][df[name].isna()]
            if len(missing):
                df.attrs["notes"].append(
                    f"Megatron printed no {name.replace('_', ' ')} at step(s) {step_ranges(missing)}: it omits a loss "
                    "whose average is NaN (or not positive before core 0.17), read as NaN")
    return df


def parse_megatron_log(path: Path, core_version: str = "0.16.1") -> pd.DataFrame:
    """Parse a Megatron log file (see module docstring for the columns and attrs)."""
    text, truncated = read_log_text(Path(path))
    if "] iteration " not in text or not ITERATION_RE.search(text):
        raise LogFormatError(f"{path}: no Megatron iteration line found")
    return parse_megatron_text(Path(path), text, core_version, truncated)
