"""Megatron's ``--ckpt-format torch_dist`` checkpoints (the default of recent Megatron): read them, and write them.

Layout (core_v0.16.1 ``megatron/core/dist_checkpointing``)::

    <root>/latest_checkpointed_iteration.txt
    <root>/iter_0000010/metadata.json         {"sharded_backend": "torch_dist", ...}
    <root>/iter_0000010/.metadata             torch.distributed.checkpoint's index
    <root>/iter_0000010/__0_0.distcp ...      the data, in any number of files
    <root>/iter_0000010/common.pt             what is not sharded

Every tensor is stored once as the whole model's tensor (its global shape), whatever layout
saved it, so a load at any TP/PP/EP cuts out its own slices: Megatron reshards at load. The
keys are the model's ``sharded_state_dict()`` keys, which differ from the legacy state dict's
in three ways, undone by :func:`torch_dist_plan` and redone by megatron-core's own writer:

* GatedDeltaNet's in_proj and conv1d are stored as their parts: ``in_proj.weight.query``,
  ``.key``, ``.value``, ``.z``, ``.beta``, ``.alpha``; ``conv1d.weight.query``, ``.key``, ``.value``
  (``megatron/core/ssm/gated_delta_net.py``, ``sharded_state_dict``);
* routed experts are one tensor per layer, ``mlp.experts.experts.linear_fc1.weight`` [E, 2i, H],
  the same for TE's grouped and the local sequential experts (``moe/experts.py``: "The sharded
  state dict is interchangable with SequentialMLP's"), which is crossalign's stacked form;
* a model built with megatron-core's local modules names the fused norms as local modules
  (``input_layernorm.weight``); a TE model as TE does (``self_attention.linear_qkv.layer_norm_weight``).
  Both are read; crossalign writes TE's names (``te_local.py``), the GPU run's.

Reading needs no process group and no model: ``torch.distributed.checkpoint`` loads the whole
tensors of the model keys one at a time (``DistTensor``), as the merge path (``merge.py``) asks
for them (optimizer state, RNG state and TE ``_extra_state`` are left out).
Writing builds megatron-core's GPTModel on the CPU (one process, gloo), loads the converted
legacy state into it strictly and calls megatron-core's ``dist_checkpointing.save``: the file
format is megatron-core's own, not a copy of it. That holds the model in memory once, in the
stored dtype.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Iterator, Mapping

import torch

from crossalign.sides.megatron.merge import FullTensor
from crossalign.tensorio.blocks import ReusedBuffer
from crossalign.tensorio.errors import CheckpointError
from crossalign.sides.megatron.te_local import local_to_te_names
from crossalign.config import ModelConfig

METADATA = "metadata.json"
BACKEND = "torch_dist"
MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.", "mtp.")
GDN_PARTS = {"in_proj.weight": ("query", "key", "value", "z", "beta", "alpha"),
             "conv1d.weight": ("query", "key", "value")}
_PART = re.compile(r"(.*\.self_attention\.(?:in_proj|conv1d)\.weight)\.(\w+)")
_GROUPED_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.experts\.(linear_fc[12]\.weight)")


def is_torch_dist(directory: Path) -> bool:
    """Whether an iteration folder holds a torch_dist checkpoint (its metadata.json names the backend)."""
    file = Path(directory) / METADATA
    if not file.exists():
        return False
    try:
        backend = json.loads(file.read_text()).get("sharded_backend")
    except (OSError, ValueError, AttributeError):
        raise CheckpointError(f"{file}: not the JSON object a distributed checkpoint's metadata.json is") from None
    if backend != BACKEND:
        raise CheckpointError(f"{file}: sharded_backend {backend!r}; only {BACKEND!r} checkpoints are read")
    return True


class DistTensor:
    """One tensor of a torch_dist folder under its sharded key, read whole by ``torch.distributed.checkpoint``.

    ``dcp.load`` of that key alone reads its chunks (one, or one per rank that saved it) into
    the target, so the folder is read a tensor at a time.
    """

    def __init__(self, reader, key: str, shape: tuple[int, ...], dtype: torch.dtype, directory: Path):
        self.reader, self.key, self.shape, self.dtype = reader, key, shape, dtype
        self.where = f"{directory}: {key}"

    def read(self, buffer: ReusedBuffer | None = None) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp  # heavy, and only a torch_dist folder needs it

        out = buffer.view(self.shape, self.dtype) if buffer is not None else torch.empty(self.shape, dtype=self.dtype)
        try:
            dcp.load({self.key: out}, storage_reader=self.reader, no_dist=True)
        except Exception as exc:  # a missing or truncated .distcp file raises whatever its reader meets
            raise CheckpointError(f"{self.where}: cannot be read ({exc})") from None
        return out


def _reader(directory: Path):
    """A ``FileSystemReader`` that reads the index ``.metadata`` once (``dcp.load`` asks for it on every call)."""
    import torch.distributed.checkpoint as dcp  # heavy, and only a torch_dist folder needs it

    class _Reader(dcp.FileSystemReader):
        _metadata = None

        def read_metadata(self):
            if self._metadata is None:
                self._metadata = super().read_metadata()
            return self._metadata

    return _Reader(str(directory))


def torch_dist_plan(directory: Path, model: ModelConfig, core_version: str) -> dict[str, FullTensor]:
    """Every model tensor of a torch_dist folder under its legacy TE key at TP 1 (routed experts stacked), as
    the parts it is read from; nothing is read but the index.

    Optimizer state, RNG state and TE ``_extra_state`` are left out.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # as above: torch_dist folders only

    reader = _reader(directory)
    try:
        metadata = reader.read_metadata()
    except Exception as exc:  # a missing or foreign .metadata raises whatever its unpickling meets
        raise CheckpointError(f"{directory}: cannot read the torch_dist index .metadata ({exc})") from None
    renames = local_to_te_names(model, core_version)
    parts: dict[str, dict[str, DistTensor]] = {}
    tensors: dict[str, FullTensor] = {}
    for key, info in metadata.state_dict_metadata.items():
        if not isinstance(info, TensorStorageMetadata) or not key.startswith(MODEL_PREFIXES):
            continue
        tensor = DistTensor(reader, key, tuple(info.size), info.properties.dtype, directory)
        part = _PART.fullmatch(key)
        if part:
            parts.setdefault(part.group(1), {})[part.group(2)] = tensor
            continue
        grouped = _GROUPED_EXPERTS.fullmatch(key)
        tensors[f"{grouped.group(1)}.{grouped.group(2)}" if grouped else renames.get(key, key)] = FullTensor(
            ((tensor,),))
    if not tensors and not parts:
        raise CheckpointError(f"{directory}: the torch_dist checkpoint holds no model tensors")
    for key, pieces in parts.items():
        names = GDN_PARTS[key.rsplit(".", 2)[-2] + ".weight"]
        if set(pieces) != set(names):
            raise CheckpointError(f"{key}: torch_dist parts {sorted(pieces)}, expected {list(names)}")
        tensors[key] = FullTensor(tuple((pieces[name],) for name in names))  # the parts' rows, in this order
    return tensors


