"""Megatron-LM's training code (``pretrain()``) on a CPU: every stand-in it needs, each with its reason.

The rehearsal runs the step's real launch (the generated arguments and
``patches/megatron/pretrain_qwen35.py``, through torchrun) on a login node. Three kinds of
stand-in make that possible, all listed here as data:

- :data:`ARGUMENT_CHANGES`: the few generated arguments a CPU cannot honour (TransformerEngine,
  the alltoall dispatcher's CUDA stream, NCCL), each replaced by its CPU equivalent;
- :data:`TRAINING_WORKAROUNDS`: attributes of torch.cuda and of Megatron-LM's training code
  replaced while the process runs (the CUDA calls answered on the CPU), on top of megatron-core's
  own CPU workarounds (``crossalign/sides/megatron/embedded/mcore_cpu.py``, reused whole);
- :class:`CudaToCpu`: ``device='cuda'`` literals and ``Tensor.cuda()`` mapped to the CPU.

:func:`self_test` checks, before anything runs, that the upstream code each workaround was
written for is still there (the same rule as ``mcore_cpu.self_test``), so a new Megatron-LM
fails naming the workaround instead of rehearsing something else. Checked on Megatron-LM tag
core_v0.16.1 (its ``megatron/core`` equals the megatron-core 0.16.1 wheel) with torch 2.13.0 (CPU).

Run by torchrun in place of the launcher (``python -m crossalign.sides.megatron.rehearsal_cpu
LAUNCHER ARGS...``); everything else is Megatron's own code.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import runpy
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch.overrides import TorchFunctionMode

from crossalign.sides.megatron.embedded import mcore_cpu
from crossalign.sides.megatron.embedded.mcore_cpu import MegatronCpuError, Workaround

CHECKED_TAGS = ("core_v0.16.1",)


@dataclass(frozen=True)
class ArgumentChange:
    """One generated argument replaced for the CPU: ``flag`` (with ``takes`` values) becomes ``becomes``."""

    flag: str
    becomes: tuple[str, ...]
    reason: str
    takes: int = 0  # how many values follow the flag in the generated arguments


ARGUMENT_CHANGES: tuple[ArgumentChange, ...] = (
    ArgumentChange("--transformer-impl", ("--transformer-impl", "local"),
                   "TransformerEngine needs CUDA; megatron-core's local modules hold the same tensors under other "
                   "names (crossalign/sides/megatron/te_local.py maps them)", takes=1),
    ArgumentChange("--moe-grouped-gemm", (),
                   "grouped GEMM is TransformerEngine's TEGroupedMLP; the local experts are a SequentialMLP"),
    ArgumentChange("--moe-token-dispatcher-type", ("--moe-token-dispatcher-type", "allgather"),
                   "the alltoall dispatcher creates a CUDA stream; with one expert-parallel rank allgather "
                   "communicates nothing", takes=1),
    ArgumentChange("--distributed-backend", ("--distributed-backend", "gloo"),
                   "NCCL needs GPUs; gloo runs the same collectives on the CPU", takes=1),
    ArgumentChange("--no-rope-fusion", ("--no-rope-fusion",),
                   "fused RoPE is a TransformerEngine/apex kernel"),
    ArgumentChange("--no-masked-softmax-fusion", ("--no-masked-softmax-fusion",),
                   "the fused masked softmax is a CUDA kernel"),
    ArgumentChange("--no-bias-dropout-fusion", ("--no-bias-dropout-fusion",),
                   "the fused bias-dropout-add is compiled with torch.compile, which is turned off on the CPU"),
    ArgumentChange("--no-persist-layer-norm", ("--no-persist-layer-norm",),
                   "the persistent layer norm is apex's CUDA kernel"),
    ArgumentChange("--num-workers", ("--num-workers", "0"),
                   "data loader worker processes only cost start-up time on a login node", takes=1),
)
# Flags added when the generated arguments lack them (their change is still listed above).
ADDED_FLAGS = ("--distributed-backend", "--no-rope-fusion", "--no-masked-softmax-fusion", "--no-bias-dropout-fusion",
               "--no-persist-layer-norm", "--num-workers")
BF16_CHANGE = ArgumentChange("--bf16", (), "rehearsed in fp32, the embedded megatron-core run's precision, so the "
                                          "losses can be held against it to print precision")


def cpu_arguments(args: Sequence[str], *, fp32: bool) -> tuple[list[str], list[ArgumentChange]]:
    """The generated arguments with :data:`ARGUMENT_CHANGES` applied, and the changes that applied."""
    changes = {change.flag: change for change in ARGUMENT_CHANGES}
    if fp32:
        changes[BF16_CHANGE.flag] = BF16_CHANGE
    out: list[str] = []
    applied: dict[str, ArgumentChange] = {}
    index = 0
    args = list(args)
    while index < len(args):
        change = changes.get(args[index])
        if change is None:
            out.append(args[index])
            index += 1
            continue
        out += change.becomes
        applied[change.flag] = change
        index += 1 + change.takes
    for flag in ADDED_FLAGS:
        if flag not in applied:
            out += changes[flag].becomes
            applied[flag] = changes[flag]
    return out, list(applied.values())


# ---- the CUDA calls answered on the CPU ------------------------------------------------------


class _NoStream:
    """torch.cuda.Stream on the CPU: every operation is already in order."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return None


