"""MindFormers "checkpoint 2.0" checkpoints (SPEC section 4): find, read lazily, write.

Layout::

    <root>/latest_checkpointed_iteration.txt          the iteration number
    <root>/iteration_00000010/common.json             training state; pynative resume needs it
    <root>/iteration_00000010/<prefix>-model-0000000-0000001.safetensors
    <root>/iteration_00000010/<prefix>-opt-0000000-0000001.safetensors
    <root>/iteration_00000010/metadata.json           only when more than one rank saved

With several ranks, each rank writes ``<prefix>-model-<rank>-<world>.safetensors`` holding
its own slice of each tensor under the tensor's full name, and ``metadata.json`` says which
slice of which tensor is in which file (``Shards`` below); a reader stitches the slices back.
A bare folder of safetensors files is accepted too (MindFormers loads it the same way).
Tensors are read one at a time, on demand, so that large checkpoints need not fit in memory.

Besides weights, a checkpoint holds optimizer state (``adam_m.*``, ``adam_v.*``,
``global_step``, in the ``-opt-`` files) and buffers: MindFormers' pynative MoE layer keeps
``mlp.tokens_per_expert``, the tokens routed to each expert so far, as a non-trainable
Parameter, so every MoE layer (the MTP layer's too) saves it (mindformers 2.1.0,
``pynative/transformers/moe/moe_layer.py:84``).

Which copy is the weight: from 2.1.0, ``params_dtype: float32`` is partly ignored. The pynative
``Linear`` of the MLPs and the output layer and ``eh_proj``, and ``GroupedMLP``'s experts, are
created in the compute dtype (bf16), so a real save holds those weights in bf16 in the model file,
and their fp32 masters, ``main_param.<name>``, in the ``-opt-`` file (``pynative/optimizer/adamw.py:236``;
seen in a real 2.1.0 save, ``tests/test_mindformers_upstream.py``). The model file's copy is the
master rounded to bf16 after each update. So the weight of such a tensor is read from its master
when the checkpoint has one (``tensor``, ``model_entries``); the bf16 copy is what the model
computed with.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import torch

from crossalign.tensorio.atomic import save_iteration
from crossalign.tensorio.blocks import BlockCaster, ReusedBuffer, RowBlocks
from crossalign.tensorio.errors import CheckpointError
from crossalign.tensorio.safetensors_io import (
    DTYPE_NAMES,
    DTYPES,
    FLOATING,
    SafetensorsWriter,
    TensorInfo,
    read_header,
    read_tensor,
    write_safetensors,
)
from crossalign.tensorio.torch_file import TensorSpec

TRACKER = "latest_checkpointed_iteration.txt"
COMMON = "common.json"
METADATA = "metadata.json"
SAFETENSORS_METADATA = {"format": "ms"}
# MindFormers' pynative CheckpointCallback names files with the `prefix` of the YAML's checkpoint section
# (its default is "checkpoint"); crossalign's generated YAML and its own writers use this one.
DEFAULT_PREFIX = "qwen35"
_ITERATION_DIR = re.compile(r"iteration_(\d{8})")
# Optimizer entries may share a file with the model when a bare folder holds one combined file.
MASTER_PREFIX = "main_param."  # the optimizer's fp32 master of a low-precision weight (see the module docstring)
_OPTIMIZER_PREFIXES = ("adam_m.", "adam_v.", MASTER_PREFIX)
_OPTIMIZER_NAMES = ("learning_rate", "global_step")
# Non-trainable state that MindFormers' model saves beside its weights (see the module docstring).
BUFFER_SUFFIXES = ("mlp.tokens_per_expert",)
# str() of MindSpore's dtypes, as metadata.json's "properties.dtype" holds them.
MINDSPORE_DTYPE_NAMES = {"F32": "Float32", "BF16": "BFloat16", "F16": "Float16", "F64": "Float64",
                         "I64": "Int64", "I32": "Int32", "I16": "Int16", "I8": "Int8", "U8": "UInt8", "BOOL": "Bool"}


def iteration_dir_name(iteration: int) -> str:
    return f"iteration_{iteration:08d}"


def checkpoint_file_name(prefix: str, kind: str, rank: int = 0, world: int = 1) -> str:
    """``<prefix>-model-0000000-0000001.safetensors``: MindFormers' get_checkpoint_name (kind "model" or "opt")."""
    return f"{prefix}-{kind}-{rank:07d}-{world:07d}.safetensors"


