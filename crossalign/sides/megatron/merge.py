"""The one merge path of a sharded Megatron checkpoint: each tensor of the full model, from what its ranks hold.

A checkpoint of any layout (TP x PP x EP legacy rank files, a torch_dist folder, or rank
states already in memory) is described as a ``merge_plan``: for every key of the full model
(TP 1, layers numbered globally, experts numbered globally) a ``FullTensor`` that says which
parts make it and which copies must agree with them. Nothing is read to make the plan.
``MergedModel`` then reads one full tensor at a time, into a buffer the caller keeps, and
checks each copy bit for bit on a thread of its own: so a conversion holds one tensor, not
the model, and the in-memory readers (``read_megatron_checkpoint``, the diagnosis) are the
same path with every tensor kept.

The layout rules are Megatron's (``sharding.py``): tensor-parallel parts are joined segment
by segment (``Partition``); pipeline stages renumber their layers from 0 and the MTP stage
holds a copy of the embedding; expert-parallel rank e holds global experts e*E/EP ... as its
local 0 ..., stacked experts as a block of rows; tensor ranks beyond the expert tensor group
hold copies of rank t % etp's expert slice; the non-expert model is the same on every EP
rank. Every check names the missing, duplicated or misplaced shard.
"""

from __future__ import annotations

import math
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Protocol

import torch

from crossalign.config import ModelConfig
from crossalign.sides.megatron.sharding import (
    REPLICATED,
    Partition,
    Rank,
    partition_of,
    routed_expert_index,
)
from crossalign.tensorio.blocks import ReusedBuffer
from crossalign.tensorio.errors import CheckpointError

_LAYER_KEY = re.compile(r"decoder\.layers\.(\d+)\.(.*)")


class Part(Protocol):
    """One tensor as a rank holds it: its shape and dtype known up front, its data read on demand."""

    @property
    def where(self) -> str: ...  # the file (or rank) that holds it, for errors

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def read(self, buffer: ReusedBuffer | None = None) -> torch.Tensor: ...


@dataclass(frozen=True)
class HeldTensor:
    """A part already in memory (a rank state loaded whole); ``read`` hands out the tensor itself."""

    tensor: torch.Tensor
    where: str

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def read(self, buffer: ReusedBuffer | None = None) -> torch.Tensor:
        return self.tensor


@dataclass(frozen=True)
class Replica:
    """A copy that must equal ``reference`` bit for bit; ``error`` is raised when it does not."""

    reference: Part
    copy: Part
    error: str


@dataclass(frozen=True)
class FullTensor:
    """One tensor of the full model: consecutive row blocks, each the tensor-parallel parts joined by ``partition``."""

    blocks: tuple[tuple[Part, ...], ...]
    partition: Partition = REPLICATED
    replicas: tuple[Replica, ...] = ()

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks[0][0].dtype

    def _block_shape(self, parts: tuple[Part, ...]) -> tuple[int, ...]:
        shape = list(parts[0].shape)
        if len(parts) > 1:
            shape[self.partition.dim] *= len(parts)
        return tuple(shape)

    @property
    def shape(self) -> tuple[int, ...]:
        first = self._block_shape(self.blocks[0])
        if len(self.blocks) == 1:
            return first
        return (sum(self._block_shape(parts)[0] for parts in self.blocks), *first[1:])

    @property
    def nbytes(self) -> int:
        return sum(math.prod(part.shape) * part.dtype.itemsize for parts in self.blocks for part in parts)

    def read(self, buffer: ReusedBuffer | None = None, scratch: ReusedBuffer | None = None) -> torch.Tensor:
        """The whole tensor, into ``buffer`` when given; parts pass through ``scratch`` when they must be joined."""
        if len(self.blocks) == 1 and len(self.blocks[0]) == 1:
            return self.blocks[0][0].read(buffer)
        out = buffer.view(self.shape, self.dtype) if buffer is not None else torch.empty(self.shape, dtype=self.dtype)
        scratch = scratch or ReusedBuffer()
        row = 0
        for parts in self.blocks:
            rows = self._block_shape(parts)[0]
            target = out[row:row + rows]
            if len(parts) == 1:
                target.copy_(parts[0].read(scratch))
            else:
                self._join(target, parts, scratch)
            row += rows
        return out

    def _join(self, target: torch.Tensor, parts: tuple[Part, ...], scratch: ReusedBuffer) -> None:
        """Each rank's slice of every segment into its place (the inverse of ``sharding.split_tensor``)."""
        dim = self.partition.dim
        starts = [0]
        for size in self.partition.sizes(target.shape[dim])[:-1]:
            starts.append(starts[-1] + size)
        for rank, part in enumerate(parts):
            shard = part.read(scratch)
            offset = 0
            for start, size in zip(starts, self.partition.sizes(shard.shape[dim])):
                target.narrow(dim, start + rank * size, size).copy_(shard.narrow(dim, offset, size))
                offset += size


