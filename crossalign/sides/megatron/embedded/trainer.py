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

What was loaded is verified before the first step (SPEC item 13, the load digest): one process
against the state it was given (:func:`verify_loaded`); in a sharded run each rank records what it
holds in the GPU launcher's digest file (:func:`write_shard_digest`) and the printing rank holds
every record against that rank's own file of the sharded checkpoint (:func:`_verified_by_the_last_rank`).

With a dump asked (``TrainRequest.dump``), every rank runs each iteration under msprobe's PrecisionDebugger as
the GPU launcher does (``embedded/dump.py``): ``msprobe_dump/step{N}/rank{R}/`` in the step's folder.

It all runs inside :func:`megatron_core_on_cpu` (the CPU workarounds), entered only here, in
the step's training process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import time
from functools import partial
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch

from crossalign.sides.protocol import TrainRequest, TrainResult
from crossalign.sides.megatron.embedded.mcore_model import IMPLEMENTATION
from crossalign.config import AlignmentConfig
from crossalign.versions import version_tuple
from crossalign.sides.megatron.embedded import device as devices
from crossalign.sides.megatron.embedded.torch_trainer import (IterationStats, MegatronLogLines, TrainingError, _datetime_line,
                                                     _step_metrics, deterministic_training_threads, emit_setup_done,
                                                     megatron_log, megatron_lr)
from crossalign.sides.megatron.args import UNFUSED_FOR_MIX, sample_order, swiglu_fusion_under
from crossalign.sides.megatron.embedded.dump import IterationDump
from crossalign.dump_settings import CONFIG_FILE


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """pretrain_gpt.py's loss_func (core 0.16): summed masked loss, its token count, and the reporting pair."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def _forward_step(data_iterator, model):
    """pretrain_gpt.py's forward_step: one micro batch through GPTModel with labels and loss mask."""
    from crossalign.sides.megatron.embedded.mcore_model import positions_and_mask

    tokens = next(data_iterator)
    input_ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    loss_mask = torch.ones(labels.shape, dtype=torch.float32, device=labels.device)
    position_ids, causal = positions_and_mask(input_ids)
    # the inputs of a Megatron-LM run, so that an msprobe dump records the same ones: the mask as its data loader
    # hands it (one [1, s, s] per sample, core_v0.16.1 megatron/core/datasets/gpt_dataset.py:253-267, collated to
    # [b, 1, s, s]) and the call pretrain_gpt.py makes (pretrain_gpt.py:197-199, packed_seq_params None without
    # packed sequences)
    causal = causal.expand(input_ids.shape[0], 1, -1, -1)
    with torch._C.DisableTorchFunction():  # the model needs no CudaLiteralsToCpu: spare it the per-op cost
        output = model(input_ids, position_ids, causal, labels=labels, loss_mask=loss_mask, packed_seq_params=None)
    return output, partial(_loss_func, loss_mask)


