"""The embedded MindFormers stand-in: trains the MindSpore Qwen3.5 on CPU and logs like MindFormers pynative.

What it reproduces of MindFormers' pynative trainer (SPEC sections 6 and 7):

* the sample order of the generated YAML (``yaml.sample_order``);
* objective = lm_loss + mtp_loss_scaling_factor / mtp_num_layers * sum(mtp_losses) + aux_loss,
  averaged over the micro batches of a global batch (gradient accumulation);
* AdamW with bias correction, decoupled weight decay, none on 1-D parameters; global gradient
  norm clipping (the logged grad_norm is the norm before clipping);
* ConstantWarmUpLR: step k applies init + (max - init) * (k - 1) / W while k - 1 < W, then max;
  the log line of step k shows the lr of step k + 1, as the pynative LossCallback does;
* one ``LossCallback`` line per step with the logger prefix, as the release named by
  ``training.mindformers_version`` prints it (:func:`loss_callback_format`): ``loss`` is the lm loss only,
  ``load_balancing_loss`` the mean unscaled aux loss per MoE layer, ``mtp_1_loss`` unscaled from 2.1.0 and
  multiplied by mtp_loss_scaling_factor / mtp_num_layers in 2.0.0 (which also prints no ``consumed_samples``
  or ``global_batch_size``);
* a checkpoint 2.0 save as its CheckpointCallback writes it (mindformers 2.1.0): fp32 weights with each
  MoE layer's ``mlp.tokens_per_expert`` buffer (tokens routed to each expert, counted in every forward
  pass), the optimizer file with ``adam_m.*``, ``adam_v.*`` and an int64 ``global_step`` (the lr comes
  from the schedule, so no ``learning_rate``), and common.json whose ``step_num`` is the run's total steps.

With a dump asked (``TrainRequest.dump``), each step runs under msprobe's MindSpore PrecisionDebugger
(:class:`IterationDump`), as the ``mindformers-msprobe-dump`` patch runs a real MindFormers step.

The optimizer runs in numpy fp32: MindSpore's CPU AdamW (``mint.optim.AdamW``) has no kernel and
``nn.AdamWeightDecay`` has no bias correction, and per-parameter PyNative ops would cost more
than the model itself.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from crossalign.sides.protocol import TrainRequest, TrainResult
from crossalign.config import AlignmentConfig, TrainingConfig
from crossalign.dump_settings import write_rank_record
from crossalign.sides.mindformers.yaml import sample_order

LOGGER_SOURCE = "mindformers/pynative/callback/loss_callback.py:337"  # 2.1.0's logger.info of the line
CLIP_EPSILON = 1e-6


@dataclass(frozen=True)
class LossCallbackFormat:
    """How one MindFormers release's pynative ``LossCallback`` prints its line."""

    source: str            # the logger.info call named in the prefix
    prints_samples: bool   # consumed_samples and global_batch_size after the step
    scales_mtp: bool       # mtp_<i>_loss multiplied by mtp_loss_scaling_factor / mtp_num_layers


def loss_callback_format(version: str) -> LossCallbackFormat:
    """The line of MindFormers ``version`` (``training.mindformers_version``), from the released wheels:

    * 2.0.0: ``pynative/callback/loss_callback.py:276-310`` prints ``step``, ``loss``, ``per_step_time``, ...
      and the MTP tracker holds ``mtp_loss_scale * mtp_loss_sum / num_tokens``
      (``pynative/transformers/multi_token_prediction.py:644-649``, mtp_loss_scale =
      mtp_loss_scaling_factor / mtp_num_layers);
    * 2.1.0: ``loss_callback.py:301-337`` adds ``consumed_samples`` and ``global_batch_size``, and the tracker
      holds the plain ``mtp_loss_sum / num_tokens`` (``multi_token_prediction.py:682-687``).
    """
    from crossalign.sides.mindformers.log_lines import mindformers_scales_mtp_loss

    try:
        scales_mtp = mindformers_scales_mtp_loss(version)
    except ValueError as exc:
        raise TrainingSetupError(f"training.mindformers_version: {exc}") from None
    if scales_mtp:
        return LossCallbackFormat("mindformers/pynative/callback/loss_callback.py:310", prints_samples=False,
                                  scales_mtp=True)
    return LossCallbackFormat(LOGGER_SOURCE, prints_samples=True, scales_mtp=False)


