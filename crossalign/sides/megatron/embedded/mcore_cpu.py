"""megatron-core on a CPU: every workaround it needs, each with its reason, and the single-process runtime.

megatron-core is written for CUDA; its model, DDP, optimizer and schedule still run on a CPU
once the few places that name CUDA are redirected. Each :class:`Workaround` below says what it
replaces and why, and carries a check that the upstream code still looks the way it was when
the workaround was written: :func:`self_test` runs every check (and the version pins) before
anything is patched, so an upgrade that moves or fixes one of them fails loudly, naming it,
instead of training something else. Checked on megatron-core 0.16.1 with torch 2.13.0 (CPU
build) and fla-core 0.6.0.

Everything is applied by :func:`megatron_core_on_cpu` and undone when it exits: it is entered
only by the embedded megatron-train step's training process and by selfcheck, never by the
process that orchestrates a run. Two more things are settings, not patches, and live with the
TransformerConfig (``mcore_model.transformer_config``): ``deterministic_mode=True`` (GatedDeltaNet
then uses megatron-core's own ``torch_chunk_gated_delta_rule`` and torch's conv1d, not fla's
Triton kernel, which needs a GPU) and ``moe_token_dispatcher_type="allgather"`` (the alltoall
dispatcher creates a CUDA stream; with one expert-parallel rank allgather communicates nothing).
And GPTModel always gets an explicit causal mask (``mcore_model.positions_and_mask``): without one
the softmax builds it with ``get_default_causal_mask``, which hard-codes ``device="cuda"``.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
from torch.overrides import TorchFunctionMode

# 0.17.0: its sources hold every workaround's upstream line (self_test); tests/test_torch_dist.py builds, loads and
# saves GPTModel with it (the wheel beside the venv, .cache/megatron-core-0.17.0)
CHECKED_VERSIONS = {"megatron-core": ("0.16.1", "0.17.0"), "torch": ("2.13.0",)}


class MegatronCpuError(RuntimeError):
    """megatron-core is not the version, or not the code, that the CPU workarounds were written for."""


@dataclass(frozen=True)
class Workaround:
    """One redirection: ``module.attribute`` replaced by ``replacement()`` while the runtime is on.

    ``upstream`` is a piece of the original's source that is the reason for the workaround; if
    it is gone, the workaround may no longer be needed, or no longer enough: the self-test fails.
    """

    module: str
    attribute: str
    reason: str
    replacement: Callable[[], object]
    upstream: str | None = None
    defined: bool = True  # False: upstream leaves the name undefined here (the reason for the workaround)
    owner: str | None = None  # a class of the module whose attribute is replaced (None: the module's own)

    @property
    def name(self) -> str:
        return ".".join(filter(None, (self.module, self.owner, self.attribute)))

    def target(self):
        module = importlib.import_module(self.module)
        return getattr(module, self.owner) if self.owner else module


def _torch_l2norm(x: torch.Tensor, eps: float = 1e-6, output_dtype: torch.dtype | None = None) -> torch.Tensor:
    """fla's l2norm (x / sqrt(sum x^2 + eps) over the last axis) in plain torch."""
    y = x.float() * torch.rsqrt(x.float().pow(2).sum(-1, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)


def _cpu_current_device():
    return "cpu"


class CpuRNGStatesTracker:
    """megatron-core's CudaRNGStatesTracker on the CPU generator: named seeded states, forked and restored.

    ``model_parallel_cuda_manual_seed`` creates its states with ``torch.cuda.get_rng_state``; on
    CPU the parameter init and dropout forks use these instead (the weights are loaded from the
    checkpoint and dropout is 0, so only the bookkeeping matters).
    """

    def __init__(self):
        self.reset()

    def reset(self):
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self):
        return self._is_initialized

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int):
        if seed in self.seeds_ or name in self.states_:
            raise MegatronCpuError(f"rng state {name} (seed {seed}) already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise MegatronCpuError(f"rng state {name} is not added")
        outside = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outside)


