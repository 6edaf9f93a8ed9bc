"""Megatron-LM's per-iteration log lines, written exactly as ``training.py::training_log`` writes them.

The parser (``log_parser.py``) reads these lines; the embedded trainers (and the tests and the
benchmarks) write them with these functions, so both ends agree on one definition of the format
(SPEC section 7), with the version rules of what a core prints.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import datetime

from crossalign.versions import version_tuple

# Megatron-LM ``megatron/training/training.py::training_log``: from core_v0.16.0 the first iteration of
# every process is printed whether or not it is on a log-interval boundary, and the loss sums are kept
# after it (``should_reset = not is_first_iteration``; core_v0.16.0 L1797, core_v0.19.0 L2594, the
# core_r0.19.0 branch at 0.19.1 unchanged). Upstream PR #7092 (merged into main, then version 0.20.0,
# in September 2026) resets them when that iteration is on a boundary; no release before 0.20.0 carries it.
MEGATRON_KEEPS_FIRST_LINE = ((0, 16, 0), (0, 20, 0))  # [first version with the bug, first version fixed)


def megatron_prints_first_iteration(core_version: str) -> bool:
    """From core 0.16 the first iteration of a process is printed even off a log-interval boundary."""
    return version_tuple(core_version) >= MEGATRON_KEEPS_FIRST_LINE[0]


def megatron_keeps_first_line(core_version: str | None) -> bool | None:
    """Whether this core keeps the first printed iteration of a process in its loss sums when that
    iteration is on a log-interval boundary (so the next line holds the mean of both lines'
    iterations); None when the version is unknown."""
    if core_version is None:
        return None
    low, fixed = MEGATRON_KEEPS_FIRST_LINE
    return low <= version_tuple(core_version) < fixed


def megatron_resets_after_first_line(core_version: str, first_step: int, log_interval: int) -> bool:
    """Whether ``training_log`` resets its sums after printing the first iteration of a process.

    Before 0.16 a line is printed only on a boundary and always resets; 0.16-0.19 never reset after the
    first line; from 0.20 they reset when it is on a boundary (off a boundary the interval goes on).
    """
    if not megatron_prints_first_iteration(core_version):
        return True
    return not megatron_keeps_first_line(core_version) and first_step % log_interval == 0


def megatron_prints_loss(value: float, core_version: str) -> bool:
    """0.16 prints a loss only when its average is > 0, 0.17 on when it is >= 0; NaN never."""
    if version_tuple(core_version) >= (0, 17):
        return value >= 0.0
    return value > 0.0


def megatron_line(
    iteration: int,
    train_iters: int,
    *,
    consumed_samples: int,
    elapsed_ms: float,
    learning_rate: float,
    global_batch_size: int,
    losses: Mapping[str, float],
    grad_norm: float | None,
    core_version: str = "0.16.1",
    timestamp: datetime | None = None,
    loss_scale: float = 1.0,
    skipped: int = 0,
    nan_iterations: int = 0,
) -> str:
    """One ``training_log`` line; ``losses`` maps Megatron names (``lm loss``, ``load_balancing_loss``,
    ``mtp_1 loss``) to the averages printed, in print order."""
    stamp = (timestamp or datetime.now()).strftime("%Y-%m-%d %H:%M:%S.%f")
    line = f" [{stamp}]"
    line += " iteration {:8d}/{:8d} |".format(iteration, train_iters)
    line += " consumed samples: {:12d} |".format(consumed_samples)
    line += " elapsed time per iteration (ms): {:.1f} |".format(elapsed_ms)
    line += f" learning rate: {learning_rate:.6E} |"
    line += f" global batch size: {global_batch_size:5d} |"
    for key, value in losses.items():
        if megatron_prints_loss(value, core_version):
            line += " {}: {:.6E} |".format(key, value)
    line += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    line += " number of skipped iterations: {:3d} |".format(skipped)
    line += " number of nan iterations: {:3d} |".format(nan_iterations)
    return line


def megatron_validation_block(iteration: int, lm_loss: float) -> str:
    """The validation line with its dashed frame (three lines, no trailing newline)."""
    line = f" validation loss at iteration {iteration} | lm loss value: {lm_loss:.6E} | "
    line += f"lm loss PPL: {math.exp(min(20.0, lm_loss)):.6E} | "
    dashes = "-" * (len(line) + 1)
    return f"{dashes}\n{line}\n{dashes}"


