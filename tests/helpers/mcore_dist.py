"""megatron-core's own dist_checkpointing, as the test oracle of crossalign's torch_dist writer and reader.

The model's sharded state dict is megatron-core's; its local-module norm keys are renamed to TE's
(what a GPU run's model has, and what crossalign writes) with the layout's own alias map, so the
same helpers save and load under the GPU run's keys whatever the layer stacking.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Mapping

import torch

from crossalign.config import ModelConfig, TrainingConfig
from crossalign.sides.megatron.torch_dist import local_aliases


def sharded_state_dict_as_te(net, model: ModelConfig, core_version: str) -> dict:
    """The model's sharded state dict with the metadata Megatron's training passes (its data-parallel group: GPTModel
    needs it to tie the MTP stage's copy of the embedding), the fused norms under TE's keys."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    sharded = net.sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(None))
    renames = local_aliases(model, core_version)
    for value in sharded.values():
        if isinstance(value, ShardedTensor) and value.key in renames:
            value.key = renames[value.key]
    return sharded


@contextlib.contextmanager
def cpu_writer() -> Iterator[None]:
    """megatron-core's writer on the CPU: its device='cuda' literals mapped to the CPU, and no CUDA sync.

    ``FileSystemWriterAsync.preload_tensors`` copies each tensor to the host without blocking and
    then calls ``torch.cuda.synchronize()`` (core_v0.16.1 ``strategies/filesystem_async.py:229``):
    on the CPU the copies are done when they return, and there is nothing to wait for.
    """
    from crossalign.sides.megatron.embedded.mcore_cpu import CudaLiteralsToCpu

    synchronize = torch.cuda.synchronize
    torch.cuda.synchronize = lambda device=None: None
    try:
        with CudaLiteralsToCpu():
            yield
    finally:
        torch.cuda.synchronize = synchronize


def save_sharded(net, folder: Path, model: ModelConfig, core_version: str) -> None:
    """megatron-core's ``dist_checkpointing.save`` of a built model into ``folder`` (inside a process group)."""
    from megatron.core import dist_checkpointing

    with cpu_writer():
        dist_checkpointing.save(sharded_state_dict_as_te(net, model, core_version), str(folder))


def load_sharded(net, folder: Path, model: ModelConfig, core_version: str) -> None:
    """megatron-core's ``dist_checkpointing.load`` of a torch_dist folder into a built model, then its strict
    ``load_state_dict`` (of what it returns less common.pt's entries, which it merges in: Megatron-LM reads the
    checkpoint version and iteration there, beside its model)."""
    from megatron.core import dist_checkpointing

    sharded = sharded_state_dict_as_te(net, model, core_version)
    with cpu_writer():
        loaded = dist_checkpointing.load(sharded, str(folder))
    common = torch.load(Path(folder) / "common.pt", weights_only=True)
    net.load_state_dict({key: value for key, value in loaded.items() if key not in common}, strict=True)


def megatron_core_save(folder: Path, state: Mapping[str, torch.Tensor], model: ModelConfig, core_version: str,
                       dtype: torch.dtype) -> None:
    """A full legacy (TE, TP 1) state saved by megatron-core itself: GPTModel built on the CPU in ``dtype``, the
    state loaded strictly, ``dist_checkpointing.save`` (one gloo process)."""
    from crossalign.sides.megatron.embedded.mcore_cpu import megatron_core_on_cpu
    from crossalign.sides.megatron.embedded.mcore_model import build_gpt_model, load_converted_state

    # Only the dropouts of the training settings reach the model, and alignment fixes them at 0.
    training = TrainingConfig(seq_length=1, global_batch_size=1, train_iters=1, base_train_iters=1, lr=1.0)
    with megatron_core_on_cpu(seed=0):
        net = build_gpt_model(model, training, bf16=dtype == torch.bfloat16)
        net.to(dtype)  # megatron-core's local norms keep fp32 weights in a bf16 model; TE's are in the model's dtype
        load_converted_state(net, state, model, core_version)
        save_sharded(net, folder, model, core_version)