class TrainingSetupError(ValueError):
    """A request the MindSpore trainer cannot run (missing checkpoint, wrong mode, bad batches)."""


def warmup_lr(training: TrainingConfig, step: int) -> float:
    """The lr ConstantWarmUpLR gives optimizer step ``step`` (1-based)."""
    warmup = training.lr_warmup_iters
    done = step - 1
    if done < warmup:
        return training.lr_warmup_init + (training.lr - training.lr_warmup_init) * done / warmup
    return training.lr


class AdamW:
    """torch-style AdamW (bias-corrected moments, decoupled weight decay) over named fp32 arrays."""

    def __init__(self, params: dict[str, np.ndarray], training: TrainingConfig):
        self.beta1 = np.float32(training.adam_beta1)
        self.beta2 = np.float32(training.adam_beta2)
        self.eps = np.float32(training.adam_eps)
        self.weight_decay = np.float32(training.weight_decay)
        self.step_count = 0
        self.exp_avg = {name: np.zeros_like(p) for name, p in params.items()}
        self.exp_avg_sq = {name: np.zeros_like(p) for name, p in params.items()}
        # Norm weights, A_log and dt_bias (every 1-D parameter; the model has no biases) are not decayed.
        self.decayed = {name for name, p in params.items() if p.ndim > 1}

    def step(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray], lr: float) -> None:
        """Update ``params`` in place."""
        self.step_count += 1
        lr = np.float32(lr)
        correction1 = np.float32(1.0 - float(self.beta1) ** self.step_count)
        correction2 = np.float32(1.0 - float(self.beta2) ** self.step_count)
        for name, param in params.items():
            grad = grads[name]
            m, v = self.exp_avg[name], self.exp_avg_sq[name]
            m *= self.beta1
            m += (1 - self.beta1) * grad
            v *= self.beta2
            v += (1 - self.beta2) * grad * grad
            if name in self.decayed:
                param *= 1 - lr * self.weight_decay
            param -= lr * (m / correction1) / (np.sqrt(v / correction2) + self.eps)

    def state(self) -> dict[str, np.ndarray]:
        """The moments under MindFormers' optimizer names (adam_m.<param>, adam_v.<param>)."""
        out = {f"adam_m.{name}": m for name, m in self.exp_avg.items()}
        out.update({f"adam_v.{name}": v for name, v in self.exp_avg_sq.items()})
        return out


def clip_by_global_norm(grads: dict[str, np.ndarray], max_norm: float) -> float:
    """Scale ``grads`` in place so their global L2 norm is at most ``max_norm``; return the norm before."""
    norm = math.sqrt(sum(float(np.dot(g.ravel().astype(np.float64), g.ravel().astype(np.float64)))
                         for g in grads.values()))
    coeff = max_norm / (norm + CLIP_EPSILON)
    if coeff < 1.0:
        for g in grads.values():
            g *= np.float32(coeff)
    return norm


def loss_callback_line(*, step: int, total: int, consumed_samples: int, global_batch_size: int, loss: float,
                       step_time_ms: int, load_balancing_loss: float | None, mtp_losses: Sequence[float],
                       lr: float, grad_norm: float, prints_samples: bool = True) -> str:
    """The message of MindFormers' pynative LossCallback (without the logger prefix); ``mtp_losses`` as printed.
    ``prints_samples``: 2.1.0's consumed_samples and global_batch_size (2.0.0 prints neither)."""
    parts = [f"step:[{step:5d}/{total:5d}]"]
    if prints_samples:
        parts += [f"consumed_samples: {consumed_samples}", f"global_batch_size: {global_batch_size}"]
    parts += [f"loss: {loss:10.6f}", f"per_step_time: {step_time_ms:6d}ms"]
    if load_balancing_loss is not None:
        parts.append(f"load_balancing_loss: {load_balancing_loss:10.6f}")
    parts.extend(f"mtp_{i + 1}_loss: {value:10.6f}" for i, value in enumerate(mtp_losses))
    parts.append(f"lr: {lr:10.6e}")
    parts.append("grad_norm: NaN" if math.isnan(grad_norm) else f"grad_norm: {grad_norm:10.6f}")
    return "{ " + ", ".join(parts) + " }"


