"""The embedded Megatron side (DAG step 4): megatron-core itself trains on CPU, as ``pretrain_gpt.py`` would.

The model is megatron-core's ``GPTModel`` built by the GPU launcher's layer-spec builder
(``mcore_model``), loaded strictly from the converted checkpoint. Training is megatron-core's:
its ``DistributedDataParallel`` with a grad buffer, ``get_megatron_optimizer`` (Adam with
decoupled weight decay, no decay on 1-D parameters and biases, global-norm clipping),
``OptimizerParamScheduler`` stepped by the global batch size as Megatron's training loop
steps it (so warmup counts samples), and the no-pipelining forward-backward schedule with
``pretrain_gpt.py``'s loss function (token-weighted lm loss, the MTP and aux losses entering
the gradient through megatron-core's own auto-scalers). Every number in the log comes from
megatron-core: the lm loss from the loss function's reporting pair, ``load_balancing_loss``
from ``track_moe_metrics``, ``mtp_k loss`` from ``MTPLossLoggingHelper.track_mtp_metrics``,
the grad norm from the optimizer step, the learning rate from the optimizer after the
scheduler's step. :class:`MegatronLogLines` prints them as ``training_log`` does for the
configured core version, the iteration-2 mean included.

It all runs inside :func:`megatron_core_on_cpu` (the CPU workarounds), entered only here, in
the step's training process.
"""

from __future__ import annotations

import contextlib
import time
from functools import partial
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch

from crossalign.backends.base import TrainRequest, TrainResult
from crossalign.backends.local.mcore_model import IMPLEMENTATION
from crossalign.config import AlignmentConfig
from crossalign.backends.local.torch_trainer import (IterationStats, MegatronLogLines, TrainingError, _datetime_line,
                                                     _step_metrics, deterministic_training_threads, emit_setup_done,
                                                     megatron_log, megatron_lr)


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """pretrain_gpt.py's loss_func (core 0.16): summed masked loss, its token count, and the reporting pair."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def _forward_step(data_iterator, model):
    """pretrain_gpt.py's forward_step: one micro batch through GPTModel with labels and loss mask."""
    from crossalign.backends.local.mcore_model import positions_and_mask

    tokens = next(data_iterator)
    input_ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    loss_mask = torch.ones(labels.shape, dtype=torch.float32)
    with torch._C.DisableTorchFunction():  # the model needs no CudaLiteralsToCpu: spare it the per-op cost
        output = model(input_ids, *positions_and_mask(input_ids), labels=labels, loss_mask=loss_mask)
    return output, partial(_loss_func, loss_mask)


