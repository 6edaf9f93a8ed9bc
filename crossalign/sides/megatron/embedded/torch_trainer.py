"""Our PyTorch Qwen3.5 trained on CPU with Megatron's semantics, logging like Megatron's ``training_log``.

This is the independent reference for the embedded GPU side, which trains megatron-core itself
(``embedded/trainer.py``, which also prints its log with :class:`MegatronLogLines`): the tests and
``benchmarks/embedded.py`` hold the two against each other. It is not a backend of the DAG.

It reproduces what changes the numbers in a real ``--finetune --no-load-optim`` Megatron run
(SPEC section 6): strict loading of the converted checkpoint, AdamW with bias correction and no
weight decay on 1-D parameters, global grad-norm clipping, the sample-counted warmup (iteration k
trains with init + (max - init) * (k - 1) / W; the logged lr is the next iteration's), the MTP and
MoE aux losses entering the gradient with their scales, and gradient accumulation over micro
batches. The log reproduces Megatron's lines (SPEC section 7), including core >= 0.16's
first-iteration quirk: the accumulators are not reset after the first iteration of a process, so
with log interval 1 the second line holds the mean of iterations 1 and 2.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from crossalign.sides.protocol import TrainRequest, TrainResult
from crossalign.config import MegatronParallel, TrainingConfig
from crossalign.sides.megatron.log_lines import megatron_prints_loss, megatron_resets_after_first_line
from crossalign.sides.megatron.args_reader import megatron_lr as scheduled_lr


# The embedded trainers run side by side (DAG steps 4 and 5) on small shared CPU machines, where
# several OpenMP threads per process stall each other (measured: a tiny step 0.2 s of CPU with one
# thread, 2.5-4.5 s with two under contention). One thread also makes the numbers independent of
# the machine's core count.
TRAINING_THREADS = 1


class TrainingError(RuntimeError):
    """A training run that cannot go on (e.g. a non-finite loss), naming the iteration."""


def megatron_lr(training: TrainingConfig, iteration: int) -> float:
    """The lr applied by the optimizer step of ``iteration`` (1-based), as Megatron's scheduler gives it
    (``args_reader.megatron_lr``: warmup counts samples and the scheduler steps after each update)."""
    lr = scheduled_lr(iteration, lr=training.lr, min_lr=training.min_lr, init=training.lr_warmup_init,
                      warmup=training.lr_warmup_iters, decay_iters=training.train_iters, style=training.lr_decay_style)
    assert lr is not None, training.lr_decay_style  # the config allows only the styles the scheduler reads
    return lr


@dataclass
class IterationStats:
    """What one iteration reports to ``training_log`` (losses as Megatron accumulates them)."""

    losses: dict[str, float]  # in print order: "lm loss", "load_balancing_loss", "mtp_1 loss", ...
    learning_rate: float  # the next iteration's lr, as Megatron prints it
    grad_norm: float


@dataclass
class MegatronLogLines:
    """Megatron's ``training_log`` for log interval 1: sums since the last reset, divided by iterations."""

    train_iters: int
    global_batch_size: int
    core_version: str
    sums: dict[str, float] = field(default_factory=dict)
    iterations_since_reset: int = 0
    interval_start: float = field(default_factory=time.perf_counter)

    def line(self, iteration: int, stats: IterationStats) -> str:
        for key, value in stats.losses.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
        self.iterations_since_reset += 1
        count = self.iterations_since_reset
        elapsed_ms = (time.perf_counter() - self.interval_start) * 1000.0 / count

        text = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]"
        text += f" iteration {iteration:8d}/{self.train_iters:8d} |"
        text += f" consumed samples: {iteration * self.global_batch_size:12d} |"
        text += f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
        text += f" learning rate: {stats.learning_rate:.6E} |"
        text += f" global batch size: {self.global_batch_size:5d} |"
        for key, total in self.sums.items():
            average = total / count
            if megatron_prints_loss(average, self.core_version):
                text += f" {key}: {average:.6E} |"
        text += " loss scale: 1.0 |"
        text += f" grad norm: {stats.grad_norm:.3f} |"
        text += f" number of skipped iterations: {0:3d} |"
        text += f" number of nan iterations: {0:3d} |"

        first_of_process = iteration == 1
        if not first_of_process or megatron_resets_after_first_line(self.core_version, iteration, log_interval=1):
            self.sums = {key: 0.0 for key in self.sums}
            self.iterations_since_reset = 0
            self.interval_start = time.perf_counter()
        return text