def _same(reference: torch.Tensor, copy: torch.Tensor) -> bool:
    return reference is copy or (reference.shape == copy.shape and reference.dtype == copy.dtype
                                 and torch.equal(reference, copy))


class MergedModel:
    """The full model of a sharded checkpoint, read a tensor at a time by its plan; use it in a ``with`` block.

    ``tensor(key, buffer)`` reads one full tensor (into ``buffer`` when given: valid until the
    buffer is used again) and queues the checks of its copies on a thread with buffers of its
    own; ``check_replicas`` waits for them and raises the first difference, and must be called
    before anything made from the tensors is kept.
    """

    def __init__(self, directory: Path, iteration: int, tensors: dict[str, FullTensor], tp: int, pp: int, ep: int,
                 format: str = "torch"):
        self.directory, self.iteration, self.tp, self.pp, self.ep, self.format = directory, iteration, tp, pp, ep, format
        self.tensors = tensors
        self._scratch = ReusedBuffer()
        self._checker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replica-checks")
        self._checks: list[Future] = []
        self._reference, self._copy = ReusedBuffer(), ReusedBuffer()  # the checker's own

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {key: full.shape for key, full in self.tensors.items()}

    @property
    def dtypes(self) -> dict[str, torch.dtype]:
        return {key: full.dtype for key, full in self.tensors.items()}

    @property
    def nbytes(self) -> int:
        """The bytes of the full model (each tensor once, however many ranks hold it)."""
        return sum(full.nbytes for full in self.tensors.values())

    def tensor(self, key: str, buffer: ReusedBuffer | None = None) -> torch.Tensor:
        full = self.tensors[key]
        tensor = full.read(buffer, self._scratch)
        if full.replicas:
            self._checks.append(self._checker.submit(self._check, full.replicas))
        return tensor

    def _check(self, replicas: tuple[Replica, ...]) -> None:
        for replica in replicas:
            if not _same(replica.reference.read(self._reference), replica.copy.read(self._copy)):
                raise CheckpointError(replica.error)

    def check_replicas(self) -> None:
        """Wait for the checks of every tensor read so far; raise the first one's error (in reading order)."""
        checks, self._checks = self._checks, []
        for check in checks:
            check.result()

    def state(self) -> dict[str, torch.Tensor]:
        """Every tensor in memory of its own, all copies checked."""
        state = {key: self.tensor(key) for key in self.tensors}
        self.check_replicas()
        return state

    def close(self) -> None:
        for check in self._checks:
            check.cancel()
        self._checker.shutdown(wait=True)

    def __enter__(self) -> "MergedModel":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        self.close()


def layout_of(ranks: Mapping[Rank, object]) -> Rank:
    """(tp, pp, ep) of a set of ranks: one more than the highest of each."""
    return tuple(1 + max(rank[i] for rank in ranks) for i in range(3))  # type: ignore[return-value]


