"""What a real Megatron run's log must show: its progress lines, a checkpoint that loaded, every iteration."""

from __future__ import annotations

import math
import re
from pathlib import Path

from crossalign.sides.launch import (
    BackendRunError,
    failure_summary,
    missing_steps,
)
from crossalign.sides.log_common import LogFormatError
from crossalign.sides.megatron.log_parser import parse_megatron_text


ITERATION_LINE = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|")
# What Megatron prints when its strict load raised and it loaded again non-strictly: always
# "load_return: None", since the DDP and Float16Module wrappers drop load_state_dict's result
# (core_v0.16.1 megatron/training/checkpointing.py:1759-1767, data_parallel_base.py:90-96,
# module.py:511-514; seen in the rehearsal's run of pretrain()). It names no key: the load digest does.
NON_STRICT_LOAD = re.compile(r"^load_return: (.*)$")
PROGRESS_METRICS = ("lm_loss", "aux_loss", "lr", "grad_norm", "step_time_ms")


def parse_iteration_line(line: str) -> tuple[int, int, dict[str, float]] | None:
    """(iteration, total, metrics) of a Megatron ``training_log`` line, for progress; None for other lines.

    The line is read by the log parser (``log_parser.py``), so progress, the log check and the comparison
    accept the same lines, and the metrics are the parser's columns as printed (never corrected).
    """
    match = ITERATION_LINE.search(line)
    if not match:
        return None
    try:
        frame = parse_megatron_text(Path("<line>"), line + "\n", core_version=None)
    except LogFormatError:
        return None
    row = frame.iloc[-1]
    names = [name for name in frame.columns if name in PROGRESS_METRICS or re.fullmatch(r"mtp_\d+_loss", name)]
    metrics = {name: float(row[name]) for name in names if not math.isnan(row[name])}
    return int(row["step"]), int(match.group(2)), metrics


def verify_megatron_log(log_path: Path, *, iterations: int, loaded: bool, exit_status: int) -> str | None:
    """Raise BackendRunError unless the log shows a load (when asked) and every iteration 1..N.

    Returns where Megatron fell back to a non-strict load ("FILE:LINE: load_return: None"), None if
    it did not: that line cannot say what did not load, so the step's load digest decides
    (:func:`verify_load_digest`).
    """
    if not log_path.exists():
        raise BackendRunError(f"{log_path}: Megatron wrote no log (exit status {exit_status})")
    seen: set[int] = set()
    load_ok = False
    non_strict = None
    with open(log_path, encoding="utf-8", errors="replace") as log:
        for number, line in enumerate(log, start=1):
            where = f"{log_path}:{number}: {line.strip()[:300]}"
            if "could not load the checkpoint" in line:
                raise BackendRunError(f"Megatron could not unpickle the checkpoint (it exits 0 anyway): {where}. "
                                      "Write the checkpoint with plain tensors, or apply the megatron-weights-only patch.")
            if "could not find the metadata file" in line and loaded:
                raise BackendRunError(f"Megatron found no checkpoint to load and would start from random weights: {where}")
            if non_strict is None and NON_STRICT_LOAD.match(line.strip()):
                non_strict = where
            if "successfully loaded checkpoint" in line:
                load_ok = True
            parsed = parse_iteration_line(line)
            if parsed:
                seen.add(parsed[0])
    if exit_status != 0:
        raise BackendRunError(f"Megatron exited with status {exit_status}; end of {log_path}:\n"
                              f"{failure_summary(log_path)}")
    if loaded and not load_ok:
        raise BackendRunError(f"{log_path}: no 'successfully loaded checkpoint' line: the checkpoint was not loaded")
    absent = missing_steps(seen, iterations)
    if absent:
        last = max(seen) if seen else 0
        raise BackendRunError(f"{log_path}: iterations {absent[0]}..{absent[-1]} of {iterations} were never logged "
                              f"(last logged: {last}); end of the log:\n{failure_summary(log_path)}")
    return non_strict
