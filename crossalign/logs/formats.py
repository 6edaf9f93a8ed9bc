"""The per-step log lines of Megatron-LM and MindFormers, written exactly as the frameworks write them.

The parsers in this package read these lines; the embedded trainers (and the tests and the
benchmark) write them with these functions, so both ends agree on one definition of each format
(SPEC section 7; Megatron ``training.py::training_log``, MindFormers ``LossCallback`` and
``MFLossMonitor``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from datetime import datetime

MINDFORMERS_PYNATIVE_SOURCE = "mindformers/pynative/callback/loss_callback.py:337"
MINDFORMERS_GRAPH_SOURCE = "mindformers/core/callback/callback.py:747"
MINDFORMERS_GRAPH_PROGRESS_SOURCE = "mindformers/core/callback/callback.py:764"


def core_version_tuple(version: str) -> tuple[int, int, int]:
    """``"0.16.1"`` -> ``(0, 16, 1)``; a suffix such as ``rc0`` or ``.dev0`` is ignored."""
    match = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    if match is None:
        raise ValueError(f"megatron core version {version!r} is not of the form MAJOR.MINOR[.PATCH]")
    return int(match[1]), int(match[2]), int(match[3] or 0)


def megatron_averages_first_two(core_version: str) -> bool:
    """From core 0.16 the first logged iteration of a process does not reset the loss accumulators."""
    return core_version_tuple(core_version) >= (0, 16)


def megatron_prints_loss(value: float, core_version: str) -> bool:
    """0.16 prints a loss only when its average is > 0, 0.17 on when it is >= 0; NaN never."""
    if core_version_tuple(core_version) >= (0, 17):
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


def mindformers_prefix(source: str, timestamp: datetime | None = None,
                       log_dir: str = "/job/output/log") -> str:
    """The stdout prefix of the MindFormers logger: ``<asctime> - mindformers<log dir>[<file:line>] - INFO - ``."""
    now = timestamp or datetime.now()
    asctime = now.strftime("%Y-%m-%d %H:%M:%S") + f",{now.microsecond // 1000:03d}"
    return f"{asctime} - mindformers{log_dir}[{source}] - INFO - "


def pynative_line(
    step: int,
    max_steps: int,
    *,
    consumed_samples: int,
    global_batch_size: int,
    loss: float | None,
    per_step_time_ms: int,
    lr: float | None,
    grad_norm: float | None,
    load_balancing_loss: float | None = None,
    mtp_losses: tuple[float, ...] = (),
    throughput: float | None = None,
) -> str:
    """One ``LossCallback`` message (without the logger prefix); ``loss=None`` is a non-last PP stage."""
    parts = [
        "step:[{:5d}/{:5d}]".format(step, max_steps),
        f"consumed_samples: {consumed_samples}",
        f"global_batch_size: {global_batch_size}",
        "loss: N/A (non-last PP stage, refer to last stage for real loss)" if loss is None else f"loss: {loss:10.6f}",
        f"per_step_time: {per_step_time_ms:6d}ms",
    ]
    if load_balancing_loss is not None:
        parts.append(f"load_balancing_loss: {load_balancing_loss:10.6f}")
    parts.extend(f"mtp_{k}_loss: {value:10.6f}" for k, value in enumerate(mtp_losses, start=1))
    if lr is not None:
        parts.append(f"lr: {lr:10.6e}")
    parts.append("grad_norm: NaN" if grad_norm is None else f"grad_norm: {grad_norm:10.6f}")
    if throughput is not None:
        parts.append(f"throughput: {throughput:6.2f}T")
    return "{ " + ", ".join(parts) + " }"


def graph_lines(
    epoch: int,
    epochs: int,
    step: int,
    steps_per_epoch: int,
    *,
    loss: float,
    per_step_time_ms: int,
    lr: float | None,
    global_norm: float,
    lm_loss: float | None = None,
    load_balancing_loss: float | None = None,
    mtp_loss: float | None = None,
    sink_mode: bool = True,
    loss_mean: float | None = None,
    throughput: float | None = 210.123,
) -> tuple[str, str]:
    """The two ``MFLossMonitor`` messages of a logged step (without the logger prefix).

    ``loss`` is the total (lm + aux + scaled mtp); ``mtp_loss`` is already scaled by
    mtp_loss_scaling_factor / mtp_num_layers; the lr is numpy's shortest repr.
    """
    import numpy as np

    loss_part = f"loss: {loss:.6f}, " if sink_mode else f"loss:[{loss:.6f}/{(loss_mean if loss_mean is not None else loss):.6f}], "
    separate = ""
    if lm_loss is not None:
        separate += f"lm_loss: {lm_loss:.6f}, "
    if load_balancing_loss is not None:
        separate += f"load_balancing_loss: {load_balancing_loss:.6f}, "
    if mtp_loss is not None:
        separate += f"mtp_loss: {mtp_loss:.6f}, "
    lr_part = f"lr: {np.array2string(np.float32(lr))}, " if lr is not None else ""
    norm = np.array2string(np.array([global_norm], dtype=np.float32))
    line = ("{ Epoch:[%3d/%3d], step:[%5d/%5d], " % (epoch, epochs, step, steps_per_epoch)
            + loss_part + separate + f"per_step_time: {per_step_time_ms}ms, " + lr_part
            + f"overflow cond: False, loss_scale: 1.0, global_norm: {norm}")
    if throughput is not None:
        line += f", train_throughput_per_npu: {throughput:.3f}T"
    done = 100.0 * step / steps_per_epoch
    bar = ("|%-50s|" % (int(50 * done / 100) * "\u2588"))
    progress = "  %4.1f%% %s %.5f samples/s/p  %s }" % (done, bar, 0.65, "0:25:27")
    return line, progress