def _clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """megatron-core's clip_grad_by_total_norm_fp32 without its CUDA asserts: grads *= max_norm / (norm + 1e-6)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for param in parameters:
            grad = param.decoupled_grad if use_decoupled_grad else param.grad
            if grad is not None:
                grad.mul_(clip_coeff)


def _dtoh_without_streams(self, point: str, tokens_per_expert: torch.Tensor | None = None):
    """The alltoall dispatcher's device-to-host step on CPU: no side stream, no event, the same conversions.

    On a GPU the split sizes are copied to the host as numpy arrays at ``cuda_dtoh_point`` (on a
    side stream, then an event synchronises); on CPU they already are host tensors, so only the
    conversion to numpy is left, at the same point.
    """
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def _torch_norm_marked_for_sequence_parallel(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
    """megatron-core's WrappedTorchNorm (torch's RMSNorm or LayerNorm) that a sequence-parallel run may build.

    Upstream asserts ``not config.sequence_parallel``: under sequence parallelism a norm's weight
    must carry ``sequence_parallel`` so that ``finalize_model_grads`` sums its grads over the
    tensor ranks (each saw part of the sequence). TE's norms mark their weights with
    ``config.sequence_parallel`` (megatron/core/extensions/transformer_engine.py, TENorm); this marks
    torch's the same way, so the CPU run reduces exactly the grads a GPU run reduces.
    """
    for flag in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm"):
        if getattr(config, flag):
            raise MegatronCpuError(f"{flag} is not supported by torch's norms (megatron-core's WrappedTorchNorm)")
    norms = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
    if config.normalization not in norms:
        raise MegatronCpuError(f"normalization {config.normalization!r}: the CPU norm builds LayerNorm or RMSNorm")
    norm = norms[config.normalization](normalized_shape=hidden_size, eps=eps)
    for parameter in norm.parameters():
        setattr(parameter, "sequence_parallel", config.sequence_parallel)
    return norm


_ALLTOALL = ("megatron.core.transformer.moe.token_dispatcher", "MoEAlltoAllTokenDispatcher")
NO_CUDA_STREAM = "no CUDA stream on CPU"

WORKAROUNDS: tuple[Workaround, ...] = (
    Workaround("torch.cuda", "current_device",
               "passed as device= in many constructors (GatedDeltaNet's conv1d, A_log, dt_bias, linear "
               "layers' weights); on CPU it must name the CPU", lambda: _cpu_current_device),
    Workaround("megatron.core.ssm.gated_delta_net", "l2norm",
               "fla's l2norm is a Triton kernel, which needs a GPU", lambda: _torch_l2norm,
               "from fla.modules.l2norm import l2norm"),
    Workaround("megatron.core.transformer.moe.moe_utils", "te_general_gemm",
               "the router's gemm calls te_general_gemm, left undefined when TransformerEngine is absent "
               "(it is imported in a try block; None selects torch.mm)", lambda: None,
               "if te_general_gemm is not None", defined=False),
    Workaround("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32",
               "asserts torch.cuda.FloatTensor grads and scales with a CUDA overflow buffer",
               lambda: _clip_grad_by_total_norm_fp32, "torch.cuda.FloatTensor"),
    Workaround("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32",
               "the same function, imported by name into the optimizer that calls it",
               lambda: _clip_grad_by_total_norm_fp32),
    Workaround("megatron.core.tensor_parallel.random", "_CUDA_RNG_STATE_TRACKER",
               "the CUDA RNG tracker seeds and forks torch.cuda generator states", CpuRNGStatesTracker,
               "torch.cuda.get_rng_state()"),
    Workaround("megatron.core.tensor_parallel.random", "_CUDA_RNG_STATE_TRACKER_INITIALIZED",
               "marks the CPU tracker as the one in use", lambda: True),
    Workaround(_ALLTOALL[0], "cuda_dtoh_stream",
               "the alltoall dispatcher creates one torch.cuda.Stream for its device-to-host copies unless the "
               "class already holds one", lambda: NO_CUDA_STREAM, "torch.cuda.Stream()", owner=_ALLTOALL[1]),
    Workaround(_ALLTOALL[0], "_maybe_dtoh_and_synchronize",
               "copies the token counts to the host on that stream and synchronises on a CUDA event",
               lambda: _dtoh_without_streams, "self.cuda_dtoh_stream.record_event()", owner=_ALLTOALL[1]),
    Workaround("megatron.core.transformer.torch_norm", "__new__",
               "the local specs' norm (torch's RMSNorm) refuses sequence parallelism; TE's norm marks its weight "
               "sequence_parallel instead, so that finalize_model_grads sums its grads over the tensor ranks",
               lambda: _torch_norm_marked_for_sequence_parallel, "sequence parallel not supported by torch LayerNorm",
               owner="WrappedTorchNorm"),
)


class CudaLiteralsToCpu(TorchFunctionMode):
    """Maps ``device='cuda'`` in torch calls to the CPU.

    megatron-core's optimizer and training helpers create small tensors on ``'cuda'`` by name
    (FP32Optimizer's loss scale, the grad-norm and zero-count reductions, the schedule's token
    total), and the pipeline's first and last stages move the embedding they share with ``.cuda()``
    before they all-reduce it (``LanguageModule.setup_embeddings_and_output_layer``). It costs some
    Python per torch call (a tiny MoE step: 235 ms inside it, 170 ms not), so the trainer enters it
    around building the model, the schedule and the optimizer step and turns it off inside the
    model's forward, which needs none of it.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:  # LanguageModule moves the pipeline's shared embedding with .cuda()
            return args[0]
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