def _returns(value):
    """A new function that ignores its arguments and returns ``value`` (one per workaround: torch._dynamo
    refuses one function object under two torch names)."""
    def answer(*args, **kwargs):
        return value

    return answer


def _stream_context(stream=None):
    return contextlib.nullcontext()


def _allow_no_cuda(original):
    @functools.wraps(original)
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    return initialize_megatron


def _wrapped(module: str, attribute: str, wrapper: Callable) -> Callable[[], object]:
    """A replacement that wraps the original found at ``module.attribute`` when applied."""
    def make():
        import importlib

        return wrapper(getattr(importlib.import_module(module), attribute))

    return make


TRAINING_WORKAROUNDS: tuple[Workaround, ...] = (
    Workaround("megatron.training.training", "initialize_megatron",
               "asserts torch.cuda.is_available() unless allow_no_cuda, upstream's own switch for the CPU",
               _wrapped("megatron.training.training", "initialize_megatron", _allow_no_cuda),
               None),
    Workaround("megatron.legacy.fused_kernels", "load",
               "compiles Megatron's fused CUDA kernels with nvcc (initialize.py _compile_dependencies); the CPU "
               "runs the unfused code", lambda: _returns(None), "nvcc"),
    Workaround("torch.cuda", "device_count",
               "0 devices would skip the model-parallel groups and the RNG trackers "
               "(megatron/training/initialize.py _initialize_distributed, _set_random_seed): one device, the CPU",
               lambda: _returns(1)),
    Workaround("torch.cuda", "set_device", "selects the rank's GPU; the CPU needs no selection",
               lambda: _returns(None)),
    Workaround("torch.cuda", "synchronize", "waits for the GPU's queue; the CPU has none", lambda: _returns(None)),
    Workaround("torch.cuda", "Stream", "DDP is built on a side stream (training.py get_model)", lambda: _NoStream),
    Workaround("torch.cuda", "current_stream", "DDP's side stream waits on it", lambda: _NoStream),
    Workaround("torch.cuda", "stream", "DDP is built inside a stream context", lambda: _stream_context),
    Workaround("torch.cuda", "manual_seed", "model_parallel_cuda_manual_seed seeds the CUDA generator",
               lambda: _returns(None)),
    Workaround("torch.cuda", "get_rng_state",
               "the rerun state machine saves the CUDA generator before each step (rerun_state_machine.py "
               "_save_state); there is none: an empty state", lambda: _returns(torch.empty(0, dtype=torch.uint8))),
    Workaround("torch.cuda", "set_rng_state", "... and restores it", lambda: _returns(None)),
    Workaround("torch.cuda", "memory_allocated", "memory reports (training_log, report_memory)", lambda: _returns(0)),
    Workaround("torch.cuda", "max_memory_allocated", "memory reports", lambda: _returns(0)),
    Workaround("torch.cuda", "memory_reserved", "memory reports", lambda: _returns(0)),
    Workaround("torch.cuda", "max_memory_reserved", "memory reports", lambda: _returns(0)),
    Workaround("torch.cuda", "reset_peak_memory_stats", "memory reports", lambda: _returns(None)),
)