def _build(request: TrainRequest, state: Mapping[str, torch.Tensor], device: str = "cpu"):
    """DDP-wrapped GPTModel with the checkpoint loaded, megatron-core's optimizer and its param scheduler."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import Float16Module

    from crossalign.sides.megatron.embedded.mcore_cpu import CpuTensorTypesAsCuda, CudaLiteralsToCpu
    from crossalign.sides.megatron.embedded.mcore_model import Shard, build_gpt_model, load_converted_state

    config, training = request.config, request.config.training
    if training.lr_warmup_iters >= request.iterations:
        raise ValueError(f"training.lr_warmup_iters {training.lr_warmup_iters} must be below training.train_iters "
                         f"{request.iterations}: Megatron's OptimizerParamScheduler asserts lr_warmup_steps < "
                         "lr_decay_steps, and --lr-decay-iters defaults to --train-iters")
    bf16 = training.embedded_precision == "bf16"
    layout = config.parallel.megatron
    with devices.cpu_only(device, CudaLiteralsToCpu()):
        net = build_gpt_model(config.model, training, bf16=bf16, layout=layout, device=device,
                              swiglu_fusion=swiglu_fusion_under(request.dump))
    shard = Shard.of_this_process(layout)
    load_converted_state(net, state, config.model, training.megatron_core_version, shard)
    if layout.world_size == 1:
        verify_loaded(net, state, request)
    else:  # a process of a sharded run holds its shard only: held against its rank's file (_verified_by_the_last_rank)
        write_shard_digest(net, request, shard)
    if device == "cuda":  # after the load digest, before the optimizer wraps the parameters (it wants CUDA tensors)
        net.cuda()
    # --bf16: get_model wraps the model in Float16Module (every parameter bf16, the forward in bf16) and
    # get_megatron_optimizer keeps fp32 main copies of them (Float16OptimizerWithFloat16Params)
    module = Float16Module(net.config, net) if bf16 else net
    ddp = DistributedDataParallel(config=net.config, module=module,
                                  ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    # the optimizers keep their loss scale on 'cuda'; the bf16 one accepts only CUDA tensor type names
    with devices.cpu_only(device, CudaLiteralsToCpu(), CpuTensorTypesAsCuda() if bf16 else contextlib.nullcontext()):
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
    from crossalign.tensorio.digest import compare_loaded, torch_digests
    from crossalign.models.layout import split_stacked_experts
    from crossalign.sides.megatron.te_local import local_to_te_names

    config = request.config
    names = local_to_te_names(config.model, config.training.megatron_core_version)
    compare_loaded(torch_digests(net.state_dict()), split_stacked_experts(state, config.model.num_experts),
                   what=f"megatron-core GPTModel vs the checkpoint {request.init_checkpoint}",
                   rename=lambda name: names.get(name, name))


def write_shard_digest(net, request: TrainRequest, shard) -> Path | None:
    """This rank's load digest, in the file the GPU launcher writes (``patches/megatron/pretrain_qwen35.py``
    ``write_load_digest``: ``{"rank": <rank folder>, "tensors": {name: {shape, dtype, sha256}}}`` in
    ``<output>/load_digest/<rank folder>.json``), so that the real step's :func:`verify_load_digest` reads it.

    The folder is the rank's checkpoint folder ``mp_rank_TT[_PPP][_EEE]`` and the names are the checkpoint's
    TE names with stage-local layer numbers (as :func:`save_checkpoint` writes them). As Megatron's legacy save,
    only expert-data-parallel rank 0 of each (tensor, pipeline, expert) rank writes; None on the others.
    """
    from megatron.core import parallel_state as ps

    from crossalign.sides.megatron.embedded.mcore_model import stage_names
    from crossalign.sides.megatron.load_digest import LOAD_DIGEST_DIR
    from crossalign.tensorio.digest import torch_digests, write_digest
    from crossalign.sides.megatron.checkpoint import rank_dir_name

    if ps.get_expert_data_parallel_rank() != 0:
        return None
    config, layout = request.config, request.config.parallel.megatron
    local = torch_digests(net.state_dict())
    names = stage_names(local, config.model, config.training.megatron_core_version, shard.first_layer(config.model),
                        to_local=False)
    folder = rank_dir_name(shard.tensor_rank, shard.pipeline_rank, layout.pipeline, shard.expert_rank, layout.expert)
    return write_digest(request.output_dir / LOAD_DIGEST_DIR / f"{folder}.json",
                        {names.get(key, key): digest for key, digest in local.items()}, rank=folder)


def _verified_by_the_last_rank(request: TrainRequest, prints: bool) -> int:
    """Once every rank has written its load digest, the printing rank verifies them all with the real step's
    check (``backends/megatron.py`` :func:`verify_load_digest`: each folder the layout's ranks load, against
    that folder's file of ``init_checkpoint``) and tells every rank the outcome: on a fault each rank raises
    the same error before the first step (no rank is left waiting in a collective for one that stopped, which
    would report a lost connection instead)."""
    from crossalign.sides.megatron.load_digest import LOAD_DIGEST_DIR, verify_load_digest
    from crossalign.tensorio.errors import CheckpointError

    torch.distributed.barrier()
    outcome: list[object] = [None]
    if prints:
        try:
            outcome = [verify_load_digest(request.output_dir / LOAD_DIGEST_DIR, Path(request.init_checkpoint),
                                          request.config)]
        except CheckpointError as exc:  # LoadDigestError among them
            outcome = [exc]
    torch.distributed.broadcast_object_list(outcome, src=torch.distributed.get_world_size() - 1)
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return int(outcome[0])


def _train_step(ddp, optimizer, scheduler, tokens: np.ndarray, iteration: int, request: TrainRequest,
                device: str = "cpu") -> IterationStats:
    """Megatron's train_step and the loss bookkeeping of training_log for one iteration."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, track_moe_metrics
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from crossalign.sides.megatron.embedded.mcore_cpu import CudaLiteralsToCpu

    from megatron.core import parallel_state

    model, training = request.config.model, request.config.training
    tokens = torch.as_tensor(np.asarray(tokens), dtype=torch.int64).to(device)
    expected = (training.global_batch_size, training.seq_length + 1)
    if tuple(tokens.shape) != expected:
        raise ValueError(f"global batch {iteration}: tokens of shape {tuple(tokens.shape)}, expected {expected}")
    data_parallel = parallel_state.get_data_parallel_world_size()
    num_micro = training.global_batch_size // (training.micro_batch_size * data_parallel)
    micro_batches = iter(data_parallel_share(tokens, training.micro_batch_size, data_parallel,
                                             parallel_state.get_data_parallel_rank()))

    # the schedule counts tokens, and the optimizer reduces the grad norm, in tensors made on 'cuda'
    with devices.cpu_only(device, CudaLiteralsToCpu()):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        reports = get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=micro_batches, model=[ddp], num_microbatches=num_micro,
            seq_length=training.seq_length, micro_batch_size=training.micro_batch_size, forward_only=False)
        succeeded, grad_norm, _ = optimizer.step()
    if not succeeded or grad_norm is None or not np.isfinite(grad_norm):
        raise TrainingError(f"iteration {iteration}: the optimizer step failed (grad norm {grad_norm})")
    scheduler.step(increment=training.global_batch_size)

    lm_loss = float("nan")  # known on the last pipeline stage only, which prints it (Megatron's print_rank_last)
    if parallel_state.is_pipeline_last_stage():
        pair = torch.stack([report["lm loss"] for report in reports]).sum(dim=0)
        # train_step sums the reporting pair over the data-parallel ranks (core_v0.16.1 megatron/training/training.py)
        torch.distributed.all_reduce(pair, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
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


# spawned, not forked: a fork copies the parent's threads' locks (MindSpore's, OpenMP's) mid-use, and a rank then
# crashes; spawned ranks import megatron-core afresh (a few seconds each)
START_METHOD = "spawn"


def data_parallel_share(tokens: torch.Tensor, micro_batch_size: int, data_parallel: int,
                        rank: int) -> list[torch.Tensor]:
    """This data-parallel rank's micro batches of a global batch, as MegatronPretrainingSampler deals them: of
    each run of micro_batch_size x data_parallel samples, rank r takes the r-th micro batch
    (core_v0.16.1 megatron/legacy/data/data_samplers.py, MegatronPretrainingSampler.__iter__)."""
    step = micro_batch_size * data_parallel
    return [tokens[start + rank * micro_batch_size: start + (rank + 1) * micro_batch_size]
            for start in range(0, tokens.shape[0], step)]


def _place(layout) -> str:
    """Megatron's ``[ t T/TP, p P/PP ]`` of the last rank (the one that prints)."""
    from megatron.core import parallel_state as ps

    return (f"[ t {ps.get_tensor_model_parallel_rank() + 1}/{layout.tensor}, "
            f"p {ps.get_pipeline_model_parallel_rank() + 1}/{layout.pipeline} ]")


def _train_rank(request: TrainRequest, state: Mapping[str, torch.Tensor], checkpoint_iteration: int,
                batches: Sequence[np.ndarray], group=None, progress=None) -> None:
    """One rank's part of a run (the only one without ``group``). The last rank writes the log and reports
    the steps, as Megatron prints from it; ``progress`` (a queue) carries them to the step's process."""
    from megatron.core import parallel_state

    training, total, layout = request.config.training, request.iterations, request.config.parallel.megatron
    device = devices.resolve(training.embedded_device)
    prints = group is None or group.rank == group.world_size - 1
    log = megatron_log(request.log_path, training.seed, layout) if prints else contextlib.nullcontext(lambda _: None)
    with deterministic_training_threads(), log as emit, devices.on_device(device, training.seed, group), \
            devices.delta_rule_seam():
        emit(f"building GPT model ... ({IMPLEMENTATION}, local modules on {device.upper()})")
        if not swiglu_fusion_under(request.dump):
            emit(UNFUSED_FOR_MIX)
        emit(f" loading checkpoint from {request.init_checkpoint} at iteration {checkpoint_iteration}")
        ddp, optimizer, scheduler = _build(request, state, device)
        if group is not None:
            verified = _verified_by_the_last_rank(request, prints)
            if prints:
                emit(f"crossalign: load digest of every rank verified against {request.init_checkpoint}: "
                     f"{verified} tensors")
        emit(" > number of parameters on (tensor, pipeline) model parallel rank "
             f"({parallel_state.get_tensor_model_parallel_rank()}, {parallel_state.get_pipeline_model_parallel_rank()}"
             f"): {sum(p.numel() for p in ddp.module.parameters())}")
        emit(f"  successfully loaded checkpoint from {request.init_checkpoint} {_place(layout)} at iteration 0")
        emit_setup_done(emit, total * training.global_batch_size)
        lines = MegatronLogLines(total, training.global_batch_size, training.megatron_core_version)
        dump = IterationDump(request.output_dir / CONFIG_FILE if request.dump is not None else None)
        ddp.train()
        for iteration in range(1, total + 1):
            with dump.iteration([ddp]):
                stats = _train_step(ddp, optimizer, scheduler, batches[iteration - 1], iteration, request, device)
            if not prints:
                continue
            emit(lines.line(iteration, stats))
            metrics = _step_metrics(stats, megatron_lr(training, iteration))
            if progress is not None:
                progress.put((iteration, total, metrics))
            elif request.on_step is not None:
                request.on_step(iteration, total, metrics)
        emit(_datetime_line("after training is done"))
        if request.save:
            save_checkpoint(ddp.module, request, total)
            emit(f"  successfully saved checkpoint from iteration {total:7d} to {request.checkpoint_dir} "
                 f"{_place(layout)}")


def _rank_main(rank: int, request: TrainRequest, state, checkpoint_iteration: int, batches, init_method: str,
               progress) -> None:
    """A spawned rank: its place in the group, then its part of the run."""
    from crossalign.sides.megatron.embedded.mcore_cpu import ProcessGroup

    layout = request.config.parallel.megatron
    group = ProcessGroup(rank=rank, world_size=layout.world_size, init_method=init_method, tensor=layout.tensor,
                         pipeline=layout.pipeline, expert=layout.expert, expert_tensor=layout.expert_tensor_size)
    _train_rank(request, state, checkpoint_iteration, batches, group, progress)


def _train_ranks(request: TrainRequest, state: Mapping[str, torch.Tensor], checkpoint_iteration: int,
                 batches: Sequence[np.ndarray]) -> None:
    """Every rank of the layout in its own process (spawned; gloo over a file rendezvous), as torchrun would
    start them; the steps the last rank reports reach ``request.on_step`` here, and a rank's failure names it."""
    import tempfile

    import torch.multiprocessing as mp

    layout = request.config.parallel.megatron
    context = mp.get_context(START_METHOD)
    progress = context.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="crossalign-gloo-") as rendezvous:
        ranks = mp.start_processes(
            _rank_main, args=(dataclasses.replace(request, on_step=None), dict(state), checkpoint_iteration,
                              list(batches), f"file://{rendezvous}/store", progress),
            nprocs=layout.world_size, join=False, start_method=START_METHOD)
        try:
            while not ranks.join(timeout=0.2):
                while not progress.empty():
                    if request.on_step is not None:
                        request.on_step(*progress.get())
                    else:
                        progress.get()
        except mp.ProcessRaisedException as exc:
            raise TrainingError(f"megatron-core rank {exc.error_index} of {layout.ranks} failed:\n{exc}") from None
        except mp.ProcessExitedException as exc:
            raise TrainingError(f"megatron-core rank {exc.error_index} of {layout.ranks} exited with "
                                f"status {exc.exit_code}") from None
        while not progress.empty():
            step = progress.get()
            if request.on_step is not None:
                request.on_step(*step)


