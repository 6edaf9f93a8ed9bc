"""Tensor- and pipeline-parallel shards of a Megatron state dict, by Megatron's layout rules.

Column-parallel weights are split on their output dimension, one slice per rank of every
segment that Megatron keeps apart: a query group never straddles two ranks of linear_qkv
(groups are contiguous rows, so a plain split of the rows does it), each rank of a SwiGLU
fc1 holds [gate_r; up_r], each rank of the GDN in_proj holds [q_r|k_r|v_r|z_r|beta_r|alpha_r]
and of conv1d [q_r|k_r|v_r]. Row-parallel weights are split on their input dimension; norms,
the router and the shared-expert gate are replicated. Pipeline stages take an equal share of
the decoder layers, renumbered from 0; the first stage holds the embedding, the last the
final norm, the output layer and the MTP block, which shares the embedding and so holds a
copy of it too (as Megatron builds it). Expert-parallel ranks each hold E/EP routed experts,
numbered locally (global expert e is local expert e % (E/EP) of rank e // (E/EP)), split
over the expert tensor-parallel ranks; everything else is the same on every EP rank.

``mindformers_split_dim`` says the same for a MindFormers checkpoint saved by several ranks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from crossalign.tensorio.errors import CheckpointError
from crossalign.config import ModelConfig

Rank = tuple[int, int, int]  # (tensor-parallel rank, pipeline-parallel rank, expert-parallel rank)


@dataclass(frozen=True)
class Partition:
    """How a tensor is spread over tensor-parallel ranks: ``dim`` None means every rank holds all of it."""

    dim: int | None
    segments: tuple[int, ...] = (1,)  # relative sizes of the parts along dim that are split separately

    def sizes(self, length: int) -> list[int]:
        """The segment lengths of a tensor (full or shard) that is ``length`` long along dim."""
        total = sum(self.segments)
        if any(length * part % total for part in self.segments):
            raise CheckpointError(f"length {length} does not divide in the proportions {self.segments}")
        return [length * part // total for part in self.segments]


REPLICATED = Partition(None)
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.*)")
_ROUTED_FC1 = re.compile(r".*mlp\.experts\.linear_fc1\.weight(\d*)")
_ROUTED_FC2 = re.compile(r".*mlp\.experts\.linear_fc2\.weight(\d*)")
_ROUTED_EXPERT = re.compile(r"(.*mlp\.experts\.linear_fc[12]\.weight)(\d*)")
_REPLICATED_SUFFIXES = ("layer_norm_weight", "layernorm.weight", "enorm.weight", "hnorm.weight",
                        "out_norm.weight", "mlp.router.weight", "shared_experts.gate_weight")
_ROW_PARALLEL_SUFFIXES = ("self_attention.linear_proj.weight", "self_attention.out_proj.weight",
                          "mlp.linear_fc2.weight", "shared_experts.linear_fc2.weight")
_COLUMN_PARALLEL_SUFFIXES = ("embedding.word_embeddings.weight", "output_layer.weight", "eh_proj.weight",
                             "self_attention.linear_qkv.weight", "self_attention.A_log", "self_attention.dt_bias")


def partition_of(key: str, ndim: int, model: ModelConfig) -> Partition:
    """The tensor-parallel layout of one Megatron key (``ndim`` tells stacked from per-expert experts)."""
    m = model
    if key.endswith(_REPLICATED_SUFFIXES):
        return REPLICATED
    if key.endswith(_COLUMN_PARALLEL_SUFFIXES):
        return Partition(0)
    if key.endswith(_ROW_PARALLEL_SUFFIXES):
        return Partition(1)
    if key.endswith("self_attention.in_proj.weight"):
        qk, v, nv = m.gdn_key_dim, m.gdn_value_dim, m.linear_num_value_heads
        return Partition(0, (qk, qk, v, v, nv, nv))
    if key.endswith("self_attention.conv1d.weight"):
        return Partition(0, (m.gdn_key_dim, m.gdn_key_dim, m.gdn_value_dim))
    stacked = ndim == 3
    if _ROUTED_FC1.fullmatch(key):
        return Partition(1 if stacked else 0, (1, 1))  # [gate; up] halves
    if key.endswith(("mlp.linear_fc1.weight", "shared_experts.linear_fc1.weight")):
        return Partition(0, (1, 1))
    if _ROUTED_FC2.fullmatch(key):
        return Partition(2 if stacked else 1)
    raise CheckpointError(f"no tensor-parallel layout is known for key {key!r}")


_MS_REPLICATED_SUFFIXES = ("layernorm.weight", "enorm.weight", "hnorm.weight", "out_norm.weight",
                           "mlp.router.weight", "shared_experts_gate.weight", "mlp.tokens_per_expert")
_MS_ROW_PARALLEL_SUFFIXES = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight",
                             "shared_experts.linear_fc2.weight")


def mindformers_split_dim(key: str, shape: tuple[int, ...]) -> int | None:
    """The axis a MindFormers tensor is cut along when ranks save it (None: every rank holds all of it).

    Output projections are cut on their rows, input projections (linear_proj, fc2) on their
    columns, routed experts on the expert axis (expert parallel); norms, the router, the
    shared-expert gate and buffers are whole on every rank. The slices are a storage layout
    that metadata.json describes: MindFormers' loader reassembles them for whatever layout
    the loading run uses, so they need not follow the head or gate|up segments.
    """
    if key.endswith(_MS_REPLICATED_SUFFIXES):
        return None
    if key.endswith(_MS_ROW_PARALLEL_SUFFIXES):
        return 1
    return 0


def check_parallel_sizes(model: ModelConfig, tp: int, pp: int, ep: int = 1, etp: int | None = None) -> None:
    """Every split must fall on a head, group, channel, layer or expert boundary; name the size that does not.

    ``etp`` (expert tensor parallel, None: ``tp`` as Megatron defaults it) must divide ``tp``:
    a legacy file is named by its tensor rank, and only then does that rank fix the slice of
    the experts it holds (core_v0.16.1 ``parallel_state.py`` orders both rank grids
    tensor-first, so the expert tensor rank is the tensor rank modulo etp).
    """
    m = model
    etp = tp if etp is None else etp
    if min(tp, pp, ep, etp) < 1:
        raise CheckpointError(f"parallel sizes must be at least 1 (got tp={tp}, pp={pp}, ep={ep}, etp={etp})")
    sizes = {
        "num_query_groups": m.num_query_groups, "num_attention_heads": m.num_attention_heads,
        "linear_num_key_heads": m.linear_num_key_heads, "linear_num_value_heads": m.linear_num_value_heads,
        "padded_vocab_size": m.padded_vocab_size, "hidden_size": m.hidden_size,
    }
    if m.is_moe:
        sizes["moe_shared_expert_intermediate_size"] = m.moe_shared_expert_intermediate_size
    else:
        sizes["ffn_hidden_size"] = m.ffn_hidden_size
    for name, size in sizes.items():
        if size % tp:
            raise CheckpointError(f"tensor parallel size {tp} does not divide model.{name} = {size}")
    if m.num_layers % pp:
        raise CheckpointError(f"pipeline parallel size {pp} does not divide model.num_layers = {m.num_layers}")
    if (ep > 1 or etp != tp) and not m.is_moe:
        raise CheckpointError(f"expert parallel sizes (ep={ep}, etp={etp}) need an MoE model; {m.name} is dense")
    if m.is_moe:
        if m.num_experts % ep:
            raise CheckpointError(f"expert parallel size {ep} does not divide model.num_experts = {m.num_experts}")
        if m.moe_ffn_hidden_size % etp:
            raise CheckpointError(f"expert tensor parallel size {etp} does not divide model.moe_ffn_hidden_size = "
                                  f"{m.moe_ffn_hidden_size}")
        if tp % etp:
            raise CheckpointError(f"expert tensor parallel size {etp} does not divide tensor parallel size {tp}: "
                                  "a legacy checkpoint cannot say which expert slice a tensor rank's file holds")


def split_tensor(tensor: torch.Tensor, partition: Partition, tp: int) -> list[torch.Tensor]:
    """The tp shards of one tensor, each a compact copy (so that saving one does not save the others)."""
    if partition.dim is None:
        return [tensor] * tp
    parts = torch.split(tensor, partition.sizes(tensor.shape[partition.dim]), dim=partition.dim)
    for part in parts:
        if part.shape[partition.dim] % tp:
            raise CheckpointError(f"a segment of {part.shape[partition.dim]} does not split over {tp} ranks")
    pieces = [torch.chunk(part, tp, dim=partition.dim) for part in parts]
    return [torch.cat([chunks[rank] for chunks in pieces], dim=partition.dim) for rank in range(tp)]


def _stage_of_key(key: str, layers_per_stage: int, pp: int, mtp: bool) -> list[tuple[int, str]]:
    """The pipeline stages that hold ``key``, with the key's name on that stage."""
    match = _LAYER.fullmatch(key)
    if match:
        index = int(match.group(1))
        return [(index // layers_per_stage, f"decoder.layers.{index % layers_per_stage}.{match.group(2)}")]
    if key == "embedding.word_embeddings.weight":
        return [(0, key)] + ([(pp - 1, key)] if mtp and pp > 1 else [])
    return [(pp - 1, key)]


def _placements(key: str, model: ModelConfig | None, tp: int, pp: int, ep: int) -> list[tuple[int, str]]:
    """The pipeline stages that hold ``key``, with its name there (model needed beyond a single rank)."""
    if (tp, pp, ep) == (1, 1, 1):
        return [(0, key)]
    if model is None:
        raise CheckpointError(f"splitting {key!r} into tp={tp} pp={pp} ep={ep} shards needs the model config")
    return _stage_of_key(key, model.num_layers // pp, pp, model.mtp_num_layers > 0)


def _routed_expert(key: str) -> re.Match | None:
    """A routed expert's key: group 1 its name up to the weight, group 2 the expert index ('' when stacked)."""
    return _ROUTED_EXPERT.fullmatch(key)


def routed_expert_index(key: str) -> str | None:
    """A routed expert's index in its key ('' for stacked experts), or None for any other key."""
    match = _routed_expert(key)
    return None if match is None else match.group(2)


def is_routed_expert(key: str) -> bool:
    """Whether a Megatron key is a routed expert's weight (split over expert-parallel ranks, not replicated)."""
    return _routed_expert(key) is not None


def _expert_slices(key: str, tensor_or_shape, local: int, ep: int) -> list[tuple[int, str, object]]:
    """(EP rank, local key, the part) of one routed expert tensor or shape, as Megatron numbers experts per rank.

    Global expert e sits on EP rank e // local as its local expert e % local; a stacked
    [E, ...] tensor gives each rank its block of ``local`` rows.
    """
    name, index = _routed_expert(key).groups()
    if index:
        e = int(index)
        return [(e // local, f"{name}{e % local}", tensor_or_shape)]
    if isinstance(tensor_or_shape, tuple):
        return [(r, key, (local, *tensor_or_shape[1:])) for r in range(ep)]
    return [(r, key, part) for r, part in enumerate(torch.split(tensor_or_shape, local))]


def shard_tensor(key: str, tensor: torch.Tensor, model: ModelConfig | None, tp: int, pp: int, ep: int = 1,
                 etp: int | None = None) -> list[tuple[Rank, str, torch.Tensor]]:
    """Where one tensor of the full model goes in a tp x pp x ep checkpoint: (rank, its key there, the shard) each.

    Routed experts go to their EP rank, renumbered locally, and are split over ``etp``
    ranks (None: tp); the tensor rank t holds expert slice t % etp. Everything else is
    split over tp and held alike by every EP rank. One tensor at a time, so that a
    checkpoint can be resharded while it is written.
    """
    etp = tp if etp is None else etp
    placed = []
    for stage, stage_key in _placements(key, model, tp, pp, ep):
        if _routed_expert(key) and (ep > 1 or etp != tp):
            for ep_rank, local_key, part in _expert_slices(stage_key, tensor, model.num_experts // ep, ep):
                slices = split_tensor(part, partition_of(key, part.dim(), model), etp) if etp > 1 else [part]
                placed += [((t, stage, ep_rank), local_key, slices[t % etp]) for t in range(tp)]
            continue
        shards = split_tensor(tensor, partition_of(key, tensor.dim(), model), tp) if tp > 1 else [tensor]
        placed += [((t, stage, e), stage_key, shard) for e in range(ep) for t, shard in enumerate(shards)]
    return placed


def _split_shape(shape: tuple[int, ...], dim: int | None, ways: int) -> tuple[int, ...]:
    return shape if dim is None or ways == 1 else (*shape[:dim], shape[dim] // ways, *shape[dim + 1:])


def shard_shapes(key: str, shape: tuple[int, ...], model: ModelConfig | None, tp: int, pp: int, ep: int = 1,
                 etp: int | None = None) -> list[tuple[Rank, str, tuple[int, ...]]]:
    """What ``shard_tensor`` gives for a tensor of ``shape``, without the tensor: to lay out files before it comes.

    Every segment along the split dimension splits evenly (``split_tensor`` checks it), so a
    shard is 1/tp (an expert's 1/etp) of the full length there.
    """
    etp = tp if etp is None else etp
    placed = []
    for stage, stage_key in _placements(key, model, tp, pp, ep):
        if _routed_expert(key) and (ep > 1 or etp != tp):
            for ep_rank, local_key, part in _expert_slices(stage_key, shape, model.num_experts // ep, ep):
                local = _split_shape(part, partition_of(key, len(part), model).dim, etp)
                placed += [((t, stage, ep_rank), local_key, local) for t in range(tp)]
            continue
        dim = partition_of(key, len(shape), model).dim if tp > 1 else None
        local = _split_shape(shape, dim, tp)
        placed += [((t, stage, e), stage_key, local) for e in range(ep) for t in range(tp)]
    return placed
