"""Write whole training logs of either framework from chosen per-step values.

For the tests and the benchmark of the comparison, which need logs with known numbers (an
offset, a spike, a NaN, a missing MTP series), and as the reference of how each framework turns
per-step values into log lines: Megatron prints the *next* step's lr and, on cores 0.16-0.19 with
log interval 1, the mean of the first two iterations on its second line; MindFormers pynative
prints the next step's lr, graph mode the applied one and a total loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path

from crossalign.sides.megatron.log_lines import megatron_line, megatron_prints_first_iteration, megatron_resets_after_first_line

from crossalign.sides.mindformers.log_lines import MINDFORMERS_GRAPH_PROGRESS_SOURCE, MINDFORMERS_GRAPH_SOURCE, MINDFORMERS_PYNATIVE_SOURCE, graph_lines, mindformers_prefix, pynative_line

_START = datetime(2026, 3, 20, 10, 11, 12, 345678)


def _next_lr(lr_applied: Sequence[float], i: int) -> float:
    """The lr of the step after index i (the last step repeats its own)."""
    return lr_applied[min(i + 1, len(lr_applied) - 1)]


def _grad_norms(n: int) -> list[float]:
    """The grad norm both writers print unless given: the same on both sides (step 1 above a clip of 1.0)."""
    return [3.0 + 0.001 * i for i in range(n)]


def megatron_lines(lm: Sequence[float], *, mtp: Sequence[Sequence[float]] = (), aux: Sequence[float] | None = None,
                   lr_applied: Sequence[float] | None = None, core_version: str = "0.16.1", first_step: int = 1,
                   train_iters: int | None = None, log_interval: int = 1, global_batch_size: int = 8,
                   grad_norm: Sequence[float] | None = None) -> list[str]:
    """Iteration lines of one Megatron process that trains steps first_step .. first_step+len(lm)-1."""
    n = len(lm)
    lr_applied = lr_applied if lr_applied is not None else [1e-5] * n
    grad_norm = grad_norm if grad_norm is not None else _grad_norms(n)
    train_iters = train_iters or first_step + n - 1
    print_first = megatron_prints_first_iteration(core_version)
    reset_first = megatron_resets_after_first_line(core_version, first_step, log_interval)
    series = {"lm loss": lm, **({"load_balancing_loss": aux} if aux is not None else {}),
              **{f"mtp_{k} loss": values for k, values in enumerate(mtp, start=1)}}
    lines, window = [], []
    for i in range(n):
        step = first_step + i
        window.append(i)
        first = i == 0 and print_first
        if not (first or step % log_interval == 0):
            continue
        losses = {key: sum(values[j] for j in window) / len(window) for key, values in series.items()}
        lines.append(megatron_line(step, train_iters, consumed_samples=step * global_batch_size,
                                   elapsed_ms=1000.0 + i % 7, learning_rate=_next_lr(lr_applied, i),
                                   global_batch_size=global_batch_size, losses=losses, grad_norm=grad_norm[i],
                                   core_version=core_version, timestamp=_START + timedelta(seconds=i)))
        if not first or reset_first:
            window = []
    return lines


def mindformers_lines(lm: Sequence[float], *, mtp: Sequence[Sequence[float]] = (), aux: Sequence[float] | None = None,
                      lr_applied: Sequence[float] | None = None, mode: str = "pynative", first_step: int = 1,
                      max_steps: int | None = None, mtp_loss_scaling_factor: float = 1.0,
                      global_batch_size: int = 8, grad_norm: Sequence[float] | None = None) -> list[str]:
    """MindFormers step lines with the stdout logger prefix, pynative or graph mode."""
    n = len(lm)
    lr_applied = lr_applied if lr_applied is not None else [1e-5] * n
    grad_norm = grad_norm if grad_norm is not None else _grad_norms(n)
    max_steps = max_steps or first_step + n - 1
    lines = []
    for i in range(n):
        step = first_step + i
        stamp = _START + timedelta(seconds=i)
        mtp_values = tuple(values[i] for values in mtp)
        aux_value = aux[i] if aux is not None else None
        if mode == "pynative":
            message = pynative_line(step, max_steps, consumed_samples=step * global_batch_size,
                                    global_batch_size=global_batch_size, loss=lm[i], per_step_time_ms=1500 + i % 7,
                                    lr=_next_lr(lr_applied, i), grad_norm=grad_norm[i],
                                    load_balancing_loss=aux_value, mtp_losses=mtp_values, throughput=0.65)
            lines.append(mindformers_prefix(MINDFORMERS_PYNATIVE_SOURCE, stamp) + message)
            continue
        scaled_mtp = mtp_loss_scaling_factor * sum(mtp_values) / len(mtp_values) if mtp_values else None
        separate = bool(mtp_values) or aux_value is not None
        total = lm[i] + (scaled_mtp or 0.0) + (aux_value or 0.0) * 0.001
        line, progress = graph_lines(1, 1, step, max_steps, loss=total, per_step_time_ms=1500 + i % 7,
                                     lr=lr_applied[i], global_norm=grad_norm[i],
                                     lm_loss=lm[i] if separate else None, load_balancing_loss=aux_value,
                                     mtp_loss=scaled_mtp)
        lines.append(mindformers_prefix(MINDFORMERS_GRAPH_SOURCE, stamp) + line)
        lines.append(mindformers_prefix(MINDFORMERS_GRAPH_PROGRESS_SOURCE, stamp) + progress)
    return lines


def write_log(path: Path, lines: Sequence[str]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