def is_optimizer_entry(file: Path, name: str) -> bool:
    """Optimizer files are named ``*-opt-*``; their entries, and Adam moments anywhere, are not model weights."""
    return "-opt-" in file.name or name.startswith(_OPTIMIZER_PREFIXES) or name in _OPTIMIZER_NAMES


def is_buffer(name: str) -> bool:
    """A non-trainable model buffer that MindFormers saves with the weights (not a weight to convert)."""
    return name.endswith(BUFFER_SUFFIXES)


def _read_tracker(root: Path) -> int:
    text = (root / TRACKER).read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{root / TRACKER}: expected an iteration number, found {text!r}")
    return int(text)


@dataclass(frozen=True)
class Piece:
    """Part of a tensor as one file stores it: the stored tensor, and where it starts along each axis of the whole."""

    file: Path
    info: TensorInfo
    start: tuple[int, ...]


@dataclass
class MindFormersCheckpoint:
    """A MindFormers checkpoint on disk: its folder, and what its headers (and metadata.json) say.

    ``entries`` gives each tensor's name, dtype and whole shape; ``pieces`` where its parts are
    stored: one piece for a single-rank save, one per slice when ranks saved their shards.
    """

    directory: Path
    iteration: int | None
    common: dict | None
    tracker_root: Path | None
    entries: dict[str, TensorInfo] = field(repr=False)
    pieces: dict[str, tuple[Piece, ...]] = field(repr=False)
    files: list[Path] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        """How many ranks saved it: one model file each, with metadata.json (written only when more than one did)."""
        return len(self.model_files) if (self.directory / METADATA).exists() else 1

    @property
    def model_files(self) -> list[Path]:
        return [file for file in self.files if "-opt-" not in file.name]

    def _is_optimizer(self, name: str) -> bool:
        return is_optimizer_entry(self.pieces[name][0].file, name)

    def master(self, name: str) -> str:
        """The entry that holds weight ``name``: its fp32 master ``main_param.<name>`` when saved, else itself."""
        return MASTER_PREFIX + name if MASTER_PREFIX + name in self.entries else name

    def model_entries(self) -> dict[str, TensorInfo]:
        """The model's weights (neither optimizer state nor buffers), each as its master holds it."""
        return {name: TensorInfo(name, self.entries[self.master(name)].dtype, info.shape)
                for name, info in self.entries.items() if not self._is_optimizer(name) and not is_buffer(name)}

    def buffer_entries(self) -> dict[str, TensorInfo]:
        return {name: info for name, info in self.entries.items() if not self._is_optimizer(name) and is_buffer(name)}

    def optimizer_entries(self) -> dict[str, TensorInfo]:
        return {name: info for name, info in self.entries.items() if self._is_optimizer(name)}

    def tensor(self, name: str, floating_dtype: torch.dtype | None = None,
               buffer: ReusedBuffer | None = None) -> torch.Tensor:
        """One whole tensor (stitched from its slices); a floating one is converted to ``floating_dtype`` when given.

        A model weight with an fp32 master is read from the master. It is read into ``buffer`` when
        given, and valid only until the buffer is used again.
        """
        if name not in self.entries:
            raise CheckpointError(f"{self.directory}: no tensor {name!r}")
        if not self._is_optimizer(name):
            name = self.master(name)
        info, pieces = self.entries[name], self.pieces[name]
        dtype = floating_dtype if floating_dtype is not None and info.dtype in FLOATING else None
        if len(pieces) == 1 and pieces[0].info.shape == info.shape:
            return read_tensor(pieces[0].file, pieces[0].info, dtype, buffer)
        target_dtype = dtype or DTYPES[info.dtype]
        whole = buffer.view(info.shape, target_dtype) if buffer is not None else torch.empty(info.shape,
                                                                                           dtype=target_dtype)
        for piece in pieces:
            where = tuple(slice(start, start + size) for start, size in zip(piece.start, piece.info.shape))
            whole[where].copy_(read_tensor(piece.file, piece.info, dtype))
        return whole

    def model_state(self) -> dict[str, torch.Tensor]:
        """Model weights only (no optimizer entries, no buffers), all loaded."""
        return {name: self.tensor(name) for name in self.model_entries()}

    def buffer_state(self) -> dict[str, torch.Tensor]:
        return {name: self.tensor(name) for name in self.buffer_entries()}

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        return {name: self.tensor(name) for name in self.optimizer_entries()}


