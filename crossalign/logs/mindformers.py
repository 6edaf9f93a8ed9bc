"""Parse a MindFormers training log, pynative (``LossCallback``) or graph mode (``MFLossMonitor``).

The logger prefix (stdout ``<time> - mindformers<dir>[<file:line>] - INFO - `` or the file
handler's ``[INFO] <time> [<file:line>] <func>: ``) does not matter: the regex starts at the
message. What each format means (SPEC section 7, reference/mindformers.md 1b-1c):

- pynative: ``loss`` is the lm loss, ``mtp_k_loss`` unscaled, ``load_balancing_loss`` the mean
  unscaled aux loss per MoE layer, ``lr`` the lr of the *next* step (``lr_step_offset`` 1); a
  non-last pipeline stage prints ``loss: N/A (...)`` and is skipped;
- graph: ``loss`` is the TOTAL (lm + aux + scaled mtp); ``lm_loss`` is printed only for MoE or
  MTP models (otherwise the total is all there is, and for such a dense model it equals the lm
  loss); ``mtp_loss`` is already multiplied by mtp_loss_scaling_factor / mtp_num_layers; ``lr``
  is the applied one (``lr_step_offset`` 0); global step = (epoch-1)*steps_per_epoch + step.

Several ranks in one file: with ``[rankN]:`` prefixes the highest rank that printed a loss is
used (the last pipeline stage; data-parallel ranks print the same all-reduced value).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd

from crossalign.logs.common import LogFormatError, finish_frame, floats, mtp_column, read_log_text

PYNATIVE_RE = re.compile(r"\{ step:\[\s*\d+/\s*\d+\], consumed_samples:")
GRAPH_RE = re.compile(r"\{ Epoch:\[\s*\d+/\s*\d+\], step:\[\s*\d+/\s*\d+\], loss:")
_RANK_PREFIX_RE = re.compile(r"^\[(?:rank|default)\d+\]:", re.M)
_RANK = r"^(?:\[(?:rank|default)(\d+)\]:)?[^\n]*?"
_VALUE = r"([^,\s]+)"
_NA = "N/A"


def _pynative_regex(mtp_count: int, ranked: bool) -> re.Pattern:
    pattern = (
        (_RANK if ranked else "")
        + r"\{ step:\[\s*(\d+)/\s*\d+\], consumed_samples: \d+, global_batch_size: \d+, "
        + r"loss:\s*(N/A(?: \([^)\n]*\))?|[^,\s]+), per_step_time:\s*(\d+)ms"
        + rf"(?:, load_balancing_loss:\s*{_VALUE})?(?:, indexer_loss:\s*[^,\s]+)?"
        + "".join(rf"(?:, mtp_{k}_loss:\s*{_VALUE})?" for k in range(1, mtp_count + 1))
        + rf"(?:, lr:\s*{_VALUE})?(?:, grad_norm:\s*{_VALUE})?"
        + r"([^\n]*)"
    )
    return re.compile(pattern, re.M)


def _graph_regex(ranked: bool) -> re.Pattern:
    pattern = (
        (_RANK if ranked else "")
        + r"\{ Epoch:\[\s*(\d+)/\s*\d+\], step:\[\s*(\d+)/\s*(\d+)\], "
        + r"loss:\s*\[?([^,\s/\]]+)(?:/[^\]\n]*\])?, "
        + rf"(?:lm_loss:\s*{_VALUE}, )?(?:load_balancing_loss:\s*{_VALUE}, )?(?:mtp_loss:\s*{_VALUE}, )?"
        + r"(?:indexer_loss:\s*[^,\s]+, )?per_step_time:\s*(\d+)ms, "
        + r"(?:lr:\s*\[?([^,\s\]]+)\]?, )?overflow cond:\s*\w+, loss_scale:\s*[^,\s]+, "
        + r"global_norm:\s*\[?([^,\s\]]+)\]?"
        + r"([^\n]*)"
    )
    return re.compile(pattern, re.M)


def _has_rank_prefixes(text: str, mark: str) -> bool:
    """Whether the step lines carry ``[rankN]:`` prefixes, judged by the first one (no full scan)."""
    at = text.find(mark)
    line_start = text.rfind("\n", 0, at) + 1
    return bool(_RANK_PREFIX_RE.match(text, line_start))


def _mtp_count(text: str) -> int:
    k = 0
    while f" mtp_{k + 1}_loss: " in text:
        k += 1
    return k


def _pick_rank(ranks: tuple[str, ...], usable: np.ndarray, notes: list[str]) -> np.ndarray:
    """Rows of the highest rank that printed a loss (the last pipeline stage)."""
    ids = np.array([int(r) if r else -1 for r in ranks])
    candidates = sorted(set(ids[usable].tolist()))
    if len(candidates) <= 1:
        return usable
    chosen = candidates[-1]
    notes.append(f"{len(candidates)} ranks logged steps in this file; rank {chosen} "
                 "(the highest that printed a loss: the last pipeline stage) is used")
    return usable & (ids == chosen)


def _first_line_regex(text: str, mtp_count: int) -> tuple[re.Pattern, list[str]] | None:
    """A strict regex for lines laid out exactly like the first step line (the common case, faster than
    the general one), and the columns its groups capture; None when that line is a non-last stage's."""
    match = _pynative_regex(mtp_count, False).search(text)
    if match is None or match[2].startswith(_NA):
        return None
    start, end = match.span()
    fields = text[text.index("], ", start) + 3: end].split(", ")
    wanted = {"loss": "lm_loss", "load_balancing_loss": "aux_loss", "lr": "lr", "grad_norm": "grad_norm",
              **{f"mtp_{k}_loss": mtp_column(k) for k in range(1, mtp_count + 1)}}
    pattern, names = r"\{ step:\[\s*(\d+)/\s*\d+\]", []
    for field in fields:
        label = field.split(":", 1)[0]
        if label == "per_step_time":
            pattern += r", per_step_time:\s*(\d+)ms"
            names.append("step_time_ms")
        elif label in wanted:
            pattern += rf", {label}:\s*([^,\s]+)"
            names.append(wanted[label])
        else:
            pattern += r", [^,\n]*"
    return re.compile(pattern), names