class CudaToCpu(TorchFunctionMode):
    """``device='cuda'`` in torch calls, ``Tensor.cuda()`` and ``Tensor.to('cuda')`` kept on the CPU.

    Megatron-LM's training loop makes its small tensors on ``'cuda'`` by name (the loss totals,
    the start-up timestamps, the train/valid/test flags) and moves every batch with
    ``.cuda(non_blocking=True)`` (``get_batch_on_this_tp_rank``); ``get_model`` moves the model
    with ``module.cuda(device)``. Extends megatron-core's :class:`mcore_cpu.CudaLiteralsToCpu`.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
            if _is_cuda(kwargs.get("device")):
                kwargs = dict(kwargs, device="cpu")
            kwargs.pop("non_blocking", None)
        elif _is_cuda(kwargs.get("device")):
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


def _is_cuda(value) -> bool:
    """A device argument that names CUDA ('cuda', 'cuda:0', torch.device('cuda'))."""
    return isinstance(value, (str, torch.device)) and torch.device(value).type == "cuda"


# ---- self-test and runtime -------------------------------------------------------------------


def self_test() -> None:
    """Fail, naming it, where megatron-core, torch or Megatron-LM's training code is not what was checked."""
    mcore_cpu.self_test()
    problems = []
    for workaround in TRAINING_WORKAROUNDS:
        module = workaround.target()
        if workaround.defined and not hasattr(module, workaround.attribute):
            problems.append(f"{workaround.name} no longer exists ({workaround.reason})")
        elif workaround.upstream is not None and workaround.upstream not in inspect.getsource(module):
            problems.append(f"{workaround.name}: {workaround.upstream!r} is no longer in {module.__name__} "
                            f"(the workaround was for: {workaround.reason})")
    # megatron-core: an optional framework (the local and gpu extras), needed only here
    from megatron.training import initialize

    if "allow_no_cuda" not in inspect.signature(initialize.initialize_megatron).parameters:
        problems.append("megatron.training.initialize.initialize_megatron has no allow_no_cuda parameter")
    if problems:
        raise MegatronCpuError("Megatron-LM on CPU: " + "; ".join(problems))


def workarounds(bf16: bool = False) -> list[tuple[str, str]]:
    """(name, reason) of every runtime stand-in, megatron-core's first: what the rehearsal report lists
    (``bf16``: the run kept --bf16, which :func:`main` answers with one stand-in more)."""
    listed = [(w.name, w.reason) for w in (*mcore_cpu.WORKAROUNDS, *TRAINING_WORKAROUNDS)]
    listed.append(("CudaToCpu", "device='cuda' literals, Tensor.cuda() and .to('cuda') kept on the CPU"))
    if bf16:
        listed.append(("CpuTensorTypesAsCuda", "under --bf16 the optimizer (Float16OptimizerWithFloat16Params) "
                                               "accepts only CUDA tensor type names"))
    listed.append(("torch._dynamo disabled",
                   "megatron-core's jit_fuser compiles with torch.compile; nothing gained on CPU"))
    return listed


def main(argv: Sequence[str]) -> None:
    """Run ``argv[0]`` (the launcher) with ``argv[1:]`` as its arguments, the CPU stand-ins applied."""
    # torch: an optional framework (not in the base install), needed only here
    import torch._dynamo

    if not argv:
        sys.exit("usage: python -m crossalign.sides.megatron.rehearsal_cpu LAUNCHER [ARGS...]")
    torch._dynamo.config.disable = True
    self_test()
    modes = [CudaToCpu()]
    if "--bf16" in argv:
        modes.append(mcore_cpu.CpuTensorTypesAsCuda())
    with (mcore_cpu.applied(mcore_cpu.WORKAROUNDS), mcore_cpu.applied(TRAINING_WORKAROUNDS),
          contextlib.ExitStack() as stack):
        for mode in modes:
            stack.enter_context(mode)
        sys.argv = [argv[0], *argv[1:]]
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