def find_checkpoint_dir(path: Path) -> tuple[Path, int | None, Path | None]:
    """The folder holding the safetensors files, its iteration, and the root with the tracker (if any)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a folder (a MindFormers checkpoint is a folder)")
    if (path / "model.safetensors.index.json").exists() or (path / "model.safetensors").exists():
        raise CheckpointError(f"{path}: a Hugging Face checkpoint, not a MindFormers one")
    if (path / TRACKER).exists():
        iteration = _read_tracker(path)
        directory = path / iteration_dir_name(iteration)
        if not directory.is_dir():
            raise CheckpointError(f"{path / TRACKER} names iteration {iteration}, but {directory} does not exist")
        return directory, iteration, path
    match = _ITERATION_DIR.fullmatch(path.name)
    return path, (int(match.group(1)) if match else None), None


def _whole_files(directory: Path, headers: dict[Path, list[TensorInfo]]
                 ) -> tuple[dict[str, TensorInfo], dict[str, tuple[Piece, ...]]]:
    """Without metadata.json every file holds whole tensors, each stored once (as MindFormers' loader reads it)."""
    entries: dict[str, TensorInfo] = {}
    pieces: dict[str, tuple[Piece, ...]] = {}
    for file, infos in headers.items():
        for info in infos:
            if info.name in entries:
                raise CheckpointError(f"tensor {info.name!r} is stored twice: in {pieces[info.name][0].file} and in "
                                      f"{file}")
            entries[info.name] = TensorInfo(info.name, info.dtype, info.shape)
            pieces[info.name] = (Piece(file, info, (0,) * len(info.shape)),)
    return entries, pieces


def _slice_start(slice_id: int, fragments: tuple[int, ...], local: tuple[int, ...]) -> tuple[int, ...]:
    """Where slice ``slice_id`` starts: MindFormers numbers the slices of a tensor row-major over its fragments."""
    index = []
    for count in reversed(fragments):
        index.append(slice_id % count)
        slice_id //= count
    return tuple(i * size for i, size in zip(reversed(index), local))


def _sharded_files(directory: Path, headers: dict[Path, list[TensorInfo]]
                   ) -> tuple[dict[str, TensorInfo], dict[str, tuple[Piece, ...]]]:
    """Every tensor of metadata.json with the file and place of each of its slices.

    The format is MindFormers' (2.1.0 ``checkpoint/metadata.py: save_metadata``, read by
    ``load_metadata`` and ``ReshardLoader``): ``state_dict_metadata`` gives per tensor its
    ``global_shape``, ``axis_fragmentations`` (slices per axis) and ``chunk``s, each
    ``{"global_offset": [slice id], "local_shape"}``; ``storage_data`` maps
    ``str((name, (slice id,)))`` to the files holding that slice (several when ranks hold
    copies). Slices must tile the tensor exactly, and every tensor of a model file must be
    described; optimizer files may hold more (they are not converted).
    """
    path = directory / METADATA
    try:
        metadata = json.loads(path.read_text())
        described, storage = metadata["state_dict_metadata"], metadata["storage_data"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: not MindFormers metadata ({type(exc).__name__}: {exc})") from None
    by_name = {file.name: file for file in headers}
    stored = {file: {info.name: info for info in infos} for file, infos in headers.items()}
    entries: dict[str, TensorInfo] = {}
    pieces: dict[str, tuple[Piece, ...]] = {}
    for name, meta in described.items():
        shape, fragments = tuple(meta["global_shape"]), tuple(meta["axis_fragmentations"])
        if len(fragments) != len(shape) or any(f < 1 or size % f for size, f in zip(shape, fragments)):
            raise CheckpointError(f"{path}: {name!r} of shape {list(shape)} cannot be cut into {list(fragments)} "
                                  "slices")
        local = tuple(size // f for size, f in zip(shape, fragments))
        found: dict[int, Piece] = {}
        for chunk in meta["chunk"]:
            offset = tuple(chunk["global_offset"])
            if tuple(chunk["local_shape"]) != local or len(offset) != 1 or not 0 <= offset[0] < math.prod(fragments):
                raise CheckpointError(f"{path}: {name!r}: chunk {chunk} does not fit shape {list(shape)} cut into "
                                      f"{list(fragments)}")
            holders = storage.get(str((name, offset)))
            if not holders:
                raise CheckpointError(f"{path}: no storage_data entry for slice {offset[0]} of {name!r}")
            file = by_name.get(holders[0]["file_name"])
            if file is None:
                raise CheckpointError(f"{path}: {name!r} is in {holders[0]['file_name']}, which is missing")
            info = stored[file].get(name)
            if info is None or info.shape != local:
                got = "nothing" if info is None else f"shape {list(info.shape)}"
                raise CheckpointError(f"{file}: expected slice {list(local)} of {name!r}, found {got}")
            found[offset[0]] = Piece(file, info, _slice_start(offset[0], fragments, local))
        if len(found) != math.prod(fragments):
            raise CheckpointError(f"{path}: {name!r} has {len(found)} of its {math.prod(fragments)} slices")
        dtypes = {piece.info.dtype for piece in found.values()}
        if len(dtypes) != 1:
            raise CheckpointError(f"{path}: the slices of {name!r} have different dtypes {sorted(dtypes)}")
        entries[name] = TensorInfo(name, dtypes.pop(), shape)
        pieces[name] = tuple(found[i] for i in sorted(found))
    for file, infos in stored.items():
        extra = [name for name in infos if name not in described]
        if extra and "-opt-" not in file.name:
            raise CheckpointError(f"{file}: tensor {extra[0]!r} is not described in {path}")
    return entries, pieces


def read_mindformers_checkpoint(path: Path) -> MindFormersCheckpoint:
    """Open a checkpoint given its root (with the tracker), an ``iteration_%08d`` folder or a bare folder.

    Every safetensors header (and metadata.json, when ranks saved shards) is read and checked
    (a truncated file is an error here, before any conversion starts); tensors themselves are
    loaded only when asked for. The ``iteration_%08d`` layout requires ``common.json``, as
    MindFormers' pynative resume does.
    """
    directory, iteration, root = find_checkpoint_dir(Path(path))
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no .safetensors files")
    common = None
    if (directory / COMMON).exists():
        try:
            common = json.loads((directory / COMMON).read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{directory / COMMON}: not valid JSON ({exc})") from None
    elif iteration is not None:
        raise CheckpointError(f"{directory}: {COMMON} is missing (the iteration_%08d layout requires it)")
    headers = {file: read_header(file)[0] for file in files}
    if (directory / METADATA).exists():
        entries, pieces = _sharded_files(directory, headers)
    else:
        entries, pieces = _whole_files(directory, headers)
    return MindFormersCheckpoint(directory=directory, iteration=iteration, common=common, tracker_root=root,
                                 entries=entries, pieces=pieces, files=files)


def default_common(global_step: int, global_batch_size: int | None = None, total_steps: int | None = None) -> dict:
    """``common.json`` as MindFormers' pynative CheckpointCallback writes it (2.1.0 ``_create_common_info``).

    ``step_num`` is the run's total number of steps (``state.max_steps``), not the iteration
    saved; ``global_step`` is the steps done. Without ``total_steps`` (a checkpoint made
    outside a run, e.g. converted) the iteration stands for both. ``consumed_samples`` is 0
    when the batch size is not known, as MindFormers writes it for a state without one.
    """
    return {
        "epoch_num": 1,
        "step_num": global_step if total_steps is None else total_steps,
        "global_step": global_step,
        "loss_scale": 1.0,
        "global_batch_size": global_batch_size,
        "consumed_samples": 0 if global_batch_size is None else global_step * global_batch_size,
        "ckpt_status": None,
    }


SplitDim = Callable[[str, tuple[int, ...]], int | None]  # the axis a tensor is cut along over ranks, or None


def _slice(tensor: torch.Tensor, dim: int | None, rank: int, world: int) -> torch.Tensor:
    return tensor if dim is None else tensor.chunk(world, dim=dim)[rank].contiguous()


def _layout(ndim: int, dim: int | None, world: int) -> dict:
    """MindSpore's ``Layout.to_dict()`` for a 1-D device mesh "tp" of ``world`` ranks, keys in its order.

    MindFormers' load_metadata unpacks the values in this order (device_matrix, tensor_map,
    interleaved_parallel, alias_name, rank_list). A tensor_map entry names the mesh axis an
    array axis is cut along, counted from the right (0 = "tp"), or -1 for none.
    """
    return {"device_matrix": [world], "tensor_map": [0 if axis == dim else -1 for axis in range(ndim)],
            "interleaved_parallel": False, "alias_name": ["tp"], "rank_list": list(range(world))}


def sharded_metadata(specs: Mapping[str, TensorSpec], split_dim: SplitDim, world: int, prefix: str) -> dict:
    """metadata.json for tensors of ``specs`` (shape, dtype) saved by ``world`` ranks, each cut along ``split_dim``
    or held whole by all.

    In MindFormers' format (see ``_sharded_files``): a cut tensor has slice r on rank r; a
    whole one has slice 0 on every rank, rank r holding replica r.
    """
    described, storage = {}, {}
    files = [checkpoint_file_name(prefix, "model", rank, world) for rank in range(world)]
    for name, spec in specs.items():
        shape = tuple(spec.shape)
        dim = split_dim(name, shape)
        fragments = [world if axis == dim else 1 for axis in range(len(shape))]
        local = [size // f for size, f in zip(shape, fragments)]
        slices = list(range(world)) if dim is not None else [0] * world
        described[name] = {
            "properties": {"dtype": MINDSPORE_DTYPE_NAMES[DTYPE_NAMES[spec.dtype]],
                           "replica_id": [0] * world if dim is not None else list(range(world)),
                           "allow_shape_mismatch": False, "allow_to_save": True},
            "global_shape": list(shape),
            "axis_fragmentations": fragments,
            "layout": _layout(len(shape), dim, world),
            "chunk": [{"global_offset": [s], "local_shape": local} for s in sorted(set(slices))],
        }
        for rank, s in enumerate(slices):
            group = [r for r, other in enumerate(slices) if other == s]
            storage.setdefault(str((name, (s,))), []).append(
                {"file_name": files[rank], "storage_rank": rank, "rank_group": group})
    return {"state_dict_metadata": described, "storage_data": storage}


def _split_dims(specs: Mapping[str, TensorSpec], split_dim: SplitDim, world: int) -> dict[str, int | None]:
    """The axis each tensor is cut along over ``world`` ranks; one that does not divide evenly is named."""
    dims = {}
    for name, spec in specs.items():
        dim = dims[name] = split_dim(name, tuple(spec.shape))
        if dim is not None and spec.shape[dim] % world:
            raise CheckpointError(f"{name!r}: axis {dim} of shape {list(spec.shape)} does not split over "
                                  f"{world} ranks")
    return dims


def _fill_iteration_dir(directory: Path, model: Mapping[str, torch.Tensor],
                        optimizer: Mapping[str, torch.Tensor] | None, common: dict, prefix: str,
                        split_dim: SplitDim | None, world: int) -> None:
    if world == 1:
        write_safetensors(directory / checkpoint_file_name(prefix, "model"), model, SAFETENSORS_METADATA)
    else:
        specs = {name: TensorSpec(tuple(tensor.shape), tensor.dtype) for name, tensor in model.items()}
        dims = _split_dims(specs, split_dim, world)
        for rank in range(world):
            write_safetensors(directory / checkpoint_file_name(prefix, "model", rank, world),
                              {name: _slice(tensor, dims[name], rank, world) for name, tensor in model.items()},
                              SAFETENSORS_METADATA)
        (directory / METADATA).write_text(json.dumps(sharded_metadata(specs, split_dim, world, prefix),
                                                     ensure_ascii=False, separators=(",", ":")))
    if optimizer is not None:
        write_safetensors(directory / checkpoint_file_name(prefix, "opt"), optimizer, SAFETENSORS_METADATA)
    (directory / COMMON).write_text(json.dumps(common, ensure_ascii=False, indent=4))


def write_mindformers_checkpoint(root: Path, iteration: int, model: Mapping[str, torch.Tensor],
                                 optimizer: Mapping[str, torch.Tensor] | None, common: dict,
                                 prefix: str = DEFAULT_PREFIX, *, world: int = 1,
                                 split_dim: SplitDim | None = None) -> Path:
    """Save one iteration in the checkpoint 2.0 layout; returns the iteration folder.

    With ``world`` > 1 the model is saved as that many ranks would save it: rank r's file
    holds slice r of every tensor that ``split_dim`` cuts (and all of the others), and
    metadata.json describes the slices, so MindFormers' loader (or ``read_mindformers_checkpoint``)
    puts them back together for any layout it runs with.

    A new root is built whole in a temporary sibling and renamed into place. An existing
    root (earlier saves of the same run) gets the new iteration folder the same way, then
    its tracker is replaced, so a reader always finds a complete iteration.
    """
    if world < 1 or (world > 1 and (split_dim is None or optimizer is not None)):
        raise CheckpointError(f"a save by {world} ranks needs split_dim and no optimizer state")
    return save_iteration(root, iteration_dir_name(iteration), iteration, TRACKER,
                          lambda folder: _fill_iteration_dir(folder, model, optimizer, common, prefix, split_dim,
                                                             world))


def stream_mindformers_checkpoint(root: Path, iteration: int, specs: Mapping[str, TensorSpec],
                                  tensors: Iterable[tuple[str, torch.Tensor | RowBlocks]], common: dict,
                                  prefix: str = DEFAULT_PREFIX, *, world: int = 1,
                                  split_dim: SplitDim | None = None) -> Path:
    """Save a model given tensor by tensor, as ``write_mindformers_checkpoint`` saves it (byte for byte).

    ``specs`` announces every tensor (name, whole shape, stored dtype) in the order ``tensors``
    then yields them, each consumed before the next is asked for; a floating tensor of another
    floating dtype (or a view) goes through a row block buffer, cast on the way; a ``RowBlocks``
    is written block by block as it comes. With ``world`` > 1 the ``world`` rank files are laid
    out from the specs before any tensor comes and are all open at once: each tensor is cut
    along ``split_dim`` and each rank's slice written to its file (a ``RowBlocks`` must be cut
    along its rows, which go to the ranks they belong to as they come); metadata.json follows.
    So memory holds one tensor (or block) at a time however large the model. Returns the
    iteration folder.
    """
    if world < 1 or (world > 1 and split_dim is None):
        raise CheckpointError(f"a save by {world} ranks needs split_dim")
    dims = {name: None for name in specs} if world == 1 else _split_dims(specs, split_dim, world)
    infos: list[list[TensorInfo]] = [[] for _ in range(world)]
    for name, spec in specs.items():
        if spec.dtype not in DTYPE_NAMES:
            raise CheckpointError(f"tensor {name!r} has dtype {spec.dtype}, which safetensors cannot store")
        dim = dims[name]
        local = spec.shape if dim is None else tuple(size // world if axis == dim else size
                                                     for axis, size in enumerate(spec.shape))
        for rank_infos in infos:
            rank_infos.append(TensorInfo(name, DTYPE_NAMES[spec.dtype], local))

    def fill(directory: Path) -> None:
        caster = BlockCaster()
        names = ([checkpoint_file_name(prefix, "model")] if world == 1 else
                 [checkpoint_file_name(prefix, "model", rank, world) for rank in range(world)])
        with contextlib.ExitStack() as files:
            writers = [files.enter_context(SafetensorsWriter(directory / file, rank_infos, SAFETENSORS_METADATA))
                       for file, rank_infos in zip(names, infos)]
            for name, tensor in tensors:
                if name not in specs:
                    raise CheckpointError(f"{directory}: tensor {name!r} was not announced")
                spec, dim = specs[name], dims[name]
                if isinstance(tensor, RowBlocks):  # a tensor too large to hand over whole
                    blocks = (_stored(block, spec, caster) for block in tensor)
                    if world == 1:
                        writers[0].write_blocks(name, blocks)
                    elif dim == 0:
                        _write_rows_by_rank(writers, name, spec.shape[0] // world, blocks)
                    else:  # its blocks come once: they cannot go whole to every rank, nor be cut across their rows
                        how = "whole on each" if dim is None else f"cut along axis {dim}"
                        raise CheckpointError(f"{name!r} comes in row blocks, so {world} ranks can save it only cut "
                                              f"along its rows, not {how}")
                    continue
                for rank, writer in enumerate(writers):
                    part = tensor if dim is None else tensor.chunk(world, dim=dim)[rank]
                    castable = part.is_floating_point() and spec.dtype.is_floating_point
                    if castable and (part.dtype != spec.dtype or not part.is_contiguous()):
                        writer.write_blocks(name, caster.rows(part, spec.dtype))
                    else:
                        writer.write(name, part)
        if world > 1:
            (directory / METADATA).write_text(json.dumps(sharded_metadata(specs, split_dim, world, prefix),
                                                         ensure_ascii=False, separators=(",", ":")))
        (directory / COMMON).write_text(json.dumps(common, ensure_ascii=False, indent=4))
    return save_iteration(root, iteration_dir_name(iteration), iteration, TRACKER, fill)


def _stored(block: torch.Tensor, spec: TensorSpec, caster: BlockCaster) -> torch.Tensor:
    """A row block as the file stores it: cast to the announced dtype (and made contiguous) through the caster."""
    if block.dtype == spec.dtype and block.is_contiguous():
        return block
    return next(caster.cast_blocks([block], spec.dtype))


def _write_rows_by_rank(writers: list[SafetensorsWriter], name: str, rows_per_rank: int,
                        blocks: Iterable[torch.Tensor]) -> None:
    """Consecutive row blocks of a tensor cut on its rows, each rank's rows written to its file as they come.

    A block that straddles a rank boundary is cut there; rank r's writer takes its pieces
    while they come (each valid until the next is asked for), then rank r+1's.
    """
    def pieces() -> Iterator[tuple[int, torch.Tensor]]:
        start = 0
        for block in blocks:
            at = 0
            while at < len(block):
                rank = (start + at) // rows_per_rank
                stop = min(len(block), (rank + 1) * rows_per_rank - start)
                yield rank, block[at:stop]
                at = stop
            start += len(block)

    ranks = []
    for rank, group in itertools.groupby(pieces(), key=lambda item: item[0]):
        if rank >= len(writers) or rank in ranks:
            raise CheckpointError(f"{name!r}: more rows than announced for {len(writers)} ranks of "
                                  f"{rows_per_rank} rows")
        ranks.append(rank)
        writers[rank].write_blocks(name, (piece for _, piece in group))
    if ranks != list(range(len(writers))):
        raise CheckpointError(f"{name!r}: rows came for ranks {ranks}, not for all {len(writers)}")