def run_training(request: TrainRequest, state: Mapping[str, torch.Tensor], checkpoint_iteration: int,
                 batches: Sequence[np.ndarray]) -> TrainResult:
    """Train ``request.iterations`` steps from the Megatron ``state`` (the full model) on ``batches`` (item i:
    the int64 tokens [global_batch_size, seq_length + 1] of global batch i) and write the Megatron log.

    In the config's Megatron layout: one process, or one per rank (``parallel.megatron``), each
    training its shard of the model as Megatron's ranks do.
    """
    total = request.iterations
    if len(batches) < total:
        raise ValueError(f"{request.data.prefix}: {len(batches)} global batches for {total} iterations")
    request.output_dir.mkdir(parents=True, exist_ok=True)
    if request.dump is not None:  # every rank's debugger reads it; msprobe writes msprobe_dump/step{N}/rank{R}/
        request.write_dump_config()
    if request.config.parallel.megatron.world_size > 1:
        if request.init_checkpoint is None:
            raise ValueError("init_checkpoint: a sharded run verifies what each rank loaded against its file of the "
                             "checkpoint, and needs it")
        from crossalign.sides.megatron.load_digest import LOAD_DIGEST_DIR

        shutil.rmtree(request.output_dir / LOAD_DIGEST_DIR, ignore_errors=True)  # only this run's ranks' records
    training = request.config.training
    device = devices.resolve(training.embedded_device)
    if device == "cuda" and request.config.parallel.megatron.world_size > 1:
        raise devices.EmbeddedDeviceError("training.embedded_device: cuda trains in one process; a sharded "
                                          "parallel.megatron layout trains with embedded_device: cpu")
    with devices.delta_rule_seam() as seam:
        if seam:
            print(f"{devices.DELTA_RULE_SEAM}: megatron-core's delta rule is {seam} (a test seam)", flush=True)
        probed = probe_kernels(request.config, device)
        started = time.perf_counter()
        if request.config.parallel.megatron.world_size == 1:
            _train_rank(request, state, checkpoint_iteration, batches)
        else:
            _train_ranks(request, state, checkpoint_iteration, batches[:total])
    return TrainResult(log_path=request.log_path, checkpoint_dir=request.checkpoint_dir if request.save else None,
                       iterations=total, seconds=time.perf_counter() - started,
                       details={**devices.details(device, training.deterministic), "kernel_probe": probed})