def _datetime_line(what: str) -> str:
    return f"[{what}] datetime: {time.strftime('%Y-%m-%d %H:%M:%S')} "


@contextmanager
def deterministic_training_threads() -> Iterator[None]:
    """What a training step runs under: ``TRAINING_THREADS`` threads and deterministic algorithms (as
    Megatron's --deterministic-mode sets them, megatron/training/arguments.py:1081, core_v0.16.1),
    the process's own settings restored afterwards."""
    threads, was_deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(TRAINING_THREADS)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(was_deterministic)


@contextmanager
def megatron_log(path: Path, seed: int,
                 layout: MegatronParallel = MegatronParallel()) -> Iterator[Callable[[str], None]]:
    """The Megatron log file, opened with the lines a run in ``layout`` (one rank by default) prints first;
    yields ``emit(line)``."""
    with path.open("w", encoding="utf-8") as log:
        def emit(text: str) -> None:
            log.write(text + "\n")
            log.flush()

        emit(f"using world size: {layout.world_size}, data-parallel size: {layout.data_parallel}, context-parallel "
             f"size: {layout.context}, hierarchical context-parallel sizes: None, tensor-model-parallel size: "
             f"{layout.tensor}, pipeline-model-parallel size: {layout.pipeline}")
        emit(f"> setting random seeds to {seed} ...")
        yield emit


def emit_setup_done(emit: Callable[[str], None], train_samples: int) -> None:
    """The lines Megatron prints between building the optimizer and the first iteration."""
    emit(_datetime_line("after model, optimizer, and learning rate scheduler are built"))
    emit("> building train, validation, and test datasets ...")
    emit(" > datasets target sizes (minimum size):")
    emit(f"    train:      {train_samples}")
    emit("    validation: 0")
    emit("    test:       0")
    emit("> finished creating GPT datasets ...")
    emit(_datetime_line("after dataloaders are built"))
    emit("done with setup ...")
    emit("training ...")
    emit(_datetime_line("before the start of training step"))