def _rows(text: str, mtp_count: int, ranked: bool) -> tuple[list[tuple[str, ...]], list[str]]:
    """The captured fields of every step line (rank first when ranked) and the column of each group."""
    general = ["lm_loss", "step_time_ms", "aux_loss", *(mtp_column(k) for k in range(1, mtp_count + 1)),
               "lr", "grad_norm", "rest"]
    strict = None if ranked else _first_line_regex(text, mtp_count)
    if strict is not None:
        rows = strict[0].findall(text)
        if len(rows) == text.count("{ step:["):
            return rows, strict[1]
    return _pynative_regex(mtp_count, ranked).findall(text), general


def _parse_pynative(path: Path, text: str, notes: list[str]) -> tuple[np.ndarray, dict, int, list[str]]:
    mtp_count = _mtp_count(text)
    ranked = _has_rank_prefixes(text, "{ step:[")
    rows, names = _rows(text, mtp_count, ranked)
    if not rows:
        raise LogFormatError(f"{path}: no MindFormers pynative step line could be read")
    cols = list(zip(*rows))
    if ranked:
        ranks, cols = cols[0], cols[1:]
    if names[-1] == "rest":
        if any("loss: " in rest or "lr: " in rest or "grad_norm: " in rest for rest in cols[-1]):
            raise LogFormatError(f"{path}: a MindFormers pynative step line has its fields in an unknown order")
        names, cols = names[:-1], cols[:-1]
    loss = cols[1 + names.index("lm_loss")]
    usable = np.fromiter((not v.startswith(_NA) for v in loss), dtype=bool, count=len(rows))
    if ranked:
        usable = _pick_rank(ranks, usable, notes)
    if not usable.any():
        raise LogFormatError(f"{path}: every step line says 'loss: N/A' (a non-last pipeline stage); "
                             "compare the log of the last stage")
    if not usable.all():
        notes.append("lines of non-last pipeline stages ('loss: N/A') or of other ranks are skipped")
        keep = np.flatnonzero(usable)
        cols = [[col[i] for i in keep] for col in cols]
    steps = np.fromiter(map(int, cols[0]), dtype=np.int64, count=len(cols[0]))
    columns = {name: floats(col) for name, col in zip(names, cols[1:])}
    logged = [name for name, col in zip(names, cols[1:]) if name != "step_time_ms" and any(col)]
    return steps, columns, mtp_count, logged