def probe_kernels(config: AlignmentConfig, device: str) -> list[str]:
    """The kernel probe before the first step: every GatedDeltaNet kernel the run is about to use, forward and
    backward, against the fp32 reference (``kernel_probe``); KernelDisagrees (the run is invalid) where one is
    beyond its tolerance. Returns the probe's lines, printed as they are."""
    from crossalign.sides.megatron.kernel_probe import require

    started = time.perf_counter()
    lines = [check.line() for check in require(config, device)]
    print(f"kernel probe on {device} in {config.training.embedded_precision}: {len(lines)} checks against the fp32 "
          f"reference in {time.perf_counter() - started:.1f} s", flush=True)
    for line in lines:
        print(f"  {line}", flush=True)
    return lines


def save_checkpoint(net, request: TrainRequest, iteration: int) -> Path:
    """The trained weights in Megatron's legacy torch format under the TE names, in the run's layout (what a
    GPU run would write and load: ``iter_{N:07d}/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` and the tracker),
    without optimizer or RNG state. Every rank's shard is gathered on the last rank, which writes them all."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from crossalign.sides.megatron.embedded.mcore_model import Shard, stage_names
    from crossalign.tensorio.atomic import save_iteration
    from crossalign.sides.megatron.checkpoint import (CHECKPOINT_VERSION, MODEL_FILE, TRACKER, iteration_dir_name,
                                                rank_dir_name)

    config = request.config
    layout = config.parallel.megatron
    shard = Shard.of_this_process(layout)
    local = {key: value.detach().to("cpu", copy=True) for key, value in net.state_dict().items()
             if not key.endswith("._extra_state")}
    names = stage_names(local, config.model, config.training.megatron_core_version, shard.first_layer(config.model),
                        to_local=False)
    te = {names.get(key, key): value for key, value in local.items()}
    gathered = [None] * dist.get_world_size() if dist.get_rank() == dist.get_world_size() - 1 else None
    # the ranks that save, as Megatron's legacy save_checkpoint picks them: expert-data-parallel rank 0
    dist.gather_object((shard.rank, ps.get_expert_data_parallel_rank(), te), gathered, dst=dist.get_world_size() - 1)
    if gathered is None:
        return request.checkpoint_dir
    files = {rank: state for rank, data_rank, state in gathered if data_rank == 0}

    def fill(folder: Path) -> None:
        for (t, p, e), state in sorted(files.items()):
            file = folder / rank_dir_name(t, p, layout.pipeline, e, layout.expert) / MODEL_FILE
            file.parent.mkdir(parents=True)
            torch.save({"checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration, "model": state}, file)

    return save_iteration(request.checkpoint_dir, iteration_dir_name(iteration), iteration, TRACKER, fill)


class LocalMegatronBackend:
    """The embedded stand-in for Megatron-LM (DAG step 4), on megatron-core itself (CPU or the agent's GPU,
    ``training.embedded_device``): align mode only."""

    name = "local-megatron"

    def implementation(self, config: AlignmentConfig) -> str:
        """What trains, and in which precision: recorded in the step's manifest and named in the report."""
        from importlib.metadata import version

        precision = "bf16 on fp32 main weights" if config.training.embedded_precision == "bf16" else "fp32"
        device = devices.resolve(config.training.embedded_device).upper()
        return (f"{IMPLEMENTATION} {version('megatron-core')} "
                f"(GPTModel, DDP, optimizer and scheduler on {device}, {precision})")

    def device(self, config: AlignmentConfig) -> str:
        """Where it trains: ``cpu`` or ``cuda`` (``training.embedded_device``); the step checks the GPU environment
        before a GPU run."""
        return devices.resolve(config.training.embedded_device)

    def train(self, request: TrainRequest) -> TrainResult:
        if request.mode != "align":
            raise ValueError(f"{self.name}: mode {request.mode!r} is not supported; Megatron only runs the "
                             "alignment step (mode 'align')")
        if request.init_checkpoint is None:
            raise ValueError(f"{self.name}: align mode needs init_checkpoint (a Megatron checkpoint directory)")
        from importlib.metadata import version

        from crossalign.sides.megatron.checkpoint import read_megatron_checkpoint
        from crossalign.data.order import global_batches

        wanted, installed = request.config.training.megatron_core_version, version("megatron-core")
        if version_tuple(wanted)[:2] != version_tuple(installed)[:2]:
            raise ValueError(f"{self.name}: training.megatron_core_version is {wanted}, but the embedded GPU side is "
                             f"the installed megatron-core {installed} (its MTP key prefix and log semantics would "
                             "not be the configured ones)")
        checkpoint = read_megatron_checkpoint(Path(request.init_checkpoint), request.config.model)
        training = request.config.training
        batches = global_batches(sample_order(training, request.iterations * training.global_batch_size),
                                 request.data.prefix, training.global_batch_size)
        return run_training(request, checkpoint.state, checkpoint.iteration, batches)