def _optimizer(net: torch.nn.Module, training: TrainingConfig) -> torch.optim.AdamW:
    """AdamW with bias correction; Megatron's wd_mult is 0 for every 1-D parameter and every bias."""
    decay, no_decay = [], []
    for name, param in net.named_parameters():
        (no_decay if param.dim() == 1 or name.endswith(".bias") else decay).append(param)
    groups = [{"params": decay, "weight_decay": training.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=megatron_lr(training, 1), betas=(training.adam_beta1, training.adam_beta2),
                             eps=training.adam_eps, foreach=False)


def run_training(request: TrainRequest, state: Mapping[str, torch.Tensor], checkpoint_iteration: int,
                 batches: Sequence[np.ndarray]) -> TrainResult:
    """Train ``request.iterations`` steps from the Megatron ``state`` on ``batches`` (item i: the int64
    tokens [global_batch_size, seq_length + 1] of global batch i) and write the Megatron log."""
    from crossalign.models.torch_model import Qwen35Model, load_megatron_state

    config, training = request.config, request.config.training
    model_config = config.model
    total = request.iterations
    if len(batches) < total:
        raise ValueError(f"{request.data.prefix}: {len(batches)} global batches for {total} iterations")
    micro, num_micro = training.micro_batch_size, training.global_batch_size // training.micro_batch_size
    mtp_scale = model_config.mtp_loss_scaling_factor / model_config.mtp_num_layers if model_config.mtp_num_layers else 0.0
    logs_aux = model_config.is_moe and model_config.moe_aux_loss_coeff > 0
    moe_layer_count = model_config.num_layers + model_config.mtp_num_layers

    request.output_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with deterministic_training_threads(), megatron_log(request.log_path, training.seed) as emit:
        torch.manual_seed(training.seed)
        emit("building GPT model ...")
        net = Qwen35Model(model_config, training.megatron_core_version)
        emit(" > number of parameters on (tensor, pipeline) model parallel rank (0, 0): "
             f"{sum(p.numel() for p in net.parameters())}")
        load_dir = request.init_checkpoint
        emit(f" loading checkpoint from {load_dir} at iteration {checkpoint_iteration}")
        load_megatron_state(net, state)
        emit(f"  successfully loaded checkpoint from {load_dir} [ t 1/1, p 1/1 ] at iteration 0")
        optimizer = _optimizer(net, training)
        emit_setup_done(emit, total * training.global_batch_size)

        lines = MegatronLogLines(total, training.global_batch_size, training.megatron_core_version)
        net.train()
        for iteration in range(1, total + 1):
            stats = _train_step(net, optimizer, batches[iteration - 1], iteration, training,
                                micro, num_micro, mtp_scale, logs_aux, moe_layer_count)
            emit(lines.line(iteration, stats))
            if request.on_step is not None:
                request.on_step(iteration, total, _step_metrics(stats, megatron_lr(training, iteration)))
        emit(_datetime_line("after training is done"))
    return TrainResult(log_path=request.log_path, checkpoint_dir=None, iterations=total,
                       seconds=time.perf_counter() - started)


def _train_step(net, optimizer, tokens: np.ndarray, iteration: int, training: TrainingConfig, micro: int,
                num_micro: int, mtp_scale: float, logs_aux: bool, moe_layer_count: int) -> IterationStats:
    """One optimizer step over ``num_micro`` micro batches; returns the per-iteration values Megatron logs."""
    tokens = torch.as_tensor(np.asarray(tokens), dtype=torch.int64)
    expected = (training.global_batch_size, training.seq_length + 1)
    if tuple(tokens.shape) != expected:
        raise ValueError(f"global batch {iteration}: tokens of shape {tuple(tokens.shape)}, expected {expected}")
    lr = megatron_lr(training, iteration)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)

    lm_sum, lm_tokens, mtp_sums, aux_sum = 0.0, 0.0, None, 0.0
    for start in range(0, training.global_batch_size, micro):
        sample = tokens[start:start + micro]
        input_ids, labels = sample[:, :-1], sample[:, 1:]
        loss_mask = torch.ones(labels.shape, dtype=torch.float32)
        _, lm_loss, mtp_losses, aux_loss = net(input_ids, labels, loss_mask)
        objective = lm_loss + mtp_scale * mtp_losses.sum() + aux_loss
        if not torch.isfinite(objective):
            raise TrainingError(f"iteration {iteration}: non-finite loss (lm {lm_loss.item()}, "
                                f"mtp {mtp_losses.tolist()}, aux {aux_loss.item()})")
        (objective / num_micro).backward()

        num_tokens = loss_mask.sum().item()
        lm_sum += lm_loss.item() * num_tokens
        lm_tokens += num_tokens
        values = mtp_losses.detach().double()
        mtp_sums = values if mtp_sums is None else mtp_sums + values
        aux_sum += aux_loss.item()

    grad_norm = torch.nn.utils.clip_grad_norm_(net.parameters(), training.clip_grad, foreach=False).item()
    if not np.isfinite(grad_norm):
        raise TrainingError(f"iteration {iteration}: non-finite grad norm {grad_norm}")
    optimizer.step()

    losses = {"lm loss": lm_sum / lm_tokens}
    if logs_aux:
        # Megatron's tracker holds aux / coeff per MoE layer (MTP layers included), averaged over layers
        losses["load_balancing_loss"] = aux_sum / num_micro / net.config.moe_aux_loss_coeff / moe_layer_count
    for index, value in enumerate((mtp_sums / num_micro).tolist() if mtp_sums is not None else []):
        losses[f"mtp_{index + 1} loss"] = value
    return IterationStats(losses=losses, learning_rate=megatron_lr(training, iteration + 1), grad_norm=grad_norm)


def _step_metrics(stats: IterationStats, applied_lr: float) -> dict[str, float]:
    """This iteration's own values (not the log's running means) for progress reporting."""
    metrics = {"lm_loss": stats.losses["lm loss"], "lr": applied_lr, "grad_norm": stats.grad_norm}
    if "load_balancing_loss" in stats.losses:
        metrics["aux_loss"] = stats.losses["load_balancing_loss"]
    for key, value in stats.losses.items():
        if key.startswith("mtp_"):
            metrics[key.replace(" ", "_")] = value
    return metrics