class CpuTensorTypesAsCuda(TorchFunctionMode):
    """Answers ``Tensor.type()`` with the CUDA type name of a CPU tensor (``torch.BFloat16Tensor`` ->
    ``torch.cuda.BFloat16Tensor``).

    The ``--bf16`` optimizer, ``Float16OptimizerWithFloat16Params``, sorts the parameters by
    ``param.type()`` into bf16 ones (each given an fp32 main copy, which Adam updates) and fp32
    ones, and raises TypeError for any name but the three CUDA ones. Its step needs nothing more
    than :class:`CudaLiteralsToCpu`; the trainer enters this mode only while it builds that optimizer.
    """

    # core_v0.16.1 megatron/core/optimizer/optimizer.py:671
    UPSTREAM = ("megatron.core.optimizer.optimizer",
                "param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and out.startswith("torch.") \
                and not out.startswith("torch.cuda."):
            return "torch.cuda." + out[len("torch."):]
        return out


def installed_versions() -> dict[str, str]:
    from importlib.metadata import version

    return {"megatron-core": version("megatron-core"), "torch": torch.__version__.split("+")[0]}


def self_test(workarounds: tuple[Workaround, ...] = WORKAROUNDS,
              checked: dict[str, tuple[str, ...]] = CHECKED_VERSIONS) -> None:
    """Fail, naming it, where megatron-core or torch is not what these workarounds were checked against."""
    problems = []
    for package, have in installed_versions().items():
        if have not in checked[package]:
            problems.append(f"{package} {have} is installed; the CPU workarounds were checked on "
                            f"{', '.join(checked[package])}")
    for workaround in workarounds:
        module = workaround.target()
        if workaround.defined and not hasattr(module, workaround.attribute):
            problems.append(f"{workaround.name} no longer exists ({workaround.reason})")
            continue
        if workaround.upstream is not None:
            source = inspect.getsource(module)
            if workaround.upstream not in source:
                problems.append(f"{workaround.name}: {workaround.upstream!r} is no longer in "
                                f"{'.'.join(filter(None, (workaround.module, workaround.owner)))} "
                                f"(the workaround was for: {workaround.reason})")
    module, upstream = CpuTensorTypesAsCuda.UPSTREAM
    if upstream not in inspect.getsource(importlib.import_module(module)):
        problems.append(f"CpuTensorTypesAsCuda: {upstream!r} is no longer in {module} (the mode was for: the bf16 "
                        "optimizer accepting only CUDA tensor type names)")
    if problems:
        raise MegatronCpuError("megatron-core on CPU: " + "; ".join(problems))


@contextlib.contextmanager
def applied(workarounds: Sequence[Workaround]) -> Iterator[None]:
    """Each workaround's attribute replaced while the block runs, the originals put back after."""
    saved = []
    try:
        for workaround in workarounds:
            module = workaround.target()
            saved.append((module, workaround.attribute, getattr(module, workaround.attribute, None)))
            setattr(module, workaround.attribute, workaround.replacement())
        yield
    finally:
        for module, attribute, original in reversed(saved):
            setattr(module, attribute, original)


def _clear_loss_trackers() -> None:
    """Empty megatron-core's process-wide MoE aux-loss and MTP-loss trackers: every run starts from nothing."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    get_moe_layer_wise_logging_tracker().clear()
    MTPLossLoggingHelper.tracker.clear()


@dataclass(frozen=True)
class ProcessGroup:
    """This process's place in a CPU run of several processes: its rank, where the ranks meet, the layout.

    ``init_method`` is a ``file://`` rendezvous that torch.distributed's gloo backend reads.
    """

    rank: int
    world_size: int
    init_method: str
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1
    expert_tensor: int = 1


def _seed_rng_states(seed: int) -> None:
    """Megatron's _set_random_seed (seed + 100 x pipeline rank) and model_parallel_cuda_manual_seed's three states
    (core_v0.16.1 megatron/training/initialize.py, megatron/core/tensor_parallel/random.py:412-428)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mcore_random

    seed += 100 * ps.get_pipeline_model_parallel_rank()
    tracker = mcore_random.get_cuda_rng_tracker()
    torch.manual_seed(seed)
    tracker.add(mcore_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + ps.get_tensor_model_parallel_rank())
    tracker.add(mcore_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ps.get_expert_model_parallel_rank()
                + ps.get_expert_tensor_parallel_rank())


@contextlib.contextmanager
def megatron_core_on_cpu(seed: int, group: ProcessGroup | None = None) -> Iterator[None]:
    """megatron-core ready to build and train a model in this process, on CPU; everything undone on exit.

    Runs the self-test, empties megatron-core's loss trackers (module globals that would carry one
    run's losses into the next run in the same process), applies the workarounds, turns off
    ``torch.compile`` (megatron-core's ``jit_fuser``: about 14 s to compile on a cold start and
    nothing gained on CPU), starts the gloo group (one process, or this rank of ``group``),
    initialises megatron-core's parallel state in the group's layout and seeds its RNG states as
    Megatron would.
    """
    import torch._dynamo
    import torch.distributed as dist
    from megatron.core import parallel_state

    self_test()
    _clear_loss_trackers()
    if dist.is_initialized():
        raise MegatronCpuError("a torch.distributed process group is already running in this process")
    dynamo_was_disabled = torch._dynamo.config.disable
    torch._dynamo.config.disable = True
    try:
        with applied(WORKAROUNDS):
            if group is None:
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            else:
                dist.init_process_group("gloo", init_method=group.init_method, rank=group.rank,
                                        world_size=group.world_size)
            try:
                group = group or ProcessGroup(rank=0, world_size=1, init_method="")
                parallel_state.initialize_model_parallel(
                    tensor_model_parallel_size=group.tensor, pipeline_model_parallel_size=group.pipeline,
                    expert_model_parallel_size=group.expert, expert_tensor_parallel_size=group.expert_tensor)
                _seed_rng_states(seed)
                yield
            finally:
                _clear_loss_trackers()
                parallel_state.destroy_model_parallel()
                dist.destroy_process_group()
    finally:
        torch._dynamo.config.disable = dynamo_was_disabled