def _build(request: TrainRequest, state: Mapping[str, torch.Tensor]):
    """DDP-wrapped GPTModel with the checkpoint loaded, megatron-core's optimizer and its param scheduler."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import Float16Module

    from crossalign.backends.local.mcore_cpu import CpuTensorTypesAsCuda, CudaLiteralsToCpu
    from crossalign.backends.local.mcore_model import build_gpt_model, load_converted_state

    config, training = request.config, request.config.training
    if training.lr_warmup_iters >= request.iterations:
        raise ValueError(f"training.lr_warmup_iters {training.lr_warmup_iters} must be below training.train_iters "
                         f"{request.iterations}: Megatron's OptimizerParamScheduler asserts lr_warmup_steps < "
                         "lr_decay_steps, and --lr-decay-iters defaults to --train-iters")
    bf16 = training.embedded_precision == "bf16"
    net = build_gpt_model(config.model, training, bf16=bf16)
    load_converted_state(net, state, config.model, training.megatron_core_version)
    verify_loaded(net, state, request)
    # --bf16: get_model wraps the model in Float16Module (every parameter bf16, the forward in bf16) and
    # get_megatron_optimizer keeps fp32 main copies of them (Float16OptimizerWithFloat16Params)
    module = Float16Module(net.config, net) if bf16 else net
    ddp = DistributedDataParallel(config=net.config, module=module,
                                  ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    # the optimizers keep their loss scale on 'cuda'; the bf16 one accepts only CUDA tensor type names
    with CudaLiteralsToCpu(), CpuTensorTypesAsCuda() if bf16 else contextlib.nullcontext():
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=training.lr, min_lr=training.min_lr, weight_decay=training.weight_decay,
            adam_beta1=training.adam_beta1, adam_beta2=training.adam_beta2, adam_eps=training.adam_eps,
            clip_grad=training.clip_grad, bf16=bf16, fp16=False,
            params_dtype=torch.bfloat16 if bf16 else torch.float32), [ddp])
    samples = request.iterations * training.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=training.lr_warmup_init, max_lr=training.lr, min_lr=training.min_lr,
        lr_warmup_steps=training.lr_warmup_iters * training.global_batch_size, lr_decay_steps=samples,
        lr_decay_style=training.lr_decay_style, start_wd=training.weight_decay, end_wd=training.weight_decay,
        wd_incr_steps=samples, wd_incr_style="constant")
    # what megatron.training's setup_model_and_optimizer hands the schedule
    net.config.grad_scale_func = optimizer.scale_loss
    net.config.no_sync_func = ddp.no_sync
    net.config.finalize_model_grads_func = finalize_model_grads
    return ddp, optimizer, scheduler


def verify_loaded(net, state: Mapping[str, torch.Tensor], request: TrainRequest) -> None:
    """Hold what the model holds after loading against the checkpoint, tensor by tensor (the load digest).

    The model holds megatron-core's local names (mapped back to the checkpoint's TE names) in its
    own dtype (under bf16 the checkpoint's tensors are compared rounded to bf16).
    """
    from crossalign.checkpoint.digest import compare_loaded, split_stacked_experts, torch_digests
    from crossalign.checkpoint.te_local import local_to_te_names

    config = request.config
    names = local_to_te_names(config.model, config.training.megatron_core_version)
    compare_loaded(torch_digests(net.state_dict()), split_stacked_experts(state, config.model.num_experts),
                   what=f"megatron-core GPTModel vs the checkpoint {request.init_checkpoint}",
                   rename=lambda name: names.get(name, name))


def _train_step(ddp, optimizer, scheduler, tokens: np.ndarray, iteration: int, request: TrainRequest) -> IterationStats:
    """Megatron's train_step and the loss bookkeeping of training_log for one iteration."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, track_moe_metrics
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from crossalign.backends.local.mcore_cpu import CudaLiteralsToCpu

    model, training = request.config.model, request.config.training
    tokens = torch.as_tensor(np.asarray(tokens), dtype=torch.int64)
    expected = (training.global_batch_size, training.seq_length + 1)
    if tuple(tokens.shape) != expected:
        raise ValueError(f"global batch {iteration}: tokens of shape {tuple(tokens.shape)}, expected {expected}")
    num_micro = training.global_batch_size // training.micro_batch_size
    micro_batches = iter(tokens.split(training.micro_batch_size))

    # the schedule counts tokens, and the optimizer reduces the grad norm, in tensors made on 'cuda'
    with CudaLiteralsToCpu():
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        reports = get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=micro_batches, model=[ddp], num_microbatches=num_micro,
            seq_length=training.seq_length, micro_batch_size=training.micro_batch_size, forward_only=False)
        succeeded, grad_norm, _ = optimizer.step()
    if not succeeded or grad_norm is None or not np.isfinite(grad_norm):
        raise TrainingError(f"iteration {iteration}: the optimizer step failed (grad norm {grad_norm})")
    scheduler.step(increment=training.global_batch_size)

    pair = torch.stack([report["lm loss"] for report in reports]).sum(dim=0)
    lm_loss = float(pair[0] / pair[1])
    if not np.isfinite(lm_loss):
        raise TrainingError(f"iteration {iteration}: non-finite lm loss {lm_loss}")
    losses: dict[str, torch.Tensor] = {}
    if model.is_moe and model.moe_aux_loss_coeff > 0:
        track_moe_metrics(loss_scale=1 / num_micro, iteration=iteration, total_loss_dict=losses,
                          track_names=["load_balancing_loss"], num_layers=model.num_layers, moe_layer_freq=1,
                          mtp_num_layers=model.mtp_num_layers or None)
        clear_aux_losses_tracker()
    if model.mtp_num_layers:
        MTPLossLoggingHelper.track_mtp_metrics(loss_scale=1 / num_micro, iteration=iteration, writer=None,
                                               total_loss_dict=losses)
    logged = {"lm loss": lm_loss, **{name: float(value) for name, value in losses.items()}}
    return IterationStats(losses=logged, learning_rate=optimizer.param_groups[0]["lr"], grad_norm=float(grad_norm))