def logger_prefix(log_dir: Path, now: datetime | None = None, source: str = LOGGER_SOURCE) -> str:
    """``<asctime> - mindformers<real path of the log dir>[<source>] - INFO - ``, as MindFormers' stdout handler."""
    now = now or datetime.now()
    asctime = now.strftime("%Y-%m-%d %H:%M:%S") + f",{now.microsecond // 1000:03d}"
    return f"{asctime} - mindformers{os.path.realpath(log_dir)}[{source}] - INFO - "


class _Trainer:
    """One training run: the net, its optimizer and the step loop."""

    def __init__(self, config: AlignmentConfig, state: dict):
        import mindspore as ms

        from crossalign.models.ms_model import Qwen35Model, load_mindformers_state

        self.config = config
        self.model = config.model
        self.training = config.training
        self.net = Qwen35Model(self.model, seed=None)
        load_mindformers_state(self.net, state)
        self.params = dict(self.net.parameters_and_names())
        self.names = [p.name for p in self.net.trainable_params()]
        self.values = {name: param.asnumpy().copy() for name, param in self.params.items()}
        _verify_loaded(self.values, state)
        self.optimizer = AdamW(self.values, self.training)
        mtp_layers = self.model.mtp_num_layers
        self.mtp_weight = self.model.mtp_loss_scaling_factor / mtp_layers if mtp_layers else 0.0
        self.moe_layers = (self.model.num_layers + mtp_layers) if self.model.is_moe else 0

        def objective(input_ids, labels, loss_mask):
            _, lm_loss, mtp_losses, aux_loss = self.net(input_ids, labels, loss_mask)
            total = lm_loss + aux_loss
            if mtp_layers:
                total = total + mtp_losses.sum() * self.mtp_weight
            return total, lm_loss, mtp_losses, aux_loss

        self.value_and_grad = ms.value_and_grad(objective, None, self.net.trainable_params(), has_aux=True)
        self.tokens_per_expert = self._count_routed_tokens()

    def _count_routed_tokens(self) -> dict[str, np.ndarray]:
        """MindFormers' ``mlp.tokens_per_expert`` buffers, counted as its MoE layer does in every forward pass.

        A forward hook on each MoE layer routes the layer's input again (the same computation, so
        the same experts) and adds up the tokens sent to each expert.
        """
        from mindspore import ops

        from crossalign.models.ms_model import MoE

        counts: dict[str, np.ndarray] = {}

        def counter(name: str):
            def hook(cell, inputs, outputs):
                tokens = ops.stop_gradient(inputs[0].reshape(-1, inputs[0].shape[-1]))
                counts[name] += cell.route(tokens)[1].sum(axis=0).asnumpy()
            return hook

        for name, cell in self.net.cells_and_names():
            if isinstance(cell, MoE):
                counts[f"{name}.tokens_per_expert"] = np.zeros(self.model.num_experts, np.float32)
                cell.register_forward_hook(counter(f"{name}.tokens_per_expert"))
        return counts

    def step(self, tokens: np.ndarray, lr: float) -> dict[str, object]:
        """One optimizer step on a global batch [gbs, seq+1]; returns the metrics of the log line."""
        from mindspore import Tensor

        micro = self.training.micro_batch_size
        micro_steps = tokens.shape[0] // micro
        grads = {name: np.zeros_like(self.values[name]) for name in self.names}
        lm_total, aux_total = 0.0, 0.0
        mtp_total = np.zeros(self.model.mtp_num_layers)
        for i in range(micro_steps):
            chunk = tokens[i * micro: (i + 1) * micro]
            ids = Tensor(chunk[:, :-1].astype(np.int32))
            labels = Tensor(chunk[:, 1:].astype(np.int32))
            mask = Tensor(np.ones(labels.shape, np.float32))
            (_, lm_loss, mtp_losses, aux_loss), micro_grads = self.value_and_grad(ids, labels, mask)
            for name, grad in zip(self.names, micro_grads):
                grads[name] += grad.asnumpy()
            lm_total += float(lm_loss.asnumpy())
            aux_total += float(aux_loss.asnumpy())
            mtp_total += mtp_losses.asnumpy()
        if micro_steps > 1:  # the objective is the mean over micro batches
            for grad in grads.values():
                grad /= np.float32(micro_steps)
        grad_norm = clip_by_global_norm(grads, self.training.clip_grad)
        self.optimizer.step({name: self.values[name] for name in self.names}, grads, lr)
        for name in self.names:
            self.params[name].set_data(Tensor(self.values[name]))
        return {
            "lm_loss": lm_total / micro_steps,
            "mtp_losses": list(mtp_total / micro_steps),
            "aux_loss": aux_total / micro_steps,
            "grad_norm": grad_norm,
        }

    def load_balancing_loss(self, aux_loss: float) -> float | None:
        """Mean unscaled aux loss per MoE layer (MindFormers' ``load_balancing_loss``); None for dense."""
        if not self.moe_layers or self.model.moe_aux_loss_coeff == 0:
            return None
        return aux_loss / (self.model.moe_aux_loss_coeff * self.moe_layers)