def _parse_graph(path: Path, text: str, notes: list[str], attrs: dict,
                 mtp_loss_scaling_factor: float | None) -> tuple[np.ndarray, dict, int, list[str]]:
    ranked = _has_rank_prefixes(text, "{ Epoch:[")
    rows = _graph_regex(ranked).findall(text)
    if not rows:
        raise LogFormatError(f"{path}: no MindFormers graph-mode step line could be read")
    cols = list(zip(*rows))
    if ranked:
        ranks, cols = cols[0], cols[1:]
        keep = np.flatnonzero(_pick_rank(ranks, np.ones(len(rows), dtype=bool), notes))
        cols = [[col[i] for i in keep] for col in cols]
    epoch, step, per_epoch = (np.array(c, dtype=np.int64) for c in cols[:3])
    steps = (epoch - 1) * per_epoch + step
    total, lm, aux, mtp, step_time, lr, norm = (floats(c) for c in cols[3:10])
    columns = {"aux_loss": aux, "lr": lr, "grad_norm": norm, "step_time_ms": step_time}
    logged = ["lr"] if any(cols[8]) else []
    logged += ["grad_norm"]
    if any(cols[4]):
        columns["lm_loss"] = lm
        notes.append("graph mode: 'loss' is the total (lm + aux + scaled mtp); its lm_loss is compared")
    else:
        columns["lm_loss"] = total
        attrs["loss_is_total"] = True
        notes.append("graph mode printed only the total 'loss' (lm_loss is printed only for MoE or MTP models); "
                     "it is compared as the lm loss, which it equals for a dense model without MTP")
    logged.append("lm_loss")
    if any(cols[5]):
        logged.append("aux_loss")
    mtp_count = 0
    if any(cols[6]):
        if mtp_loss_scaling_factor:
            columns[mtp_column(1)] = mtp / mtp_loss_scaling_factor
            logged.append(mtp_column(1))
            mtp_count = 1
            notes.append(f"graph mode: mtp_loss is scaled; divided by mtp_loss_scaling_factor "
                         f"{mtp_loss_scaling_factor:g} (one MTP layer) to compare it as mtp_1_loss")
        else:
            attrs["unusable"] = {mtp_column(1): "graph-mode mtp_loss is already multiplied by "
                                 "mtp_loss_scaling_factor / mtp_num_layers: give the factor to compare it"}
    return steps, columns, mtp_count, logged


def parse_mindformers_text(path: Path, text: str, mtp_loss_scaling_factor: float | None = None,
                           truncated: bool = False, fmt: str | None = None) -> pd.DataFrame:
    """Parse the text of a MindFormers log (``path`` only names it in messages and attrs);
    ``fmt`` is the format when the caller already detected it."""
    path = Path(path)
    notes: list[str] = []
    attrs: dict = {}
    if fmt == "mindformers-pynative" or (fmt is None and "{ step:[" in text and PYNATIVE_RE.search(text)):
        fmt, offset = "mindformers-pynative", 1
        steps, columns, mtp_count, logged = _parse_pynative(path, text, notes)
    elif fmt == "mindformers-graph" or (fmt is None and "{ Epoch:[" in text and GRAPH_RE.search(text)):
        fmt, offset = "mindformers-graph", 0
        steps, columns, mtp_count, logged = _parse_graph(path, text, notes, attrs, mtp_loss_scaling_factor)
    else:
        raise LogFormatError(f"{path}: no MindFormers step line ('{{ step:[' or '{{ Epoch:[') found")
    if truncated:
        notes.append(f"{path.name}: the last line was cut off and is ignored")
    attrs.update({"notes": notes, "lr_step_offset": offset})
    return finish_frame(path, fmt, steps, columns, mtp_count, logged, attrs)


def parse_mindformers_log(path: Path, mtp_loss_scaling_factor: float | None = None) -> pd.DataFrame:
    """Parse a MindFormers log file, pynative or graph mode (see ``crossalign.logs.common`` for the frame).

    ``mtp_loss_scaling_factor`` is needed only for graph-mode logs with ``mtp_loss`` (already scaled).
    """
    text, truncated = read_log_text(Path(path))
    return parse_mindformers_text(Path(path), text, mtp_loss_scaling_factor, truncated)
