"""One side's msprobe dump as whole tensors: the rank folders of a TP x PP x EP layout merged by that layout's rules.

Which rank holds what (Megatron's default rank order ``tp-cp-ep-dp-pp``, core_v0.16.1
megatron/core/parallel_state.py ``initialize_model_parallel(order=...)``; MindFormers' pynative layout numbers its
ranks the same way, tensor-parallel ranks fastest): rank ``r`` is tensor rank ``r % TP``, data-parallel index
``(r // TP) % DP``, pipeline stage ``r // (TP * DP)``; the expert-parallel rank is the data-parallel index modulo EP
(expert ranks are carved out of the data-parallel ranks). A whole model needs, on every stage, every tensor rank of
the data-parallel indices 0 .. EP-1: data-parallel index 0 for everything, the others for their experts.

What is merged and how:

- activations (inputs and outputs of a module): over the tensor ranks of data-parallel index 0. A tensor every rank
  holds alike (same shape and statistics, or same md5) is replicated and taken from rank 0; otherwise it is split:
  a column-parallel module's output (its weight split on rows) along its last dimension in the weight's segments
  (the GDN in_proj's ``[q|k|v|z|beta|alpha]`` per rank), a row-parallel module's input along its last dimension,
  anything else along the sequence dimension (dim 0, Megatron's ``[s, b, h]``) under sequence parallelism and
  along the last dimension without it. The routed experts' own activations at EP > 1 are not merged: each expert
  rank sees the tokens routed to its experts from every data-parallel rank of its group, not a slice of one tensor.
- weights (``parameters``) and their gradients (``parameters_grad``): by the conversion code's own partition rules
  (``sides/megatron/sharding.partition_of``, ``mindformers_split_dim``), routed experts renumbered from each expert
  rank's local ids to global ones; pipeline stages renamed from their local layer numbers to global ones.
- statistics-only dumps: the merged Max is the max of the shards' maxima, Min the min of minima, Norm
  ``sqrt(sum(norm_i^2))`` and Mean ``sum(mean_i * n_i) / sum(n_i)`` with each shard's element count from its shape,
  all exact. md5 of a merged tensor cannot be formed from its shards' md5s: split tensors have none (replicated
  ones keep rank 0's).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from crossalign.config import ModelConfig
from crossalign.diagnose.msprobe_dump import MsprobeDumpError, StepDump, TensorRecord

_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\..*|$)")
_EXPERT_PARAMETER = re.compile(r"^(weight|bias)(\d+)$")
_EXPERTS = re.compile(r"(^|\.)mlp\.experts(\.|$)")


@dataclass(frozen=True)
class SideLayout:
    """The parallel sizes of one side's run."""

    tensor: int = 1
    pipeline: int = 1
    expert: int = 1
    data: int = 1
    context: int = 1
    sequence_parallel: bool = False

    @classmethod
    def of(cls, layout) -> "SideLayout":
        """From a config's ``parallel.megatron`` / ``parallel.mindformers`` section."""
        return cls(layout.tensor, layout.pipeline, layout.expert, layout.data_parallel, layout.context,
                   layout.sequence_parallel)

    def coordinates(self, rank: int) -> tuple[int, int, int, int]:
        """(tensor rank, pipeline stage, expert rank, data-parallel index) of a global rank."""
        tp, dp = rank % self.tensor, (rank // self.tensor) % self.data
        return tp, rank // (self.tensor * self.data), dp % self.expert, dp

    def rank(self, tp: int, pp: int, dp: int) -> int:
        return tp + self.tensor * (dp + self.data * pp)

    def needed(self) -> list[int]:
        return sorted(self.rank(t, p, d) for p in range(self.pipeline) for d in range(self.expert)
                      for t in range(self.tensor))

    def __str__(self) -> str:
        return f"TP {self.tensor} x PP {self.pipeline} x EP {self.expert} (DP {self.data})"


@dataclass
class WholeRecord:
    """A tensor of the whole model, from one shard or several (``dim``: the axis they are joined along)."""

    dtype: str
    shape: tuple[int, ...]
    parts: list[TensorRecord]
    dim: int | None = None
    segments: tuple[int, ...] = (1,)
    known_stats: dict[str, float | None] | None = None  # set where the parts' statistics do not make it up

    @property
    def stats(self) -> dict[str, float | None]:
        if self.known_stats is not None:
            return dict(self.known_stats)
        if len(self.parts) == 1:
            return dict(self.parts[0].stats)
        return combine_statistics(self.parts)

    @property
    def md5(self) -> str | None:
        return self.parts[0].md5 if len(self.parts) == 1 else None

    @property
    def has_tensor(self) -> bool:
        return all(part.data_path is not None for part in self.parts)

    def load(self) -> np.ndarray:
        arrays = [part.load() for part in self.parts]
        if len(arrays) == 1:
            return arrays[0]
        total = sum(self.segments)
        pieces = []
        for array in arrays:
            length = array.shape[self.dim]
            bounds = np.cumsum([length * s // total for s in self.segments])[:-1]
            pieces.append(np.split(array, bounds, axis=self.dim))
        return np.concatenate([pieces[rank][seg] for seg in range(len(self.segments)) for rank in range(len(arrays))],
                              axis=self.dim)


def combine_statistics(parts: list) -> dict[str, float | None]:
    """The statistics of the tensor the shards ``parts`` split (anything with ``shape`` and ``stats``; exact: see the
    module text)."""
    stats: dict[str, float | None] = {"Max": None, "Min": None, "Mean": None, "Norm": None}
    values = {key: [p.stats.get(key) for p in parts] for key in stats}
    counts = [math.prod(p.shape) for p in parts]
    if all(v is not None for v in values["Max"]):
        stats["Max"] = max(values["Max"])
    if all(v is not None for v in values["Min"]):
        stats["Min"] = min(values["Min"])
    if all(v is not None for v in values["Norm"]):
        stats["Norm"] = math.sqrt(sum(v * v for v in values["Norm"]))
    if all(v is not None for v in values["Mean"]) and sum(counts):
        stats["Mean"] = sum(m * n for m, n in zip(values["Mean"], counts)) / sum(counts)
    return stats


@dataclass
class WholeEntry:
    """One module call (or its backward, or its parameter gradients) of the whole model."""

    key: str
    kind: str
    name: str
    cls: str
    direction: str
    index: int
    inputs: list[WholeRecord] = field(default_factory=list)
    outputs: list[WholeRecord] = field(default_factory=list)
    parameters: dict[str, WholeRecord] = field(default_factory=dict)

    @property
    def is_module(self) -> bool:
        return self.kind in ("Module", "Cell")


@dataclass
class WholeDump:
    """One side's step, merged: entries in the order rank 0 recorded them (others' own entries after)."""

    path: str
    framework: str
    mode: str
    step: int
    layout: SideLayout
    entries: dict[str, WholeEntry]
    notes: list[str]


def _same(records: list[TensorRecord]) -> bool:
    first = records[0]
    return all(r.shape == first.shape and r.stats == first.stats and r.md5 == first.md5 for r in records[1:])


def _global_name(name: str, stage: int, layers_per_stage: int) -> str:
    match = _LAYER.match(name)
    if not match or stage == 0:
        return name
    return f"{match.group(1)}{int(match.group(2)) + stage * layers_per_stage}{match.group(3)}"


def _parameter_partition(side: str, full_name: str, shape: tuple[int, ...], model: ModelConfig):
    """(dim, segments) a parameter is split along over the tensor ranks; dim None when replicated."""
    from crossalign.sides.megatron.sharding import mindformers_split_dim, partition_of
    from crossalign.tensorio.errors import CheckpointError

    if side == "mindspore":
        return mindformers_split_dim(full_name, shape), (1,)
    try:
        partition = partition_of(full_name, len(shape), model)
    except CheckpointError:
        return None, (1,)
    return partition.dim, partition.segments


def _join(records: list[TensorRecord], dim: int, segments: tuple[int, ...]) -> WholeRecord:
    shape = list(records[0].shape)
    shape[dim] = sum(r.shape[dim] for r in records)
    return WholeRecord(records[0].dtype, tuple(shape), records, dim, segments)


def _merge_activation(records: list[TensorRecord], role: str, weight_split: tuple[int | None, tuple[int, ...]],
                      sequence_parallel: bool) -> WholeRecord:
    if len(records) == 1 or _same(records):
        return WholeRecord(records[0].dtype, records[0].shape, [records[0]])
    if any(len(r.shape) != len(records[0].shape) for r in records) or not records[0].shape:
        raise MsprobeDumpError("tensor ranks hold tensors of different ranks for one record")
    dim, segments = weight_split
    if role == "output" and dim == 0:
        return _join(records, len(records[0].shape) - 1, segments)
    if role == "input" and dim == 1:
        return _join(records, len(records[0].shape) - 1, (1,))
    return _join(records, 0 if sequence_parallel else len(records[0].shape) - 1, (1,))


def merge_side(step: StepDump, layout: SideLayout, model: ModelConfig, side: str) -> WholeDump:
    """The whole-model entries of one side's step dump (``side``: 'mindspore' or 'megatron')."""
    if layout.context != 1:
        raise MsprobeDumpError(f"{step.path}: context-parallel dumps (CP {layout.context}) are not merged: each rank "
                               f"holds a part of every sequence in the load-balanced order")
    needed = layout.needed() if (layout.tensor, layout.pipeline, layout.expert) != (1, 1, 1) else [0]
    missing = [r for r in needed if r not in step.ranks]
    if missing:
        have = ", ".join(p.path.name for p in step.ranks.values())
        raise MsprobeDumpError(f"{step.path}: {side} layout {layout} needs rank folders "
                               f"{', '.join(f'rank{r}' for r in missing)} (has {have})")
    layers_per_stage = model.num_layers // layout.pipeline
    notes: list[str] = []
    # (global key) -> {rank: raw entry}, in rank 0's order first
    grouped: dict[str, dict[int, object]] = {}
    for rank in needed:
        tp, pp, ep, dp = layout.coordinates(rank)
        for entry in step.ranks[rank].entries.values():
            name = _global_name(entry.name, pp, layers_per_stage) if entry.is_module else entry.name
            key = entry.key if name == entry.name else entry.key.replace(f".{entry.name}.", f".{name}.", 1)
            if dp != 0 and not _EXPERTS.search(name):
                continue  # data-parallel replicas of the dense modules ran other samples
            grouped.setdefault(key, {})[rank] = (entry, name)
    merged: dict[str, WholeEntry] = {}
    experts_local = (model.num_experts or 0) // max(layout.expert, 1)
    for key, by_rank in grouped.items():
        entry, name = next(iter(by_rank.values()))
        whole = WholeEntry(key, entry.kind, name, entry.cls, entry.direction, entry.index)
        is_experts = bool(_EXPERTS.search(name))
        activation_ranks = [r for r in by_rank if layout.coordinates(r)[3] == 0]
        if is_experts and layout.expert > 1 and entry.direction != "parameters_grad":
            notes.append(f"{key}: routed-expert activations at EP {layout.expert} are not merged (each expert rank "
                         f"holds the tokens routed to its own experts)")
        elif activation_ranks:
            records = [by_rank[r][0] for r in sorted(activation_ranks)]
            weight = next((p for p in ("weight", "weight0") if p in entry.parameters), None)
            split = (_parameter_partition(side, f"{name}.{weight}", entry.parameters[weight].shape, model)
                     if weight and layout.tensor > 1 else (None, (1,)))
            for role in ("inputs", "outputs"):
                slots = [getattr(e, role) for e in records]
                if len({len(s) for s in slots}) != 1:
                    raise MsprobeDumpError(f"{step.path}: {key} has {[len(s) for s in slots]} {role} on its tensor "
                                           f"ranks")
                setattr(whole, role, [_merge_activation(list(group), role[:-1], split, layout.sequence_parallel)
                                      for group in zip(*slots)])
        parameter_ranks = sorted(by_rank)
        params: dict[str, list[tuple[int, TensorRecord]]] = {}
        for rank in parameter_ranks:
            tp, _, ep, dp = layout.coordinates(rank)
            if dp >= layout.expert:
                continue  # a data-parallel replica: its weights are rank dp % EP's
            for pname, record in by_rank[rank][0].parameters.items():
                numbered = _EXPERT_PARAMETER.match(pname)
                if numbered and is_experts and layout.expert > 1:
                    pname = f"{numbered.group(1)}{ep * experts_local + int(numbered.group(2))}"
                elif ep != 0 and not is_experts:
                    continue
                params.setdefault(pname, []).append((tp, record))
        for pname, shards in params.items():
            shards = sorted(shards, key=lambda item: item[0])
            records = [record for _, record in shards]
            if len(records) == 1:
                whole.parameters[pname] = WholeRecord(records[0].dtype, records[0].shape, records)
                continue
            dim, segments = _parameter_partition(side, f"{name}.{pname}", records[0].shape, model)
            whole.parameters[pname] = (WholeRecord(records[0].dtype, records[0].shape, records[:1]) if dim is None
                                       else _join(records, dim, segments))
        merged[key] = whole
    return WholeDump(str(step.path), step.framework, step.mode, step.step, layout, merged, notes)