def run_training(request: TrainRequest, state: Mapping[str, torch.Tensor], checkpoint_iteration: int,
                 batches: Sequence[np.ndarray]) -> TrainResult:
    """Train ``request.iterations`` steps from the Megatron ``state`` on ``batches`` (item i: the int64
    tokens [global_batch_size, seq_length + 1] of global batch i) and write the Megatron log."""
    from crossalign.backends.local.mcore_cpu import megatron_core_on_cpu

    training, total = request.config.training, request.iterations
    if len(batches) < total:
        raise ValueError(f"{request.data.prefix}: {len(batches)} global batches for {total} iterations")
    request.output_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with (deterministic_training_threads(), megatron_log(request.log_path, training.seed) as emit,
          megatron_core_on_cpu(training.seed)):
        emit(f"building GPT model ... ({IMPLEMENTATION}, local modules on CPU)")
        emit(f" loading checkpoint from {request.init_checkpoint} at iteration {checkpoint_iteration}")
        ddp, optimizer, scheduler = _build(request, state)
        emit(" > number of parameters on (tensor, pipeline) model parallel rank (0, 0): "
             f"{sum(p.numel() for p in ddp.module.parameters())}")
        emit(f"  successfully loaded checkpoint from {request.init_checkpoint} [ t 1/1, p 1/1 ] at iteration 0")
        emit_setup_done(emit, total * training.global_batch_size)
        lines = MegatronLogLines(total, training.global_batch_size, training.megatron_core_version)
        ddp.train()
        for iteration in range(1, total + 1):
            stats = _train_step(ddp, optimizer, scheduler, batches[iteration - 1], iteration, request)
            emit(lines.line(iteration, stats))
            if request.on_step is not None:
                request.on_step(iteration, total, _step_metrics(stats, megatron_lr(training, iteration)))
        emit(_datetime_line("after training is done"))
        if request.save:
            save_checkpoint(ddp.module, request, total)
            emit(f"  successfully saved checkpoint from iteration {total:7d} to {request.checkpoint_dir} "
                 "[ t 1/1, p 1/1 ]")
    return TrainResult(log_path=request.log_path, checkpoint_dir=request.checkpoint_dir if request.save else None,
                       iterations=total, seconds=time.perf_counter() - started)


def save_checkpoint(net, request: TrainRequest, iteration: int) -> Path:
    """The trained weights in Megatron's legacy torch format under the TE names (what a GPU run would write and
    load: ``iter_{N:07d}/mp_rank_00/model_optim_rng.pt`` and the tracker), without optimizer or RNG state."""
    from crossalign.checkpoint.megatron import write_megatron_checkpoint
    from crossalign.checkpoint.te_local import local_to_te

    config = request.config
    local = {key: value.detach().clone() for key, value in net.state_dict().items()
             if not key.endswith("._extra_state")}
    return write_megatron_checkpoint(request.checkpoint_dir, iteration,
                                     local_to_te(local, config.model, config.training.megatron_core_version))


class LocalMegatronBackend:
    """The embedded CPU stand-in for Megatron-LM (DAG step 4), on megatron-core itself: align mode only."""

    name = "local-megatron"

    def implementation(self, config: AlignmentConfig) -> str:
        """What trains, and in which precision: recorded in the step's manifest and named in the report."""
        from importlib.metadata import version

        precision = "bf16 on fp32 main weights" if config.training.embedded_precision == "bf16" else "fp32"
        return (f"{IMPLEMENTATION} {version('megatron-core')} "
                f"(GPTModel, DDP, optimizer and scheduler on CPU, {precision})")

    def train(self, request: TrainRequest) -> TrainResult:
        if request.mode != "align":
            raise ValueError(f"{self.name}: mode {request.mode!r} is not supported; Megatron only runs the "
                             "alignment step (mode 'align')")
        if request.init_checkpoint is None:
            raise ValueError(f"{self.name}: align mode needs init_checkpoint (a Megatron checkpoint directory)")
        from importlib.metadata import version

        from crossalign.checkpoint.layout import core_version_tuple
        from crossalign.checkpoint.megatron import read_megatron_checkpoint
        from crossalign.data.order import batches_for

        wanted, installed = request.config.training.megatron_core_version, version("megatron-core")
        if core_version_tuple(wanted) != core_version_tuple(installed):
            raise ValueError(f"{self.name}: training.megatron_core_version is {wanted}, but the embedded GPU side is "
                             f"the installed megatron-core {installed} (its MTP key prefix and log semantics would "
                             "not be the configured ones)")
        checkpoint = read_megatron_checkpoint(Path(request.init_checkpoint), request.config.model)
        batches = batches_for("megatron", request.config.training, request.data.prefix,
                              num_samples=request.iterations * request.config.training.global_batch_size)
        return run_training(request, checkpoint.state, checkpoint.iteration, batches)