def _verify_loaded(values: dict[str, np.ndarray], state: dict) -> None:
    """Hold what the net holds after loading against the state it was given, tensor by tensor (load digest)."""
    from crossalign.models.ms_model import _as_float32_array
    from crossalign.tensorio.digest import compare_loaded, entry, numpy_sha256

    loaded = {name: entry(value.shape, str(value.dtype), numpy_sha256(value)) for name, value in values.items()}
    compare_loaded(loaded, state, what="the MindSpore Qwen3.5 model vs its checkpoint",
                   hash_in=lambda value, digest: numpy_sha256(_as_float32_array(value).astype(digest["dtype"])),
                   shape_of=lambda value: tuple(value.shape))


class IterationDump:
    """msprobe's MindSpore dump around each training step (PyNative), as a MindFormers run takes it; a no-op
    without a config (``config_path``: the step's msprobe ``config.json``).

    ``debugger.start(net)`` before the step, ``stop()`` and ``step()`` after: msprobe picks the configured step and
    writes ``step{N}/rank0/{dump.json, construct.json, stack.json, dump_tensor_data/}`` (rank 0: this side trains
    in one process, without a communication group, where msprobe would name the folder ``proc{pid}``). On
    MindSpore's CPU backend msprobe's norm statistic has no kernel: ``msprobe_norm_on_cpu`` stands in for it
    (``crossalign/sides/mindformers/dump.py``). msprobe's debugger is one per process (its first config stays).
    Beside msprobe's files, the record of the run (``crossalign_dump.json``, ``dump_settings.write_rank_record``).
    """

    def __init__(self, config_path: Path | None):
        self._debugger = None
        self._config_path = config_path
        if config_path is not None:
            from msprobe.mindspore import PrecisionDebugger  # heavy (hooks MindSpore's APIs): only when dumping

            self._debugger = PrecisionDebugger(config_path=str(config_path))

    @contextmanager
    def iteration(self, net) -> Iterator[None]:
        if self._debugger is None:
            yield
            return
        from crossalign.sides.mindformers.dump import msprobe_norm_on_cpu  # imports msprobe: only when dumping

        with msprobe_norm_on_cpu():
            self._debugger.start(net, rank_id=0)
            try:
                yield
            finally:
                self._debugger.stop()
            self._debugger.step()
        write_rank_record(self._config_path, 0)


def initial_state(request: TrainRequest) -> dict:
    """Random weights for a base run, the weights of ``init_checkpoint`` for an align run."""
    from crossalign.models.layout import random_mindformers_state
    from crossalign.sides.mindformers.checkpoint import read_mindformers_checkpoint

    model = request.config.model
    if request.mode == "base":
        return random_mindformers_state(model, request.config.training.seed)
    if request.mode == "align":
        if request.init_checkpoint is None:
            raise TrainingSetupError("init_checkpoint: an align run needs the MindFormers checkpoint to start from")
        return read_mindformers_checkpoint(Path(request.init_checkpoint)).model_state()
    raise TrainingSetupError(f"mode: {request.mode!r} is not 'base' or 'align'")


