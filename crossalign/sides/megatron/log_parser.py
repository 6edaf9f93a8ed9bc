"""Parse a Megatron-LM training log (``training_log`` lines, SPEC section 7) into a DataFrame.

A record is a line holding ``iteration N/ M |`` followed by ``|``-separated fields. Everything around
it is read as published logs show it: no timestamp, `` [date]``, ``[date]``, launcher rank tags
(``[default3]: ``, ``[host:rank]: ``), MindSpeed's ``INFO [date] >>  ``; elapsed time in ms or s; the
2019 form without colons (``lm loss 1.0E+01``); extra fields whose values hold colons or spaces; a
record wrapped over two lines, at a space or inside a word (``load_bal`` / ``ancing_loss: ...``: the two
pieces are joined as the field name they spell, see ``_rejoin``); another process's print glued on after
a record's closing field (the record is read up to that field). Every record is read on its own, so a
field missing from one record (no ``lm loss`` when every iteration of the interval was skipped, no
``grad norm``) is NaN there and nowhere else. Validation lines, DeepSpeed's ``steps: N loss: X``, memory
and timer lines are not records.

Losses are kept by name: ``lm loss``, ``mtp_K loss``, the MoE aux loss (``load_balancing_loss``, else
``seq_load_balancing_loss``, else ``global_load_balancing_loss``: the first of these the log prints)
and every other loss (``z_loss``, ``nsp loss``, the aux variants not chosen) as an extra column.

Three Megatron habits matter:

- the printed ``learning rate`` is the lr of the *next* iteration (``lr_step_offset`` 1);
- cores 0.16-0.19 keep the first printed iteration of a process in the loss sums; when it is on a
  log-interval boundary (always with ``--log-interval 1``) the next line holds the mean over both
  lines' iterations (``formats.megatron_keeps_first_line``). For a known version the true value is
  recovered as ``((b-a+1)*printed(b) - printed(a)) / (b-a)`` for first line a and second line b;
  for an unknown version both readings are kept (``attrs["iteration2"]``) for the comparison to test;
- a loss whose average is NaN (or not positive before core 0.17) is not printed at all: read as NaN.

A failed checkpoint load (``load_return: _IncompatibleKeys`` with real weights, "could not load
the checkpoint", a start from random weights) makes the run invalid: ``attrs["invalid"]``. A non-strict load (``load_return: None``, which names no key)
is ``attrs["non_strict_load"]``: invalid for the comparison unless the loaded tensors were verified.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd

from crossalign.sides.log_common import (
    NAN, RANK_TAG_RE, LogFormatError, finish_frame, floats, line_of, loss_column, mtp_column, pick_rank,
    read_log_text, step_ranges, unreadable_notes,
)
from crossalign.sides.megatron.log_lines import megatron_keeps_first_line

# no \b before "iteration": it would cost the regex engine its literal scan (10x slower on big logs)
ITERATION_RE = re.compile(r"iteration\s+\d+\s*/\s*\d+\s*\|")
_MARK_RE = re.compile(r"iteration\s+\d+\s*/")  # what makes a line look like a record
_RECORD_RE = re.compile(r"^([^\n]*?)iteration\s+(\d+)\s*/\s*\d+\s*\|([^\n]*)$", re.M)
# Printed once per process before its first iteration (rank 0 only).
_PROCESS_START_MARKERS = ("[before the start of training step]",
                          "------------------------ arguments ------------------------")
_INCOMPATIBLE_RE = re.compile(r"load_return: _IncompatibleKeys\(missing_keys=\[([^\]]*)\], "
                              r"unexpected_keys=\[([^\]]*)\]\)")
_NON_STRICT_RE = re.compile(r"^load_return: None$", re.M)
_NOT_LOADED_MESSAGES = ("could not load the checkpoint", "will not load any checkpoints and will start from random")
AUX_LOSS_NAMES = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss")
_MTP_LABEL_RE = re.compile(r"mtp_(\d+) loss$")
_FIXED = {"lm loss": "lm_loss", "learning rate": "lr", "grad norm": "grad_norm",
          "elapsed time per iteration (ms)": "step_time_ms", "elapsed time per iteration (s)": "step_time_s"}
_LINE_START_RE = re.compile(r"\s*(?:\[|INFO\b|WARNING\b|ERROR\b|\d{4}-\d\d-\d\d)")
# The labels upstream ``training_log`` prints besides the losses (megatron/training/training.py, core_v0.16.1
# L2033-2088; NVIDIA/Megatron-LM main L3567-3641) and those of the forks in tests/fixtures/logformats. A
# label cut by a line wrap is rejoined as the one of these, or of the log's other records, it spells.
KNOWN_LABELS = frozenset({
    *_FIXED, *AUX_LOSS_NAMES, "consumed samples", "skipped samples", "throughput per GPU (TFLOP/s/GPU)",
    "energy per GPU (J/iter/GPU)", "power per GPU (W/GPU)", "global batch size", "loss scale", "num zeros",
    "params norm", "number of skipped iterations", "number of nan iterations", "z_loss", "nsp loss", "sop loss",
    "consumed tokens", "actual seqlen", "samples per second", "TFLOPs",
})
# The field upstream prints last in every record: a record that holds it is complete.
CLOSING_LABEL = "number of nan iterations"


def split_fields(body: str) -> list[tuple[str, str]]:
    """``" consumed samples: 8 | lm loss 1.0E+01 | ..."`` -> ``[("consumed samples", "8"), ("lm loss", ...)]``.

    A field is ``label: value`` (the value may hold colons and spaces: ``elapsed time: 10m 7s``) or,
    in the 2019 form, ``label value`` with the value the last word. A trailing part cut off without
    its ``|`` is not a field.
    """
    fields = []
    for part in body.split("|")[:-1]:
        part = part.strip()
        if not part:
            continue
        if ":" in part:
            label, value = part.split(":", 1)
        else:
            label, _, value = part.rpartition(" ")
        fields.append((" ".join(label.split()), value.strip()))
    return fields


class _Columns:
    """Which column each printed label feeds, decided by name from the labels of a part of the log."""

    def __init__(self, labels: set[str]):
        self.aux = next((name for name in AUX_LOSS_NAMES if name in labels), None)
        self.mtp_count = max((int(m[1]) for m in map(_MTP_LABEL_RE.match, labels) if m), default=0)
        self.extras: list[str] = []
        self.names: dict[str, str] = {}
        for label in sorted(labels):
            name = self._name(label)
            if name is not None:
                self.names[label] = name

    def _name(self, label: str) -> str | None:
        if label in _FIXED:
            return _FIXED[label]
        if label == self.aux:
            return "aux_loss"
        mtp = _MTP_LABEL_RE.match(label)
        if mtp:
            return mtp_column(int(mtp[1]))
        if label.endswith("loss"):
            name = loss_column(label)
            if name not in self.extras:
                self.extras.append(name)
            return name
        return None


def _fast(segment: str, count: int) -> tuple[np.ndarray, dict[str, np.ndarray], _Columns] | None:
    """One regex over the whole segment, laid out like its first record and anchored at the line end,
    so a record laid out otherwise does not match at all; None unless every record matched it."""
    first = _RECORD_RE.search(segment)
    if first is None or not first[3].rstrip().endswith("|"):
        return None
    tag = RANK_TAG_RE.match(first[1])
    tagged = r"^\s*\[" + (re.escape(tag[1]) if tag else r"[^\]\s]+") + r"\]:[^\n]*?iteration\s+\d+\s*/"
    if tag and len(re.findall(tagged, segment, re.M)) != count or (
            not tag and "]:" in segment and re.search(tagged, segment, re.M)):
        return None  # several ranks: the record-by-record path picks one
    fields = split_fields(first[3])
    columns = _Columns({label for label, _ in fields})
    pattern, names = r"iteration\s+(\d+)\s*/\s*\d+\s*\|", []
    for part in first[3].split("|")[:-1]:
        field = split_fields(part + "|")
        name = columns.names.get(field[0][0]) if field else None
        if name is None:
            pattern += r"[^|\n]*\|"
            continue
        label = part[: part.rindex(field[0][1])].rstrip()  # as printed, spaces included: a literal is fastest
        pattern += rf"{re.escape(label)}\s*([^\s|]+)\s*\|"
        names.append(name)
    rows = re.findall(pattern + r"[ \t]*$", segment, re.M)
    if len(rows) != count:
        return None
    cols = list(zip(*rows))
    try:
        values = {name: floats(col) for name, col in zip(names, cols[1:])}
    except ValueError:
        return None
    return np.fromiter(map(int, cols[0]), dtype=np.int64, count=len(rows)), values, columns


def _slow(segment: str, offset: int, text: str, notes: list[str],
          unreadable: list[dict]) -> tuple[np.ndarray, dict[str, np.ndarray], _Columns]:
    """Record by record: rank tags, wrapped records, glued prints, any field order; names what cannot be read."""
    found = [(m, split_fields(m[3]) if m[3].rstrip().endswith("|") else None) for m in _RECORD_RE.finditer(segment)]
    whole = [fields for _, fields in found if fields is not None]
    known = KNOWN_LABELS | {label for fields in whole for label, _ in fields}
    closing = _closing_label(whole)
    records = []
    for match, fields in found:
        if fields is None:
            body = match[3]
            fields = split_fields(body)
            labels = [label for label, _ in fields]
            if closing in labels:  # complete: what follows its last '|' is another process's print
                fields = fields[: len(labels) - labels[::-1].index(closing)]
            else:
                continued = _continuation(segment, match.end())
                if continued is None:
                    _unreadable(unreadable, text, offset + match.start(), "the record stops without its closing '|'")
                    continue
                fields = split_fields(_rejoin(body, continued, known))
        tag = RANK_TAG_RE.match(match[1])
        records.append((offset + match.start(), int(match[2]), tag[1] if tag else "", fields))
    columns = _Columns({label for *_, fields in records for label, _ in fields})
    steps, tags, rows = [], [], []
    for at, step, tag, fields in records:
        row, why = {}, None
        for label, value in fields:
            name = columns.names.get(label)
            if name is None:
                continue
            try:
                row[name] = float(value)
            except ValueError:
                why = f"{label} {value!r} is not a number"
                break
        if why is None and not row:
            why = "no field could be read"
        if why is not None:
            _unreadable(unreadable, text, at, why)
            continue
        steps.append(step)
        tags.append(tag)
        rows.append(row)
    keep = pick_rank(tags, np.ones(len(tags), dtype=bool), notes)
    rows = [row for row, k in zip(rows, keep) if k]
    names = dict.fromkeys(name for row in rows for name in row)
    values = {name: np.array([row.get(name, NAN) for row in rows], dtype=np.float64) for name in names}
    return np.array(steps, dtype=np.int64)[keep], values, columns


def _closing_label(whole: list[list[tuple[str, str]]]) -> str:
    """The label the log's complete records end with (a fork may print fields after upstream's last)."""
    last = Counter(fields[-1][0] for fields in whole if fields).most_common(1)
    return last[0][0] if last else CLOSING_LABEL


def _continuation(segment: str, end: int) -> str | None:
    """The line after a record cut without its closing '|', when it reads as the rest of that record:
    it holds a '|', no record of its own, and does not start like a new log line."""
    stop = segment.find("\n", end + 1)
    following = RANK_TAG_RE.sub("", segment[end + 1: stop if stop >= 0 else len(segment)], count=1)
    if "|" in following and not ITERATION_RE.search(following) and not _LINE_START_RE.match(following):
        return following
    return None


def _rejoin(body: str, continued: str, known: frozenset[str] | set[str]) -> str:
    """A record wrapped over two lines, joined where the wrap cut it.

    A wrap at a space keeps the space. A wrap inside a word (a terminal or pager cutting at its width) or
    one that ate the space cannot be told apart by the characters: ``load_bal`` / ``ancing_loss`` wants no
    space, ``number of nan`` / ``iterations`` one. The field cut by the wrap decides: the joining whose label
    Megatron prints (``KNOWN_LABELS``, an MTP loss, a label of the log's other records), then whose value is a
    number, then whose label is a loss name (an unknown extra loss); a space when nothing tells them apart.
    """
    head, tail = body.rstrip("\r"), continued.rstrip()
    if head != head.rstrip() or tail != tail.lstrip():
        return head.rstrip() + " " + tail.strip()
    before, after = head.rsplit("|", 1)[-1], tail.split("|", 1)[0]

    def score(sep: str) -> tuple[bool, bool, bool]:
        field = split_fields(before + sep + after + "|")
        if not field:
            return False, False, False
        label, value = field[0]
        return (label in known or _MTP_LABEL_RE.match(label) is not None, _is_number(value), label.endswith("loss"))

    sep = max((" ", ""), key=score)  # max keeps the first of equals: the space
    return head + sep + tail


def _is_number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def _unreadable(unreadable: list[dict], text: str, at: int, why: str) -> None:
    line, content = line_of(text, at)
    unreadable.append({"line": line, "why": why, "text": content})


def infer_log_interval(processes: list[np.ndarray]) -> int:
    """The log interval: the most common step difference from each process's second line on (the
    first line of a process may be off the interval), else the first difference, else 1."""
    later = np.concatenate([np.diff(steps[1:]) for steps in processes] or [np.empty(0, dtype=np.int64)])
    later = later[later > 0]
    if len(later):
        values, counts = np.unique(later, return_counts=True)
        return int(values[np.argmax(counts)])
    first = [int(steps[1] - steps[0]) for steps in processes if len(steps) > 1 and steps[1] > steps[0]]
    return min(first) if first else 1


def _processes(steps: np.ndarray) -> list[slice]:
    """Each run of increasing steps: a step that does not increase starts a new process (a restart)."""
    starts = [0, *(int(i) for i in np.flatnonzero(np.diff(steps) <= 0) + 1), len(steps)]
    return [slice(a, b) for a, b in zip(starts, starts[1:])]


def _second_lines(steps: np.ndarray, cols: dict[str, np.ndarray], log_interval: int,
                  processes: list[slice]) -> list[dict]:
    """For each process whose first line is on a boundary and whose second line is the next one:
    both readings of the second line (as printed, and with the first line's iterations taken out)."""
    averaged = [name for name in cols if name.endswith("_loss") or name == "step_time_ms"]
    found = []
    for part in processes:
        i = part.start
        j = i + 1
        if j >= part.stop:
            continue
        a, b = int(steps[i]), int(steps[j])
        if a % log_interval or b - a != log_interval:
            continue
        printed, undone = {}, {}
        for name in averaged:
            first, second = cols[name][i], cols[name][j]
            if np.isfinite(first) and np.isfinite(second):
                printed[name] = float(second)
                undone[name] = ((b - a + 1) * second - first) / (b - a)
        if printed:
            found.append({"step": b, "first_step": a, "index": j, "as_printed": printed, "mean_undone": undone})
    return found


def _load_problems(path: Path, text: str) -> tuple[list[str], list[str], list[str]]:
    """(reasons the run is invalid, notes, non-strict loads) from the checkpoint-load messages in the log.

    A non-strict load (``load_return: None``) names no key, so only a check of what was loaded can clear it:
    the comparison counts it as invalid unless told the run's loaded tensors were verified."""
    invalid, notes, non_strict = [], [], []
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
    # what core 0.16-0.19 really print (backends/megatron.py); a literal scan first: the '^' regex cannot skip
    # ahead and costs about 0.3 s of CPU on a 100,000-step log
    for match in _NON_STRICT_RE.finditer(text) if "load_return: None" in text else ():
        non_strict.append(f"{path.name}:{line_of(text, match.start())[0]}: Megatron fell back to a non-strict checkpoint "
                       "load (load_return: None names no key): which weights kept their random init only the "
                       "step's load digest can tell")
    for message in _NOT_LOADED_MESSAGES:
        at = text.find(message)
        if at >= 0:
            end = text.find("\n", at)
            line = text[at: end if end >= 0 else len(text)].strip()
            invalid.append(f"{path.name}: Megatron did not load the checkpoint: {line}")
    return invalid, notes, non_strict


def _segments(text: str) -> list[tuple[int, str]]:
    """The text cut at every process-start marker, with each piece's offset."""
    bounds = []
    for marker in _PROCESS_START_MARKERS:
        at = text.find(marker)
        while at >= 0:
            bounds.append(at)
            at = text.find(marker, at + 1)
    bounds = sorted(bounds)
    return [(lo, text[lo:hi]) for lo, hi in zip([0, *bounds], [*bounds, len(text)])]


def parse_megatron_text(path: Path, text: str, core_version: str | None = "0.16.1", truncated: bool = False,
                        log_interval: int | None = None) -> pd.DataFrame:
    """Parse the text of a Megatron log (``path`` only names it in messages and attrs).

    ``core_version`` None: unknown, the second line after a process start is read as printed and both
    readings are left in ``attrs["iteration2"]``. ``log_interval`` None: inferred from the steps.
    """
    path = Path(path)
    notes: list[str] = []
    unreadable: list[dict] = []
    steps_parts, col_parts, mtp_count, extras = [], [], 0, {}
    for offset, segment in _segments(text):
        marks = len(_MARK_RE.findall(segment))
        if not marks:
            continue
        found = _fast(segment, marks)  # every line that looks like a record is one, laid out alike
        if found is None:
            for mark in _MARK_RE.finditer(segment):
                if not ITERATION_RE.match(segment, mark.start()):
                    _unreadable(unreadable, text, offset + mark.start(), "no 'M |' after 'iteration N/'")
            found = _slow(segment, offset, text, notes, unreadable)
        steps, cols, columns = found
        mtp_count = max(mtp_count, columns.mtp_count)
        extras.update(dict.fromkeys(columns.extras))
        if len(steps):
            steps_parts.append(steps)
            col_parts.append(cols)
    notes += unreadable_notes(path, "Megatron", unreadable)
    if not steps_parts:
        raise LogFormatError(f"{path}: no Megatron iteration line could be read")
    steps = np.concatenate(steps_parts)
    names = dict.fromkeys(name for cols in col_parts for name in cols)
    cols = {name: np.concatenate([c.get(name, np.full(len(s), NAN)) for c, s in zip(col_parts, steps_parts)])
            for name in names}
    if "step_time_s" in cols:
        seconds = cols.pop("step_time_s") * 1000.0
        cols["step_time_ms"] = np.where(np.isnan(seconds), cols.get("step_time_ms", seconds), seconds)
    processes = _processes_of(steps_parts)
    interval = log_interval or infer_log_interval([steps[p] for p in processes])
    keeps = megatron_keeps_first_line(core_version)
    second = _second_lines(steps, cols, interval, processes) if keeps is not False else []
    corrections, readings = [], []
    for found in second:
        j = found.pop("index")
        if keeps:
            for name, value in found["mean_undone"].items():
                cols[name][j] = value
            corrections.append({"step": found["step"], "first_step": found["first_step"],
                                "raw": found["as_printed"], "corrected": found["mean_undone"]})
        else:
            readings.append(found)
    logged = [name for name, col in cols.items() if name != "step_time_ms" and not np.isnan(col).all()]
    invalid, load_notes, non_strict = _load_problems(path, text)
    notes += load_notes
    if len(processes) > 1:
        notes.append(f"the Megatron log holds {len(processes)} process starts (restarts)")
    if corrections:
        notes.append(
            f"Megatron core {core_version} keeps the first printed iteration of a process in its loss sums "
            f"(cores 0.16-0.19, fixed upstream in 0.20 by PR #7092): recovered the true values at step(s) "
            f"{step_ranges(c['step'] for c in corrections)} (true = 2*printed(2) - printed(1) with log interval 1)")
    if readings:
        notes.append(
            f"Megatron core version not given: step(s) {step_ranges(r['step'] for r in readings)} are read as printed; "
            "cores 0.16-0.19 print there the mean with the line before, which the comparison tests against the other log")
    if truncated:
        notes.append(f"{path.name}: the last line was cut off and is ignored")
    df = finish_frame(path, "megatron", steps, cols, mtp_count, logged,
                      {"notes": notes, "invalid": invalid, "corrections": corrections, "unreadable": unreadable,
                       "lr_step_offset": 1, "core_version": core_version, "log_interval": interval,
                       "iteration2": readings, "non_strict_load": non_strict}, extras=list(extras))
    for name in logged:
        if name.endswith("_loss"):
            missing = df["step"][df[name].isna()]
            if len(missing):
                df.attrs["notes"].append(
                    f"Megatron printed no {name.replace('_', ' ')} at step(s) {step_ranges(missing)}: it omits a loss "
                    "whose average is NaN (or not positive before core 0.17), or every iteration of the interval "
                    "was skipped; read as NaN")
    return df


def _processes_of(steps_parts: list[np.ndarray]) -> list[slice]:
    """Process runs over the concatenated steps: each segment, cut again where the steps go back."""
    out, base = [], 0
    for steps in steps_parts:
        out += [slice(p.start + base, p.stop + base) for p in _processes(steps)]
        base += len(steps)
    return out


def parse_megatron_log(path: Path, core_version: str | None = "0.16.1", log_interval: int | None = None) -> pd.DataFrame:
    """Parse a Megatron log file (see module docstring for the columns and attrs)."""
    text, truncated = read_log_text(Path(path))
    if "iteration" not in text or not ITERATION_RE.search(text):
        raise LogFormatError(f"{path}: no Megatron iteration line found")
    return parse_megatron_text(Path(path), text, core_version, truncated, log_interval)
