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


def core_version_tuple(version: str, framework: str = "megatron core") -> tuple[int, int, int]:
    """``"0.16.1"`` -> ``(0, 16, 1)``; a suffix such as ``rc0`` or ``.dev0`` is ignored."""
    match = re.match(r"[vr]?(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    if match is None:
        raise ValueError(f"{framework} version {version!r} is not of the form MAJOR.MINOR[.PATCH]")
    return int(match[1]), int(match[2]), int(match[3] or 0)


# MindFormers pynative ``LossCallback`` prints ``mtp_<i>_loss`` as the MTP tracker holds it (``process_mtp_loss``,
# ``pynative/transformers/multi_token_prediction.py``): multiplied by mtp_loss_scaling_factor / mtp_num_layers
# in r2.0.0 (L645-649) and on master until July 2026 (L659-663), the plain cross entropy from 2.1.0 (L683-687).
# Releases before 2.0.0 log no MTP or aux loss at all (r1.9.0 ``loss_callback.py``) and are not supported.
MINDFORMERS_OLDEST = (2, 0, 0)
MINDFORMERS_UNSCALED_MTP = (2, 1, 0)  # first release that prints the MTP loss unscaled


def mindformers_scales_mtp_loss(version: str) -> bool:
    """Whether this MindFormers release's pynative log prints mtp_<i>_loss multiplied by
    mtp_loss_scaling_factor / mtp_num_layers (r2.0.0) rather than as the plain cross entropy (2.1.0 on)."""
    parsed = core_version_tuple(version, "MindFormers")
    if parsed < MINDFORMERS_OLDEST:
        raise ValueError(f"MindFormers {version}: releases before 2.0.0 log neither the MTP nor the MoE aux loss "
                         "(r1.9.0 LossCallback) and reject the generated YAML; use 2.0.0 or later")
    return parsed < MINDFORMERS_UNSCALED_MTP


# Megatron-LM ``megatron/training/training.py::training_log``: from core_v0.16.0 the first iteration of
# every process is printed whether or not it is on a log-interval boundary, and the loss sums are kept
# after it (``should_reset = not is_first_iteration``; core_v0.16.0 L1797, core_v0.19.0 L2594, the
# core_r0.19.0 branch at 0.19.1 unchanged). Upstream PR #7092 (merged into main, then version 0.20.0,
# in September 2026) resets them when that iteration is on a boundary; no release before 0.20.0 carries it.
MEGATRON_KEEPS_FIRST_LINE = ((0, 16, 0), (0, 20, 0))  # [first version with the bug, first version fixed)


def megatron_prints_first_iteration(core_version: str) -> bool:
    """From core 0.16 the first iteration of a process is printed even off a log-interval boundary."""
    return core_version_tuple(core_version) >= MEGATRON_KEEPS_FIRST_LINE[0]


def megatron_keeps_first_line(core_version: str | None) -> bool | None:
    """Whether this core keeps the first printed iteration of a process in its loss sums when that
    iteration is on a log-interval boundary (so the next line holds the mean of both lines'
    iterations); None when the version is unknown."""
    if core_version is None:
        return None
    low, fixed = MEGATRON_KEEPS_FIRST_LINE
    return low <= core_version_tuple(core_version) < fixed


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
    consumed_samples: int | None,
    global_batch_size: int | None,
    loss: float | None,
    per_step_time_ms: int,
    lr: float | None,
    grad_norm: float | None,
    load_balancing_loss: float | None = None,
    mtp_losses: tuple[float, ...] = (),
    throughput: float | None = None,
) -> str:
    """One ``LossCallback`` message (without the logger prefix); ``loss=None`` is a non-last PP stage.

    ``consumed_samples``/``global_batch_size`` None: the release branches r1.9.0 and r2.0.0, which print
    neither (``_print_log``, r1.9.0 L169-190, r2.0.0 L270-310); MindFormers master added both in July 2026.
    """
    parts = ["step:[{:5d}/{:5d}]".format(step, max_steps)]
    if consumed_samples is not None:
        parts += [f"consumed_samples: {consumed_samples}", f"global_batch_size: {global_batch_size}"]
    parts += [
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