def _sharded_state_dict(net) -> dict:
    """The model's sharded state dict with the metadata Megatron's training passes (its data-parallel group):
    GPTModel needs it to tie the MTP stage's copy of the embedding when that stage is not the first."""
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    return net.sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(None))


def _sharded_keys_as_te(sharded: dict, model: ModelConfig, core_version: str) -> dict:
    """The local model's sharded state dict with the fused norms under TE's keys (what a GPU run loads)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    renames = local_to_te_names(model, core_version)
    for value in sharded.values():
        if isinstance(value, ShardedTensor) and value.key in renames:
            value.key = renames[value.key]
    return sharded


@contextlib.contextmanager
def _cpu_writer() -> Iterator[None]:
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
    """megatron-core's ``dist_checkpointing.save`` of a built model into ``folder``, norms under TE's keys.

    Runs inside ``megatron_core_on_cpu`` (or any process group of the model's layout).
    """
    from megatron.core import dist_checkpointing

    with _cpu_writer():
        dist_checkpointing.save(_sharded_keys_as_te(_sharded_state_dict(net), model, core_version), str(folder))


def load_sharded(net, folder: Path, model: ModelConfig, core_version: str) -> None:
    """megatron-core's ``dist_checkpointing.load`` of a torch_dist folder into a built model (any layout)."""
    from megatron.core import dist_checkpointing

    sharded = _sharded_keys_as_te(_sharded_state_dict(net), model, core_version)
    with _cpu_writer():
        loaded = dist_checkpointing.load(sharded, str(folder))
    net.load_state_dict(loaded, strict=True)


def fill_torch_dist(folder: Path, state: Mapping[str, torch.Tensor], model: ModelConfig, core_version: str,
                    dtype: torch.dtype) -> None:
    """Save a full legacy (TE, TP 1) state dict into an iteration folder with megatron-core's own writer.

    The model is built in ``dtype`` (fp32 or bf16) and loaded strictly, so a key or shape that
    megatron-core's model does not have is named before anything is written.
    """
    from crossalign.sides.megatron.embedded.mcore_cpu import megatron_core_on_cpu
    from crossalign.sides.megatron.embedded.mcore_model import McoreLoadError, build_gpt_model, load_converted_state
    from crossalign.config import TrainingConfig

    if dtype not in (torch.float32, torch.bfloat16):
        raise CheckpointError(f"torch_dist is written in fp32 or bf16, not {dtype}")
    # Only the dropouts of the training settings reach the model, and alignment fixes them at 0.
    training = TrainingConfig(seq_length=1, global_batch_size=1, train_iters=1, base_train_iters=1, lr=1.0)
    with megatron_core_on_cpu(seed=0):
        net = build_gpt_model(model, training, bf16=dtype == torch.bfloat16)
        net.to(dtype)  # megatron-core's local norms keep fp32 weights in a bf16 model; TE's are in the model's dtype
        try:
            load_converted_state(net, state, model, core_version)
        except McoreLoadError as exc:
            raise CheckpointError(str(exc)) from None
        save_sharded(net, folder, model, core_version)
