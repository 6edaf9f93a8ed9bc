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
- at PP > 1 the embedding and output layer also run on the last stage for the MTP block; those calls are left out
  (named in the notes), the first stage's kept.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from crossalign.config import ModelConfig
from crossalign.diagnose.hooks import DEFAULT_STRIP_PREFIXES, strip_wrapper_prefixes
from crossalign.diagnose.msprobe_dump import MsprobeDumpError, StepDump, TensorRecord
from crossalign.sides.megatron.sharding import mindformers_split_dim, partition_of
from crossalign.tensorio.errors import CheckpointError

_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\..*|$)")
_EXPERT_PARAMETER = re.compile(r"^(weight|bias)(\d+)$")
_LOCAL_EXPERT = re.compile(r"(mlp\.experts\.local_experts\.)(\d+)(\.|$)")
_EXPERTS = re.compile(r"(^|\.)mlp\.experts(\.|$)")
_CHUNK = re.compile(r"^\d+\.")  # msprobe's index of a model chunk in the list Megatron hands it
_HEAD_SPLIT = re.compile(r"\.(q_layernorm|k_layernorm)$")  # [.., heads, head_dim]: split over heads (dim -2)
_TOKEN_HEAD_ROWS = re.compile(r"\.out_norm$")  # [tokens x local heads, dim]: rows interleave tokens and heads


@dataclass(frozen=True)
class SideLayout:
    """The parallel sizes of one side's run (``expert_tensor``: the expert tensor-parallel size)."""

    tensor: int = 1
    pipeline: int = 1
    expert: int = 1
    data: int = 1
    context: int = 1
    sequence_parallel: bool = False
    expert_tensor: int | None = None

    @classmethod
    def of(cls, layout) -> "SideLayout":
        """From a config's ``parallel.megatron`` / ``parallel.mindformers`` section."""
        return cls(layout.tensor, layout.pipeline, layout.expert, layout.data_parallel, layout.context,
                   layout.sequence_parallel, layout.expert_tensor_size)

    @property
    def etp(self) -> int:
        return self.expert_tensor or self.tensor

    @property
    def per_stage(self) -> int:
        return self.tensor * self.data

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(tensor rank, pipeline stage, data-parallel index) of a global rank."""
        within = rank % self.per_stage
        return within % self.tensor, rank // self.per_stage, within // self.tensor

    def expert_coordinates(self, rank: int) -> tuple[int, int, int]:
        """(expert tensor rank, expert rank, expert data-parallel index): the expert groups cut the same ranks
        ``etp-ep-dp`` (core_v0.16.1 megatron/core/parallel_state.py, the expert ``RankGenerator``)."""
        within = rank % self.per_stage
        return within % self.etp, (within // self.etp) % self.expert, within // (self.etp * self.expert)

    def needed(self) -> list[int]:
        """Every stage's tensor ranks of data-parallel index 0 and expert ranks of expert data-parallel index 0."""
        ranks = set()
        for stage in range(self.pipeline):
            base = stage * self.per_stage
            ranks |= {base + t for t in range(self.tensor)}
            ranks |= {base + t + self.etp * e for t in range(self.etp) for e in range(self.expert)}
        return sorted(ranks)

    def __str__(self) -> str:
        etp = f" (ETP {self.etp})" if self.etp != self.tensor else ""
        return f"TP {self.tensor} x PP {self.pipeline} x EP {self.expert}{etp} (DP {self.data})"


