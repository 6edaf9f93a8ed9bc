"""A stand-in for ``hyper_parallel`` (Huawei's parallel library, not on PyPI), so that MindFormers' own
pynative code imports and runs on one CPU card in the tests (tests/helpers/mindformers_upstream.py).

It stubs exactly the names listed in ``STUBBED`` below, the ones MindFormers 1.9.0, 2.0.0 and 2.1.0
import at start-up on the paths the tests run (config loading, the config converter, the pynative
GPTModel/MoE/MTP build, LossCallback, CheckpointCallback and load_checkpoint):

- a capitalised name is an empty class: code that builds placement tables at import time
  (``Shard(0)``, ``Replicate()``) gets an object, and ``isinstance(x, DTensor)`` is False for every
  tensor, which is what a single card sees;
- ``get_platform()`` returns an object whose every attribute raises (only expert-parallel overlap uses it);
- a lower-case name is a function that raises NotImplementedError when called: any parallel
  path (sharding, FSDP, recompute wrappers, the NPU custom ops) fails loudly instead of running
  on a stand-in.

Any other name, or any other submodule, is missing, as it would be without the package.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

STUBBED: dict[str, tuple[str, ...]] = {
    "hyper_parallel": ("DFunction", "DTensor", "DeviceMesh", "PipelineStage", "SkipDTensorDispatch",
                       "init_device_mesh", "parallelize_value_and_grad", "shard_module"),
    "hyper_parallel.core.activation_checkpoint": ("CheckpointPolicy", "SwapManager", "checkpoint_exclude_wrapper",
                                                  "checkpoint_wrapper", "swap_wrapper"),
    "hyper_parallel.core.context_parallel.async_context_parallel": ("AsyncContextParallel",),
    "hyper_parallel.core.context_parallel.async_dsa_context_parallel": (
        "AsyncDSAIndexerContextParallel", "AsyncDSAIndexerLossContextParallel",
        "AsyncDSASparseAttentionContextParallel"),
    "hyper_parallel.core.context_parallel.context_parallel": ("ContextParallel",),
    "hyper_parallel.core.context_parallel.dsa_context_parallel": (
        "DSAIndexerContextParallel", "DSAIndexerLossContextParallel", "DSASequenceReplicateCache",
        "DSASparseAttentionContextParallel"),
    "hyper_parallel.core.device_mesh": ("DeviceMesh", "init_device_mesh"),
    "hyper_parallel.core.distributed_checkpoint": ("get_current_layout", "get_global_layout"),
    "hyper_parallel.core.dtensor": ("DTensor",),
    "hyper_parallel.core.dtensor.dtensor": ("DTensor", "distribute_tensor"),
    "hyper_parallel.core.dtensor.layout": ("_infer_slice_area_by_rank",),
    "hyper_parallel.core.dtensor.placement_types": ("Partial", "Placement", "Replicate", "Shard"),
    "hyper_parallel.core.dtensor.redistribute_infer": ("DevMat", "RedistributionOperatorInfer"),
    "hyper_parallel.core.fully_shard.api": ("HSDPModule", "MixedPrecisionPolicy", "fully_shard"),
    "hyper_parallel.core.fully_shard.utils": ("CPUOffloadPolicy", "OffloadPolicy"),
    "hyper_parallel.core.pipeline_parallel.comm_compute_overlap": ("CommComputeOverlap",),
    "hyper_parallel.core.pipeline_parallel.hook_coordinator": ("HookCoordinator", "HookRole"),
    "hyper_parallel.core.pipeline_parallel.scheduler": ("MetaStepType",),
    "hyper_parallel.core.placement_types": ("Placement", "Replicate", "Shard"),
    "hyper_parallel.core.shard.sharding_plan": ("ShardingPlan",),
    "hyper_parallel.custom_ops.experimental": (
        "npu_dense_lightning_indexer_grad_kl_loss", "npu_dense_lightning_indexer_softmax_lse", "npu_lightning_indexer",
        "npu_lightning_indexer_v2", "npu_mhc_post", "npu_mhc_pre_sinkhorn", "npu_sparse_attn_shared_kv",
        "npu_sparse_flash_mla", "npu_sparse_flash_mla_grad", "npu_sparse_lightning_indexer_grad_kl_loss",
        "npu_sparse_lightning_indexer_grad_kl_loss_v2", "npu_sparse_lightning_indexer_kl_loss_grad"),
    "hyper_parallel.platform": ("get_platform",),
    "hyper_parallel.platform.mindspore.autograd_compat": ("enable_mindspore_backward_compat",),
    "hyper_parallel.platform.mindspore.pipeline_parallel._utils": ("_MicroBatch",),
}


class _Unavailable:
    """Every attribute raises: the platform object of ``get_platform()``."""

    def __getattr__(self, name: str):
        raise NotImplementedError(f"hyper_parallel stand-in: platform.{name} (a parallel path) is not available")


def _stand_in(module: str, name: str) -> object:
    if name == "get_platform":
        return lambda: _Unavailable()
    if name[0].isupper() or name.lstrip("_")[0].isupper():
        return type(name, (), {"__module__": module, "__init__": lambda self, *args, **kwargs: None})

    def unavailable(*args, **kwargs):
        raise NotImplementedError(f"hyper_parallel stand-in: {module}.{name} (a parallel path) is not available")
    unavailable.__name__ = name
    return unavailable


def _fill(module: types.ModuleType) -> None:
    for name in STUBBED.get(module.__name__, ()):
        setattr(module, name, _stand_in(module.__name__, name))


def _is_package(name: str) -> bool:
    return any(other.startswith(name + ".") for other in STUBBED)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the submodules of ``STUBBED`` (and the packages above them), nothing else."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + ".") and (fullname in STUBBED or _is_package(fullname)):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=_is_package(fullname))
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        _fill(module)


sys.meta_path.insert(0, _Finder())
_fill(sys.modules[__name__])
