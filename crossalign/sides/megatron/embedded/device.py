"""Where the embedded megatron-core trainer runs (``training.embedded_device``) and which kernels train there.

On CPU the trainer runs inside ``mcore_cpu.megatron_core_on_cpu`` (gloo, the CPU workarounds) in
deterministic mode: Megatron's ``torch_chunk_gated_delta_rule``, torch's conv1d and a torch l2norm. On a
GPU it runs as Megatron does there (NCCL, ``model_parallel_cuda_manual_seed``, no workaround), the model
moved to the GPU after the load digest and before megatron-core's optimizer wraps it; the GatedDeltaNet
kernels follow ``training.deterministic`` (core_v0.16.1 megatron/core/ssm/gated_delta_net.py: deterministic
mode takes the torch chunk rule and torch conv1d, otherwise fla's ``chunk_gated_delta_rule`` and
causal-conv1d when installed).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from typing import Callable, Iterator

import torch

DEVICES = ("auto", "cpu", "cuda")
# The test seam of the kernel probe: ``module:function`` named here becomes the delta rule megatron-core's
# GatedDeltaNet calls (in place of torch_chunk_gated_delta_rule and fla's chunk_gated_delta_rule alike) while a
# training step runs (:func:`delta_rule_seam`), so that a test can train with a kernel that computes wrong.
DELTA_RULE_SEAM = "CROSSALIGN_TEST_DELTA_RULE"
DELTA_RULES = ("torch_chunk_gated_delta_rule", "chunk_gated_delta_rule")


class EmbeddedDeviceError(RuntimeError):
    """The configured device is not available in this process."""


def resolve(setting: str) -> str:
    """``cpu`` or ``cuda`` for the setting: ``auto`` takes the GPU where torch sees one."""
    if setting not in DEVICES:
        raise EmbeddedDeviceError(f"training.embedded_device: {setting!r} is not one of {', '.join(DEVICES)}")
    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cuda" and not torch.cuda.is_available():
        raise EmbeddedDeviceError("training.embedded_device: cuda, but torch sees no GPU in this process "
                                  f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    return setting


def kernel_functions(device: str, deterministic: bool) -> dict[str, tuple[str, Callable | None]]:
    """kind -> (name, function) of the GatedDeltaNet kernels megatron-core calls on ``device`` (core_v0.16.1
    megatron/core/ssm/gated_delta_net.py: ``deterministic_mode`` picks torch_chunk_gated_delta_rule and torch
    conv1d, lines 326 and 370). What megatron-core's module holds now decides, not what is installed: it catches
    the ImportError of a causal-conv1d built for another torch and runs torch's conv1d (lines 49-53). The function
    is None for torch's conv1d (an nn.Conv1d of the model) and where fla does not import."""
    from crossalign.data.mcore import quiet_megatron_import

    with quiet_megatron_import():  # what megatron-core's GatedDeltaNet module found at import
        from megatron.core.ssm import gated_delta_net

    torch_rule = ("megatron.core torch_chunk_gated_delta_rule", gated_delta_net.torch_chunk_gated_delta_rule)
    if device == "cpu":
        from crossalign.sides.megatron.embedded.mcore_cpu import _torch_l2norm

        return {"delta_rule": torch_rule, "l2norm": ("torch l2norm (mcore_cpu)", _torch_l2norm),
                "conv1d": ("torch conv1d", None)}
    fla = getattr(gated_delta_net, "HAVE_FLA", False)
    missing = ("none: fla does not import", None)
    if deterministic:
        delta, conv = torch_rule, ("torch conv1d", None)
    else:
        delta = ("fla chunk_gated_delta_rule (Triton)", gated_delta_net.chunk_gated_delta_rule) if fla else missing
        causal = getattr(gated_delta_net, "causal_conv1d_fn", None)
        conv = ("causal_conv1d_fn (causal-conv1d)", causal) if causal is not None else ("torch conv1d", None)
    return {"delta_rule": delta, "l2norm": ("fla l2norm (Triton)", gated_delta_net.l2norm) if fla else missing,
            "conv1d": conv}


def kernels(device: str, deterministic: bool) -> dict[str, str]:
    """The names of :func:`kernel_functions`: what the step's manifest and the report say trained."""
    return {kind: name for kind, (name, _) in kernel_functions(device, deterministic).items()}


def megatron_torch_rule() -> Callable:
    """megatron-core's own torch_chunk_gated_delta_rule, whatever :func:`delta_rule_seam` put in its place."""
    from megatron.core.ssm import gated_delta_net

    return _SEAMED.get("torch_chunk_gated_delta_rule", gated_delta_net.torch_chunk_gated_delta_rule)


_SEAMED: dict[str, Callable] = {}  # megatron-core's delta rules while the seam replaces them


@contextlib.contextmanager
def delta_rule_seam() -> Iterator[str | None]:
    """While the block runs, the function named by ``$CROSSALIGN_TEST_DELTA_RULE`` (``module:function``) is
    megatron-core's delta rule (``DELTA_RULE_SEAM``); yields what it names (None: the variable is unset, nothing
    changes). For tests only."""
    named = os.environ.get(DELTA_RULE_SEAM)
    if not named or _SEAMED:
        yield named
        return
    module, _, name = named.partition(":")
    replacement = getattr(importlib.import_module(module), name)
    from megatron.core.ssm import gated_delta_net

    _SEAMED.update({rule: getattr(gated_delta_net, rule) for rule in DELTA_RULES})
    try:
        for rule in DELTA_RULES:
            setattr(gated_delta_net, rule, replacement)
        yield named
    finally:
        for rule, original in _SEAMED.items():
            setattr(gated_delta_net, rule, original)
        _SEAMED.clear()


def details(device: str, deterministic: bool) -> dict[str, object]:
    """What the step's manifest and the report say about where and with which kernels the run trained."""
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return {"device": device, "device_name": name, "kernels": kernels(device, deterministic)}


@contextlib.contextmanager
def megatron_core_on_cuda(seed: int) -> Iterator[None]:
    """megatron-core ready to build and train a one-process model on this GPU, as Megatron's initialize does:
    an NCCL group of one, the parallel state, model_parallel_cuda_manual_seed (core_v0.16.1
    megatron/training/initialize.py _set_random_seed); everything undone on exit."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from crossalign.sides.megatron.embedded.mcore_cpu import _clear_loss_trackers

    if dist.is_initialized():
        raise EmbeddedDeviceError("a torch.distributed process group is already running in this process")
    _clear_loss_trackers()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        yield
    finally:
        _clear_loss_trackers()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def on_device(device: str, seed: int, group=None):
    """The context the trainer runs in on ``device``: megatron_core_on_cpu (with ``group``) or on CUDA."""
    if device == "cpu":
        from crossalign.sides.megatron.embedded.mcore_cpu import megatron_core_on_cpu

        return megatron_core_on_cpu(seed, group)
    if group is not None:
        raise EmbeddedDeviceError("training.embedded_device: cuda trains in one process; a sharded "
                                  "parallel.megatron layout trains on cpu")
    return megatron_core_on_cuda(seed)


def cpu_only(device: str, *modes):
    """``modes`` (the CPU workarounds' torch-function modes) on CPU; nothing on a GPU."""
    if device != "cpu":
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for mode in modes:
        stack.enter_context(mode)
    return stack