@dataclass
class WholeRecord:
    """A tensor of the whole model, from one shard or several (``dim``: the axis they are joined along)."""

    dtype: str
    shape: tuple[int, ...]
    parts: list[TensorRecord]
    dim: int | None = None
    segments: tuple[int, ...] = (1,)
    known_stats: dict[str, float | None] | None = None  # set where the parts' statistics do not make it up
    summed: bool = False  # the parts are partial sums of the tensor (not pieces of it)

    @property
    def stats(self) -> dict[str, float | None]:
        if self.known_stats is not None:
            return dict(self.known_stats)
        if self.summed:
            whole = self.load()
            return {"Max": float(whole.max()), "Min": float(whole.min()), "Mean": float(whole.mean()),
                    "Norm": float(np.linalg.norm(whole))}
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
        if self.summed:
            return np.sum(arrays, axis=0)
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
    raw_keys: dict[int, str] = field(default_factory=dict)  # rank -> the key msprobe wrote there (msprobe's own
    # compare names tensors by it)
    shards: dict[int, int] = field(default_factory=dict)  # rank -> the index of its part in a split record

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


def _merge_activation(records: list[TensorRecord], role: str, name: str, cls: str,
                      weight_split: tuple[int | None, tuple[int, ...]], sequence_parallel: bool) -> WholeRecord | None:
    """The whole tensor of one input or output over the tensor ranks; None where its shards cannot be joined into
    the whole tensor's layout."""
    if len(records) == 1 or _same(records):
        return WholeRecord(records[0].dtype, records[0].shape, [records[0]])
    if any(len(r.shape) != len(records[0].shape) for r in records) or not records[0].shape:
        return None
    last = len(records[0].shape) - 1
    dim, segments = weight_split
    if cls == "Conv1d":  # [b, channels, s]: its channels are split as its weight's rows
        return _join(records, 1, segments) if dim == 0 else None
    if role == "output" and dim == 0:
        return _join(records, last, segments)
    if role == "input" and dim == 1:
        return _join(records, last, (1,))
    if _HEAD_SPLIT.search(name):
        return _join(records, last - 1, (1,))
    if _TOKEN_HEAD_ROWS.search(name):
        return None
    return _join(records, 0 if sequence_parallel else last, (1,))