def _expert_tensor_size(stage: Mapping[str, Part], model: ModelConfig, tp: int) -> int:
    """How many ways the routed experts are split (read off an fc2 shard's input width)."""
    for key, part in stage.items():
        if routed_expert_index(key) is not None and "linear_fc2" in key:
            etp = model.moe_ffn_hidden_size // part.shape[-1]
            if etp < 1 or tp % etp:
                raise CheckpointError(f"{part.where}: {key!r}: an expert slice {part.shape[-1]} wide does not fit "
                                      f"model.moe_ffn_hidden_size = {model.moe_ffn_hidden_size} over {tp} tensor ranks")
            return etp
    return tp


def _joined(key: str, parts: tuple[Part, ...], model: ModelConfig | None) -> tuple[tuple[Part, ...], Partition,
                                                                                    tuple[Replica, ...]]:
    """The parts of one block over tensor ranks: (parts to join, how, replicas when the tensor is replicated)."""
    first = parts[0]
    for rank, part in enumerate(parts[1:], start=1):
        if part.dtype != first.dtype or (len(part.shape) != len(first.shape)):
            raise CheckpointError(f"{part.where}: {key!r} is {part.dtype} {list(part.shape)}, tensor rank 0 holds "
                                  f"{first.dtype} {list(first.shape)}")
    if len(parts) == 1:
        return parts, REPLICATED, ()
    partition = partition_of(key, len(first.shape), model)
    if partition.dim is None:
        return (first,), REPLICATED, tuple(Replica(first, part, f"{part.where}: replicated tensor {key!r} differs "
                                                   f"between tensor-parallel ranks 0 and {rank}")
                                           for rank, part in enumerate(parts[1:], start=1))
    for part in parts[1:]:
        if part.shape != first.shape:
            raise CheckpointError(f"{part.where}: {key!r} has shape {list(part.shape)}, tensor rank 0's "
                                  f"{list(first.shape)}")
    partition.sizes(first.shape[partition.dim])  # names a shard that does not split into its segments
    return parts, partition, ()


def merge_plan(ranks: Mapping[Rank, Mapping[str, Part]], model: ModelConfig | None) -> dict[str, FullTensor]:
    """How each tensor of the full model is assembled from the parts every (tp, pp, ep) rank holds.

    Checks that every rank of the grid is there, that the ranks of a stage hold the same keys,
    and that no expert is held by two ranks; the copies that must agree bit for bit become
    the ``replicas`` of their tensor, checked when it is read.
    """
    tp, pp, ep = layout_of(ranks)
    missing = [(t, p, e) for p in range(pp) for e in range(ep) for t in range(tp) if (t, p, e) not in ranks]
    if missing:
        raise CheckpointError(f"shards of ranks (tp, pp, ep) {missing} are missing")
    if (tp > 1 or ep > 1) and model is None:
        raise CheckpointError(f"merging tp={tp} ep={ep} shards needs the model config")
    tensors: dict[str, FullTensor] = {}
    offset = 0
    for stage in range(pp):
        grid = {(t, e): ranks[(t, stage, e)] for e in range(ep) for t in range(tp)}
        keys = list(grid[(0, 0)])
        for (t, e), held in grid.items():
            if set(held) != set(keys):
                where = next(iter(held.values())).where if held else f"rank (tp, pp, ep) ({t}, {stage}, {e})"
                raise CheckpointError(f"{where}: pipeline stage {stage}: ranks (tp, ep) (0, 0) and ({t}, {e}) hold "
                                      f"different keys: {sorted(set(held) ^ set(keys))[:5]}")
        split_experts = tp * ep > 1 and any(routed_expert_index(key) is not None for key in keys)
        etp = _expert_tensor_size(grid[(0, 0)], model, tp) if split_experts else tp
        layers = set()
        for key in keys:
            match = _LAYER_KEY.fullmatch(key)
            if match:
                layers.add(int(match.group(1)))
            name = f"decoder.layers.{int(match.group(1)) + offset}.{match.group(2)}" if match else key
            index = routed_expert_index(key)
            if index is not None and split_experts:
                _add_experts(tensors, key, name, index, grid, model, tp, ep, etp)
            else:
                _add_dense(tensors, key, name, stage, grid, model, tp, ep)
        offset += len(layers)
    return tensors