def train_on_batches(request: TrainRequest, batches: Sequence[np.ndarray]) -> TrainResult:
    """Train ``request.iterations`` steps on ``batches`` (item i: int64 tokens [gbs, seq+1] of step i+1)."""
    import torch

    from crossalign.sides.mindformers.checkpoint import default_common, write_mindformers_checkpoint

    training = request.config.training
    total = request.iterations
    gbs = training.global_batch_size
    if len(batches) < total:
        raise TrainingSetupError(f"batches: {len(batches)} global batches for {total} steps")
    expected_shape = (gbs, training.seq_length + 1)
    log_format = loss_callback_format(training.mindformers_version)
    started = time.perf_counter()
    trainer = _Trainer(request.config, initial_state(request))
    request.output_dir.mkdir(parents=True, exist_ok=True)
    dump = IterationDump(None if request.dump is None else request.write_dump_config())
    if request.dump is not None and request.dump.level == "mix":  # msprobe wraps every API: no ms.jit graph
        trainer.net.eager_rule()
    log_dir = request.named_output_dir / "log"  # MindFormers names its log folder in every line
    with open(request.log_path, "w") as log:
        for step in range(1, total + 1):
            tokens = np.asarray(batches[step - 1])
            if tokens.shape != expected_shape:
                raise TrainingSetupError(f"batch of step {step}: shape {tokens.shape}, expected {expected_shape}")
            step_start = time.perf_counter()
            with dump.iteration(trainer.net):
                metrics = trainer.step(tokens, warmup_lr(training, step))
            step_time_ms = int((time.perf_counter() - step_start) * 1000)
            logged_lr = warmup_lr(training, step + 1)  # pynative prints the lr of the next step
            balancing = trainer.load_balancing_loss(metrics["aux_loss"])
            # MindFormers prints mtp_i_loss only when mtp_loss_scaling_factor is set (loss_callback.py:202, 2.0.0)
            mtp_losses = metrics["mtp_losses"] if trainer.mtp_weight else []
            mtp_printed = [trainer.mtp_weight * value for value in mtp_losses] if log_format.scales_mtp else mtp_losses
            line = loss_callback_line(step=step, total=total, consumed_samples=step * gbs, global_batch_size=gbs,
                                      loss=metrics["lm_loss"], step_time_ms=step_time_ms,
                                      load_balancing_loss=balancing, mtp_losses=mtp_printed,
                                      lr=logged_lr, grad_norm=metrics["grad_norm"],
                                      prints_samples=log_format.prints_samples)
            log.write(logger_prefix(log_dir, source=log_format.source) + line + "\n")
            log.flush()
            if request.on_step is not None:
                reported = {"lm_loss": metrics["lm_loss"], "lr": logged_lr, "grad_norm": metrics["grad_norm"],
                            "step_time_ms": float(step_time_ms)}
                # the progress channel carries the plain MTP cross entropy, whatever the release prints
                reported.update({f"mtp_{i + 1}_loss": v for i, v in enumerate(mtp_losses)})
                if balancing is not None:
                    reported["aux_loss"] = balancing
                request.on_step(step, total, reported)

    checkpoint_dir = None
    if request.mode == "base" or request.save:
        model_state = {name: torch.from_numpy(value) for name, value in trainer.values.items()}
        model_state.update({name: torch.from_numpy(count) for name, count in trainer.tokens_per_expert.items()})
        optimizer_state = {name: torch.from_numpy(value) for name, value in trainer.optimizer.state().items()}
        optimizer_state["global_step"] = torch.tensor([total], dtype=torch.int64)  # pynative/optimizer/adamw.py:219
        write_mindformers_checkpoint(request.checkpoint_dir, total, model_state, optimizer_state,
                                     default_common(total, gbs, total_steps=total))
        checkpoint_dir = request.checkpoint_dir
    return TrainResult(log_path=request.log_path, checkpoint_dir=checkpoint_dir, iterations=total,
                       seconds=time.perf_counter() - started)


class LocalMindFormersBackend:
    """MindFormers pynative on CPU: our MindSpore Qwen3.5, MindFormers' sample order, logs and checkpoints."""

    name = "local-mindformers"

    def implementation(self, config: AlignmentConfig) -> str:
        """What trains: recorded in the step's manifest and named in the report (MindSpore's CPU kernels have no
        bf16 MatMul, so this side computes in fp32 whatever ``training.embedded_precision`` says)."""
        return "crossalign's MindSpore Qwen3.5 (MindFormers layout, pynative on CPU, fp32)"

    def train(self, request: TrainRequest) -> TrainResult:
        from crossalign.data.order import global_batches

        training = request.config.training
        batches = global_batches(sample_order(training, request.iterations * training.global_batch_size),
                                 request.data.prefix, training.global_batch_size)
        return train_on_batches(request, batches)
