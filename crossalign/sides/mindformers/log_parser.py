"""Parse a MindFormers training log, pynative (``LossCallback``) or graph mode (``MFLossMonitor``).

A record is the part of a line from ``step:[ N/ M]`` (graph mode: from ``Epoch:[ E/ T], step:[ N/ M]``)
to the line end, fields separated by ``, ``. The logger prefix does not matter (stdout ``<time> -
mindformers<dir>[<file:line>] - INFO - ``, the file handler's ``[INFO] <time> [<file:line>] <func>: ``,
the older ``<time> - mindformers - INFO - `` or none). What each format means (SPEC section 7,
reference/mindformers.md 1b-1c):

- pynative: ``loss`` is the lm loss, ``load_balancing_loss`` the mean unscaled aux loss per MoE
  layer, ``lr`` the lr of the *next* step (``lr_step_offset`` 1); a non-last pipeline stage prints
  ``loss: N/A (...)`` and is skipped. ``mtp_k_loss`` is unscaled from 2.1.0 but multiplied by
  mtp_loss_scaling_factor / mtp_num_layers in r2.0.0 (``formats.mindformers_scales_mtp_loss``):
  given the release, the frame holds it unscaled. 2.1.0 and master print ``consumed_samples`` and
  ``global_batch_size`` after the step; r2.0.0 does not (``pynative/callback/loss_callback.py::_print_log``).
  With ``training.use_skip_step_on_nan`` (2.1.0) a step whose gradient norm is NaN/Inf is not applied
  and the trainer warns ``[SkipStepOnNaN] Global gradient norm is nan at step N, skipping the
  optimizer update ...`` (``pynative/trainer/trainer.py:1966``); the optimizer's step count, hence
  its lr, then stays behind the printed one by the steps skipped so far, and the frame's lr is
  corrected for it (a printed value NaN is kept: ``attrs["printed_nan"]`` tells it from a value not printed);
- graph: ``loss`` is the TOTAL (lm + aux + scaled mtp); ``lm_loss`` is printed only for MoE or
  MTP models (otherwise the total is all there is, and for such a dense model it equals the lm
  loss); ``mtp_loss`` is already multiplied by mtp_loss_scaling_factor / mtp_num_layers; ``lr``
  is the applied one (``lr_step_offset`` 0); global step = (epoch-1)*steps_per_epoch + step. Older
  releases print ``loss:[2.244/2.244], time:507844.205 ms, lr:[0.]`` without braces; with sink mode the
  steps advance by the sink size. ``global_norm`` is printed as numpy prints it, sometimes malformed
  (``[1 31049]``, or without its colon): then the grad norm of that step is unknown, and a note says so.

Other losses (``indexer_loss``) are kept as extra columns. Lines that are not records (the progress
bar ending in ``}``, ``epoch_end ... avg loss``, ``Per sink_size step time``) are not read.

Several ranks in one file: with rank tags the highest rank that printed a loss is used (the last
pipeline stage; data-parallel ranks print the same all-reduced value).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd

from crossalign.sides.log_common import (
    NAN, RANK_TAG_RE, LogFormatError, finish_frame, floats, line_of, loss_column, mtp_column, pick_rank,
    read_log_text, step_ranges, unreadable_notes,
)
from crossalign.sides.mindformers.log_lines import mindformers_scales_mtp_loss

STEP_MARK = "step:["
PYNATIVE_RE = re.compile(r"(?<!\], )step:\[\s*\d+\s*/\s*\d+\s*\], (?:consumed_samples|loss)\b")
GRAPH_RE = re.compile(r"Epoch:\[\s*\d+\s*/\s*\d+\s*\], step:\[\s*\d+\s*/\s*\d+\s*\], loss")
_RECORD_RE = re.compile(r"^([^\n]*?)(?:Epoch:\[\s*(\d+)\s*/\s*(\d+)\s*\],\s*)?step:\[\s*(\d+)\s*/\s*(\d+)\s*\]([^\n]*)$",
                        re.M)
_FIELD_RE = re.compile(r"\s*([A-Za-z_][\w ]*?)\s*(?::\s*|\s+(?=\[))(.*)$", re.S)
_NUMBER_RE = re.compile(r"\[?\s*([^\s/\]\[]+?)\s*(?:/[^\]]*)?\]?\s*(?:ms|T)?$")
_NA = "N/A"
SKIP_RE = re.compile(r"\[SkipStepOnNaN\] Global gradient norm is (\S+) at step (\d+), skipping the optimizer update")


def split_fields(body: str) -> list[tuple[str, str]]:
    """``", loss:[2.2/2.2], time:5.1 ms, lr:[0.]"`` -> ``[("loss", "[2.2/2.2]"), ("time", "5.1 ms"), ...]``:
    commas inside brackets or parentheses do not separate fields; a trailing ``}`` is not a value."""
    fields, depth, start = [], 0, 0
    body = body.rstrip().removesuffix("}")
    for i, char in enumerate(body):
        if char in "[(":
            depth += 1
        elif char in "])":
            depth = max(0, depth - 1)
        elif char == "," and depth == 0:
            fields.append(body[start:i])
            start = i + 1
    fields.append(body[start:])
    out = []
    for field in fields:
        match = _FIELD_RE.match(field)
        if match:
            out.append((" ".join(match[1].split()), match[2].strip()))
    return out


def number(value: str) -> float:
    """A printed value -> float: ``[2.244/2.244]`` -> 2.244, ``1500ms`` -> 1500, ``[0.]`` -> 0.0;
    ValueError when it is not one number (``[1 31049]``)."""
    match = _NUMBER_RE.match(value)
    if match is None:
        raise ValueError(value)
    return float(match[1])


def _names(labels: set[str], graph: bool) -> tuple[dict[str, str], int, list[str]]:
    """Column of each label (decided by name), the MTP count and the extra-loss columns."""
    names, extras = {}, []
    mtp = [int(m[1]) for m in map(re.compile(r"mtp_(\d+)_loss$").match, labels) if m]
    fixed = {"load_balancing_loss": "aux_loss", "lr": "lr", "per_step_time": "step_time_ms", "time": "step_time_ms",
             "grad_norm": "grad_norm", "global_norm": "grad_norm"}
    fixed.update({"loss": "total_loss", "lm_loss": "lm_loss", "mtp_loss": "mtp_scaled"} if graph else {"loss": "lm_loss"})
    for label in sorted(labels):
        if label in fixed:
            names[label] = fixed[label]
        elif re.fullmatch(r"mtp_\d+_loss", label):
            names[label] = label
        elif label.endswith("loss"):
            names[label] = loss_column(label)
            extras.append(names[label])
    return names, max(mtp, default=0), extras


def _fast(text: str, count: int) -> tuple[np.ndarray, dict[str, np.ndarray], list[str]] | None:
    """Pynative only: one regex laid out like the first record and anchored at the line end; None
    unless every record matched it (then the record-by-record path reads them)."""
    first = _RECORD_RE.search(text)
    if first is None or first[2] is not None or RANK_TAG_RE.match(first[1]):
        return None
    if "]:" in text and re.search(r"^\s*\[[^\]\s]+\]:[^\n]*?step:\[", text, re.M):
        return None
    fields = split_fields(first[6].removeprefix(","))
    names, _, _ = _names({label for label, _ in fields}, graph=False)
    if "lm_loss" not in {names.get(label) for label, _ in fields}:
        return None
    pattern, columns = r"step:\[\s*(\d+)\s*/\s*\d+\s*\]", []
    for label, value in fields:
        name = names.get(label)
        if name is None:
            pattern += r",[^,\n]*"
        elif name == "step_time_ms":
            pattern += rf", {re.escape(label)}:\s*(\d+)ms"
            columns.append(name)
        elif value.startswith(_NA):
            return None
        else:
            pattern += rf", {re.escape(label)}:\s*([^,\s]+)"
            columns.append(name)
    rows = re.findall(pattern + r"\s*\}?[ \t]*$", text, re.M)
    if len(rows) != count:
        return None
    cols = list(zip(*rows))
    try:
        values = {name: floats(col) for name, col in zip(columns, cols[1:])}
    except ValueError:
        return None
    return np.fromiter(map(int, cols[0]), dtype=np.int64, count=len(rows)), values, columns


def _records(text: str, unreadable: list[dict]) -> list[tuple[int, str, int | None, int, int, list]]:
    """(offset, rank tag, epoch, step, steps per epoch, fields) of every record line; a line that holds
    ``step:[`` without a readable step is named in ``unreadable``."""
    records, covered = [], set()
    for match in _RECORD_RE.finditer(text):
        tag = RANK_TAG_RE.match(match[1])
        epoch = int(match[2]) if match[2] is not None else None
        records.append((match.start(), tag[1] if tag else "", epoch, int(match[4]), int(match[5]),
                        split_fields(match[6].removeprefix(","))))
        covered.add(text.rfind("\n", 0, match.start()) + 1)
    if len(records) != text.count(STEP_MARK):
        at = text.find(STEP_MARK)
        while at >= 0:
            start = text.rfind("\n", 0, at) + 1
            if start not in covered:
                covered.add(start)
                line, content = line_of(text, at)
                unreadable.append({"line": line, "why": "its step:[N/M] cannot be read", "text": content})
            at = text.find(STEP_MARK, at + 1)
    return records


def _slow(path: Path, text: str, graph: bool, notes: list[str], attrs: dict,
          unreadable: list[dict]) -> tuple[np.ndarray, dict[str, np.ndarray], list[str]]:
    """Record by record: any prefix, field order, bracket and unit; rows of one rank."""
    records = [r for r in _records(text, unreadable) if (r[2] is not None) == graph]
    names, _, _ = _names({label for *_, fields in records for label, _ in fields}, graph)
    steps, tags, rows, usable, malformed = [], [], [], [], []
    for at, tag, epoch, step, per_epoch, fields in records:
        row, why, stage = {}, None, True
        for label, value in fields:
            name = names.get(label)
            if name is None:
                continue
            if label == "loss" and value.startswith(_NA):
                stage = False
                continue
            try:
                row[name] = number(value)
            except ValueError:
                if name in ("grad_norm", "lr", "step_time_ms"):
                    malformed.append(f"{label} {value!r} at step {step}")
                else:
                    why = f"{label} {value!r} is not a number"
        loss = "total_loss" if graph else "lm_loss"
        if why is None and stage and loss not in row:
            why = "it holds no loss"
        if why is not None:
            line, content = line_of(text, at)
            unreadable.append({"line": line, "why": why, "text": content})
            continue
        steps.append(step if epoch is None else (epoch - 1) * per_epoch + step)
        tags.append(tag)
        rows.append(row)
        usable.append(stage)
    if malformed:
        notes.append(f"values printed in a form that is not a number, read as unknown: {'; '.join(malformed[:5])}"
                     + (f" and {len(malformed) - 5} more" if len(malformed) > 5 else ""))
    usable = np.array(usable, dtype=bool)
    if len(usable) and not usable.any():
        raise LogFormatError(f"{path}: every step line says 'loss: N/A' (a non-last pipeline stage); "
                             "compare the log of the last stage")
    keep = pick_rank(tags, usable, notes)
    if not keep.all() and len(keep):
        notes.append("lines of non-last pipeline stages ('loss: N/A') or of other ranks are skipped")
    rows = [row for row, k in zip(rows, keep) if k]
    columns = list(dict.fromkeys(name for row in rows for name in row))
    values = {name: np.array([row.get(name, NAN) for row in rows], dtype=np.float64) for name in columns}
    kept = np.array(steps, dtype=np.int64)[keep]
    attrs["printed_nan"] = {name: [int(step) for step, row in zip(kept, rows) if name in row and np.isnan(row[name])]
                            for name in columns}
    return kept, values, columns


def _graph_columns(values: dict[str, np.ndarray], notes: list[str], attrs: dict,
                   mtp_loss_scaling_factor: float | None) -> int:
    """Turn graph mode's total and scaled MTP loss into comparable columns; returns the MTP count."""
    total = values.pop("total_loss")
    if "lm_loss" in values and not np.isnan(values["lm_loss"]).all():
        notes.append("graph mode: 'loss' is the total (lm + aux + scaled mtp); its lm_loss is compared")
    else:
        values["lm_loss"] = total
        attrs["loss_is_total"] = True
        notes.append("graph mode printed only the total 'loss' (lm_loss is printed only for MoE or MTP models); "
                     "it is compared as the lm loss, which it equals for a dense model without MTP")
    scaled = values.pop("mtp_scaled", None)
    if scaled is None or np.isnan(scaled).all():
        return 0
    if mtp_loss_scaling_factor:
        values[mtp_column(1)] = scaled / mtp_loss_scaling_factor
        notes.append(f"graph mode: mtp_loss is scaled; divided by mtp_loss_scaling_factor "
                     f"{mtp_loss_scaling_factor:g} (one MTP layer) to compare it as mtp_1_loss")
        return 1
    attrs["unusable"] = {mtp_column(1): "graph-mode mtp_loss is already multiplied by "
                         "mtp_loss_scaling_factor / mtp_num_layers: give the factor to compare it"}
    return 0


def _unscale_mtp(values: dict[str, np.ndarray], notes: list[str], attrs: dict, version: str,
                 mtp_loss_scaling_factor: float | None) -> None:
    """r2.0.0 prints mtp_<i>_loss multiplied by mtp_loss_scaling_factor / mtp_num_layers: divide it back."""
    columns = [c for c in values if re.fullmatch(r"mtp_\d+_loss", c)]
    if not columns or not mindformers_scales_mtp_loss(version):
        return
    if not mtp_loss_scaling_factor:
        attrs["unusable"] = {c: f"MindFormers {version} prints it multiplied by mtp_loss_scaling_factor / "
                                "mtp_num_layers: give the factor to compare it" for c in columns}
        return
    for column in columns:
        values[column] = values[column] / mtp_loss_scaling_factor
    notes.append(f"MindFormers {version} prints the MTP losses multiplied by mtp_loss_scaling_factor / mtp_num_layers; "
                 f"divided by {mtp_loss_scaling_factor:g} to compare them unscaled")


def _skipped_steps(text: str, steps: np.ndarray, values: dict[str, np.ndarray], notes: list[str]) -> list[int]:
    """Correct the lr for the steps the trainer skipped on a NaN/Inf gradient norm (see the module docstring).

    The lr printed at step s is the schedule at s, and the optimizer applies the schedule at the number
    of updates it made: at step s + 1 that is s - k, k being the steps skipped up to s. So the lr of
    row s (applied at s + 1) is the one printed at step s - k, and NaN when step s + 1 was itself skipped.
    """
    skipped = sorted({int(match[2]) for match in SKIP_RE.finditer(text)})
    if not skipped or "lr" not in values:
        return skipped
    printed = dict(zip(steps.tolist(), values["lr"].tolist()))
    done = np.searchsorted(np.array(skipped), steps, side="right")  # skipped steps <= s
    values["lr"] = np.array([NAN if step + 1 in skipped else printed.get(step - k, NAN) if k else printed[step]
                             for step, k in zip(steps.tolist(), done.tolist())], dtype=np.float64)
    notes.append(f"the trainer skipped the optimizer update of step(s) {step_ranges(skipped)} (NaN/Inf gradient "
                 "norm, [SkipStepOnNaN]): the printed lr runs ahead of the applied one by the steps skipped so far; "
                 "the applied lr is taken from the earlier lines")
    return skipped


def parse_mindformers_text(path: Path, text: str, mtp_loss_scaling_factor: float | None = None,
                           truncated: bool = False, fmt: str | None = None,
                           mindformers_version: str | None = None) -> pd.DataFrame:
    """Parse the text of a MindFormers log (``path`` only names it in messages and attrs);
    ``fmt`` is the format when the caller already detected it. ``mindformers_version`` (pynative) decides
    whether its mtp_<i>_loss is scaled; ``mtp_loss_scaling_factor`` is then mtp_loss_scaling_factor /
    mtp_num_layers, as for graph mode. Without the version the MTP losses are read as printed."""
    path = Path(path)
    notes: list[str] = []
    attrs: dict = {}
    unreadable: list[dict] = []
    if fmt is None:
        fmt = ("mindformers-graph" if GRAPH_RE.search(text) else
               "mindformers-pynative" if STEP_MARK in text else None)
    if fmt not in ("mindformers-pynative", "mindformers-graph"):
        raise LogFormatError(f"{path}: no MindFormers step line ('step:[' or 'Epoch:[') found")
    graph = fmt == "mindformers-graph"
    fast = None if graph else _fast(text, text.count(STEP_MARK))
    steps, values, columns = fast or _slow(path, text, graph, notes, attrs, unreadable)
    if fast:
        attrs["printed_nan"] = {name: [int(s) for s in steps[np.isnan(col)]] for name, col in values.items()}
    notes += unreadable_notes(path, "MindFormers", unreadable)
    if not len(steps):
        raise LogFormatError(f"{path}: no MindFormers {'graph-mode' if graph else 'pynative'} step line could be read")
    mtp_count = max((int(c.split("_")[1]) for c in columns if re.fullmatch(r"mtp_\d+_loss", c)), default=0)
    if graph:
        mtp_count = _graph_columns(values, notes, attrs, mtp_loss_scaling_factor)
    else:
        if mindformers_version is not None:
            _unscale_mtp(values, notes, attrs, mindformers_version, mtp_loss_scaling_factor)
        attrs["skipped_steps"] = _skipped_steps(text, steps, values, notes)
    extras = [c for c in values if c.endswith("_loss") and c not in ("lm_loss", "aux_loss")
              and not re.fullmatch(r"mtp_\d+_loss", c)]
    logged = [name for name, col in values.items() if name != "step_time_ms" and not np.isnan(col).all()]
    if truncated:
        notes.append(f"{path.name}: the last line was cut off and is ignored")
    attrs.update({"notes": notes, "lr_step_offset": 0 if graph else 1, "unreadable": unreadable})
    return finish_frame(path, fmt, steps, values, mtp_count, logged, attrs, extras=extras)


def parse_mindformers_log(path: Path, mtp_loss_scaling_factor: float | None = None,
                          mindformers_version: str | None = None) -> pd.DataFrame:
    """Parse a MindFormers log file, pynative or graph mode (see ``crossalign.sides.log_common`` for the frame).

    ``mtp_loss_scaling_factor`` is needed for graph-mode logs with ``mtp_loss`` and for pynative logs of a
    release that prints the MTP losses scaled (``mindformers_version`` r2.0.0), both already scaled.
    """
    text, truncated = read_log_text(Path(path))
    return parse_mindformers_text(Path(path), text, mtp_loss_scaling_factor, truncated,
                                  mindformers_version=mindformers_version)
