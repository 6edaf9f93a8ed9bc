"""Tensor- and pipeline-parallel shards of a Megatron state dict, by Megatron's layout rules.

Column-parallel weights are split on their output dimension, one slice per rank of every
segment that Megatron keeps apart: a query group never straddles two ranks of linear_qkv
(groups are contiguous rows, so a plain split of the rows does it), each rank of a SwiGLU
fc1 holds [gate_r; up_r], each rank of the GDN in_proj holds [q_r|k_r|v_r|z_r|beta_r|alpha_r]
and of conv1d [q_r|k_r|v_r]. Row-parallel weights are split on their input dimension; norms,
the router and the shared-expert gate are replicated. Pipeline stages take an equal share of
the decoder layers, renumbered from 0; the first stage holds the embedding, the last the
final norm, the output layer and the MTP block, which shares the embedding and so holds a
copy of it too (as Megatron builds it).

``mindformers_split_dim`` says the same for a MindFormers checkpoint saved by several ranks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from crossalign.checkpoint.errors import CheckpointError
from crossalign.config import ModelConfig

Rank = tuple[int, int]  # (tensor-parallel rank, pipeline-parallel rank)


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


def check_parallel_sizes(model: ModelConfig, tp: int, pp: int) -> None:
    """Every split must fall on a head, group, channel or layer boundary; name the size that does not."""
    m = model
    if tp < 1 or pp < 1:
        raise CheckpointError(f"tensor and pipeline parallel sizes must be at least 1 (got tp={tp}, pp={pp})")
    sizes = {
        "num_query_groups": m.num_query_groups, "num_attention_heads": m.num_attention_heads,
        "linear_num_key_heads": m.linear_num_key_heads, "linear_num_value_heads": m.linear_num_value_heads,
        "padded_vocab_size": m.padded_vocab_size, "hidden_size": m.hidden_size,
    }
    if m.is_moe:
        sizes["moe_ffn_hidden_size"] = m.moe_ffn_hidden_size
        sizes["moe_shared_expert_intermediate_size"] = m.moe_shared_expert_intermediate_size
    else:
        sizes["ffn_hidden_size"] = m.ffn_hidden_size
    for name, size in sizes.items():
        if size % tp:
            raise CheckpointError(f"tensor parallel size {tp} does not divide model.{name} = {size}")
    if m.num_layers % pp:
        raise CheckpointError(f"pipeline parallel size {pp} does not divide model.num_layers = {m.num_layers}")


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


def merge_tensors(key: str, shards: list[torch.Tensor], partition: Partition) -> torch.Tensor:
    """Inverse of split_tensor; replicated shards must agree bit for bit."""
    if partition.dim is None:
        for rank, shard in enumerate(shards[1:], start=1):
            if not torch.equal(shard, shards[0]):
                raise CheckpointError(f"replicated tensor {key!r} differs between tensor-parallel ranks 0 and {rank}")
        return shards[0]
    tp, dim = len(shards), partition.dim
    per_rank = [torch.split(shard, partition.sizes(shard.shape[dim]), dim=dim) for shard in shards]
    segments = range(len(partition.segments))
    return torch.cat([per_rank[rank][seg] for seg in segments for rank in range(tp)], dim=dim)


def _stage_of_key(key: str, layers_per_stage: int, pp: int, mtp: bool) -> list[tuple[int, str]]:
    """The pipeline stages that hold ``key``, with the key's name on that stage."""
    match = _LAYER.fullmatch(key)
    if match:
        index = int(match.group(1))
        return [(index // layers_per_stage, f"decoder.layers.{index % layers_per_stage}.{match.group(2)}")]
    if key == "embedding.word_embeddings.weight":
        return [(0, key)] + ([(pp - 1, key)] if mtp and pp > 1 else [])
    return [(pp - 1, key)]


def _placements(key: str, model: ModelConfig | None, tp: int, pp: int) -> list[tuple[int, str]]:
    """The pipeline stages that hold ``key``, with its name there (model needed beyond a single rank)."""
    if tp == 1 and pp == 1:
        return [(0, key)]
    if model is None:
        raise CheckpointError(f"splitting {key!r} into tp={tp} pp={pp} shards needs the model config")
    return _stage_of_key(key, model.num_layers // pp, pp, model.mtp_num_layers > 0)


def shard_tensor(key: str, tensor: torch.Tensor, model: ModelConfig | None, tp: int,
                 pp: int) -> list[tuple[Rank, str, torch.Tensor]]:
    """Where one tensor of the full model goes in a tp x pp checkpoint: (rank, its key there, the shard) per rank.

    One tensor at a time, so that a checkpoint can be resharded while it is written.
    """
    placed = []
    for stage, local_key in _placements(key, model, tp, pp):
        shards = split_tensor(tensor, partition_of(key, tensor.dim(), model), tp) if tp > 1 else [tensor]
        placed += [((rank, stage), local_key, shard) for rank, shard in enumerate(shards)]
    return placed


def shard_shapes(key: str, shape: tuple[int, ...], model: ModelConfig | None, tp: int,
                 pp: int) -> list[tuple[Rank, str, tuple[int, ...]]]:
    """What ``shard_tensor`` gives for a tensor of ``shape``, without the tensor: to lay out files before it comes.

    Every segment along the split dimension splits evenly (``split_tensor`` checks it), so a
    shard is 1/tp of the full length there.
    """
    placements = _placements(key, model, tp, pp)
    dim = partition_of(key, len(shape), model).dim if tp > 1 else None
    local = shape if dim is None else (*shape[:dim], shape[dim] // tp, *shape[dim + 1:])
    return [((rank, stage), local_key, local) for stage, local_key in placements for rank in range(tp)]


def merge_shards(shards: dict[Rank, dict[str, torch.Tensor]], model: ModelConfig | None) -> dict[str, torch.Tensor]:
    """One full state dict from the shards of every (tp, pp) rank."""
    tp = 1 + max(rank[0] for rank in shards)
    pp = 1 + max(rank[1] for rank in shards)
    missing = [rank for rank in ((t, p) for t in range(tp) for p in range(pp)) if rank not in shards]
    if missing:
        raise CheckpointError(f"shards of ranks (tp, pp) {missing} are missing")
    if tp > 1 and model is None:
        raise CheckpointError(f"merging {tp} tensor-parallel shards needs the model config")
    stages: list[dict[str, torch.Tensor]] = []
    for stage in range(pp):
        ranks = [shards[(t, stage)] for t in range(tp)]
        keys = list(ranks[0])
        for t, rank_state in enumerate(ranks[1:], start=1):
            if set(rank_state) != set(keys):
                raise CheckpointError(f"pipeline stage {stage}: tensor-parallel ranks 0 and {t} hold different keys: "
                                      f"{sorted(set(rank_state) ^ set(keys))[:5]}")
        if tp == 1:
            stages.append(ranks[0])
            continue
        stages.append({key: merge_tensors(key, [r[key] for r in ranks], partition_of(key, ranks[0][key].dim(), model))
                       for key in keys})
    merged: dict[str, torch.Tensor] = {}
    offset = 0
    for stage, state in enumerate(stages):
        layers = {int(m.group(1)) for m in map(_LAYER.fullmatch, state) if m}
        for key, tensor in state.items():
            match = _LAYER.fullmatch(key)
            name = f"decoder.layers.{int(match.group(1)) + offset}.{match.group(2)}" if match else key
            if name in merged:
                if not torch.equal(merged[name], tensor):
                    raise CheckpointError(f"{name!r} differs between pipeline stages")
                continue
            merged[name] = tensor
        offset += len(layers)
    return merged