def _own_name(name: str, ep: int, experts_local: int, expert_parallel: int) -> str:
    """The model's own name: wrappers (Megatron's DDP/Float16Module "module.", MindFormers' "model.") and msprobe's
    model-chunk index dropped; a routed expert's local number made global at EP > 1."""
    name = strip_wrapper_prefixes(_CHUNK.sub("", name + "."), DEFAULT_STRIP_PREFIXES)[:-1]
    if expert_parallel > 1:
        name = _LOCAL_EXPERT.sub(lambda m: f"{m.group(1)}{ep * experts_local + int(m.group(2))}{m.group(3)}", name)
    return name


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
    experts_local = (model.num_experts or 0) // max(layout.expert, 1)
    notes: list[str] = []
    grouped: dict[str, dict[int, tuple]] = {}  # whole-model key -> {rank: (entry, name)}, in rank 0's order first
    stage_of: dict[str, int] = {}
    shared: set[str] = set()
    for rank in needed:
        tp, pp, dp = layout.coordinates(rank)
        etp, ep, edp = layout.expert_coordinates(rank)
        for entry in step.ranks[rank].entries.values():
            if entry.is_module:
                name = _global_name(_own_name(entry.name, ep, experts_local, layout.expert), pp, layers_per_stage)
                key = f"{entry.kind}.{name}.{entry.cls}.{entry.direction}.{entry.index}" if name else entry.key
            else:
                name, key = entry.name, entry.key
            expert = bool(_EXPERTS.search(name))
            if (expert and edp != 0) or (not expert and dp != 0):
                continue  # a data-parallel replica: it ran other samples and holds the same weights
            if stage_of.setdefault(key, pp) != pp:
                # the embedding and output layer run on the last stage too, for the MTP block: another call
                shared.add(name)
                continue
            grouped.setdefault(key, {})[rank] = (entry, name)
    notes += [f"{name}: the calls on the last pipeline stage (the MTP block's) are not compared at PP "
              f"{layout.pipeline}" for name in sorted(shared)]
    weights: dict[str, tuple[str, tuple[int, ...]]] = {}  # module -> (its weight, one shard's shape), from forwards
    for by_rank in grouped.values():
        entry, name = next(iter(by_rank.values()))
        weight = next((p for p in ("weight", "weight0") if p in entry.parameters), None)
        if weight is not None:
            weights.setdefault(name, (weight, entry.parameters[weight].shape))
    merged: dict[str, WholeEntry] = {}
    for key, by_rank in grouped.items():
        entry, name = next(iter(by_rank.values()))
        expert = bool(_EXPERTS.search(name))
        # shard index of each rank holding this entry: its (expert) tensor rank; expert ranks renumber the experts
        shard = {r: (layout.expert_coordinates(r)[0] if expert else layout.coordinates(r)[0]) for r in by_rank}
        whole = WholeEntry(key, entry.kind, name, entry.cls, entry.direction, entry.index,
                           raw_keys={r: e.key for r, (e, _) in by_rank.items()}, shards=shard)
        ranks = sorted(by_rank, key=lambda r: shard[r])
        if expert and layout.expert > 1 and entry.direction != "parameters_grad" and len(
                {layout.expert_coordinates(r)[1] for r in by_rank}) > 1:
            notes.append(f"{key}: routed-expert activations at EP {layout.expert} are not merged (each expert rank "
                         f"holds the tokens routed to its own experts)")
        else:
            records = [by_rank[r][0] for r in ranks]
            split = (_parameter_partition(side, f"{name}.{weights[name][0]}", weights[name][1], model)
                     if name in weights and len(records) > 1 else (None, (1,)))
            for role in ("inputs", "outputs"):
                slots = [getattr(e, role) for e in records]
                if len({len(s) for s in slots}) != 1:
                    raise MsprobeDumpError(f"{step.path}: {key} has {[len(s) for s in slots]} {role} on its tensor "
                                           f"ranks")
                # msprobe's backward record holds the gradient of the outputs as "input" and that of the inputs as
                # "output": each is split as the tensor it is the gradient of
                meaning = role[:-1] if entry.direction != "backward" else {"inputs": "output", "outputs": "input"}[role]
                joined = [_merge_activation(list(group), meaning, name, entry.cls, split, layout.sequence_parallel)
                          for group in zip(*slots)]
                if any(j is None for j in joined):
                    notes.append(f"{key}: {role} not merged over the tensor ranks (their shards do not join into the "
                                 f"whole tensor's layout)")
                    joined = []
                setattr(whole, role, joined)
        params: dict[str, list[tuple[int, TensorRecord]]] = {}
        for rank in by_rank:
            for pname, record in by_rank[rank][0].parameters.items():
                numbered = _EXPERT_PARAMETER.match(pname)
                if numbered and expert and layout.expert > 1:
                    ep = layout.expert_coordinates(rank)[1]
                    pname = f"{numbered.group(1)}{ep * experts_local + int(numbered.group(2))}"
                params.setdefault(pname, []).append((shard[rank], record))
        for pname, shards in params.items():
            records = [record for _, record in sorted(shards, key=lambda item: item[0])]
            if len(records) == 1:
                whole.parameters[pname] = WholeRecord(records[0].dtype, records[0].shape, records)
                continue
            dim, segments = _parameter_partition(side, f"{name}.{pname}", records[0].shape, model)
            if dim is not None:
                whole.parameters[pname] = _join(records, dim, segments)
            elif entry.direction != "parameters_grad" or not layout.sequence_parallel:
                whole.parameters[pname] = WholeRecord(records[0].dtype, records[0].shape, records[:1])
            elif all(r.data_path is not None for r in records):
                # each tensor rank's gradient of a replicated weight covers its part of the sequence; msprobe records
                # it before Megatron's all-reduce over the tensor ranks, so the whole gradient is their sum
                whole.parameters[pname] = WholeRecord(records[0].dtype, records[0].shape, records, summed=True)
            else:
                notes.append(f"{name}.{pname}: the gradient of a replicated weight under sequence parallelism is "
                             f"the sum of the tensor ranks' parts, which statistics cannot form")
        merged[key] = whole
    return WholeDump(str(step.path), step.framework, step.mode, step.step, layout, merged, notes)