def _add_dense(tensors: dict[str, FullTensor], key: str, name: str, stage: int, grid: Mapping[tuple[int, int],
               Mapping[str, Part]], model: ModelConfig | None, tp: int, ep: int) -> None:
    """A tensor held alike by every EP rank: joined over the tensor ranks of EP rank 0, the others its copies."""
    parts, partition, replicas = _joined(key, tuple(grid[(t, 0)][key] for t in range(tp)), model)
    replicas += tuple(Replica(grid[(t, 0)][key], grid[(t, e)][key], f"{grid[(t, e)][key].where}: {key!r} differs "
                              f"from expert-parallel rank 0's (pipeline stage {stage})")
                      for e in range(1, ep) for t in range(tp))
    if name in tensors:  # the embedding, on the first stage and on the MTP stage
        held = tensors[name]
        if len(held.blocks[0]) != len(parts):
            raise CheckpointError(f"{parts[0].where}: {name!r} is split {len(parts)} ways on pipeline stage {stage}, "
                                  f"{len(held.blocks[0])} ways on an earlier stage")
        replicas += tuple(Replica(old, new, f"{new.where}: {name!r} differs between pipeline stages")
                          for old, new in zip(held.blocks[0], parts))
        tensors[name] = FullTensor(held.blocks, held.partition, held.replicas + replicas)
        return
    tensors[name] = FullTensor((parts,), partition, replicas)


def _add_experts(tensors: dict[str, FullTensor], key: str, name: str, index: str,
                 grid: Mapping[tuple[int, int], Mapping[str, Part]], model: ModelConfig, tp: int, ep: int,
                 etp: int) -> None:
    """A routed expert tensor: EP rank e holds global experts e*E/EP ... (a block of rows when stacked)."""
    local = model.num_experts // ep
    blocks, replicas, partition = [], [], REPLICATED
    for e in range(ep):
        parts, partition, same = _joined(key, tuple(grid[(t, e)][key] for t in range(etp)), model)
        replicas += list(same) + [Replica(grid[(t % etp, e)][key], grid[(t, e)][key], f"{grid[(t, e)][key].where}: "
                                          f"{key!r} differs between tensor ranks {t % etp} and {t} of EP rank {e}")
                                  for t in range(etp, tp)]
        if index:
            full_name = f"{name[:len(name) - len(index)]}{e * local + int(index)}"
            if full_name in tensors:
                raise CheckpointError(f"{parts[0].where}: {key!r} is expert {full_name!r}, which another rank holds "
                                      "too")
            tensors[full_name] = FullTensor((parts,), partition, tuple(replicas))
            replicas = []
        else:
            blocks.append(parts)
    if not index:
        if name in tensors:
            raise CheckpointError(f"{blocks[0][0].where}: stacked experts {name!r} are held by another stage too")
        tensors[name] = FullTensor(tuple(blocks), partition, tuple(replicas))


def merge_rank_states(shards: Mapping[Rank, Mapping[str, torch.Tensor]],
                      model: ModelConfig | None) -> dict[str, torch.Tensor]:
    """One full state dict from rank states already in memory, by the same plan and checks as the files."""
    parts = {rank: {key: HeldTensor(tensor, f"rank (tp, pp, ep) {rank}") for key, tensor in state.items()}
             for rank, state in shards.items()}
    with MergedModel(Path("."), 0, merge_plan(parts, model), *layout_of(parts)) as merged:
        return merged.state()
