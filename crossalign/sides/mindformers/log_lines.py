"""MindFormers' per-step log lines, written exactly as pynative ``LossCallback`` and graph-mode
``MFLossMonitor`` write them, with the version rule of how a release prints the MTP loss.

The parser (``log_parser.py``) reads these lines; the embedded trainer (and the tests and the
benchmarks) write them with these functions, so both ends agree on one definition (SPEC section 7).
"""

from __future__ import annotations

from datetime import datetime

import numpy as np

from crossalign.versions import version_tuple

MINDFORMERS_PYNATIVE_SOURCE = "mindformers/pynative/callback/loss_callback.py:337"
MINDFORMERS_GRAPH_SOURCE = "mindformers/core/callback/callback.py:747"
MINDFORMERS_GRAPH_PROGRESS_SOURCE = "mindformers/core/callback/callback.py:764"

# MindFormers pynative ``LossCallback`` prints ``mtp_<i>_loss`` as the MTP tracker holds it (``process_mtp_loss``,
# ``pynative/transformers/multi_token_prediction.py``): multiplied by mtp_loss_scaling_factor / mtp_num_layers
# in r2.0.0 (L645-649) and on master until July 2026 (L659-663), the plain cross entropy from 2.1.0 (L683-687).
# Releases before 2.0.0 log no MTP or aux loss at all (r1.9.0 ``loss_callback.py``) and are not supported.
MINDFORMERS_OLDEST = (2, 0, 0)
MINDFORMERS_UNSCALED_MTP = (2, 1, 0)  # first release that prints the MTP loss unscaled


def mindformers_scales_mtp_loss(version: str) -> bool:
    """Whether this MindFormers release's pynative log prints mtp_<i>_loss multiplied by
    mtp_loss_scaling_factor / mtp_num_layers (r2.0.0) rather than as the plain cross entropy (2.1.0 on)."""
    parsed = version_tuple(version, "MindFormers")
    if parsed < MINDFORMERS_OLDEST:
        raise ValueError(f"MindFormers {version}: releases before 2.0.0 log neither the MTP nor the MoE aux loss "
                         "(r1.9.0 LossCallback) and reject the generated YAML; use 2.0.0 or later")
    return parsed < MINDFORMERS_UNSCALED_MTP


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
