"""Where each tensor of a Megatron model sits in a torch_dist checkpoint: the keys, global shapes and chunks that
megatron-core's own ``sharded_state_dict()`` gives for the config, derived without building the model.

A torch_dist checkpoint stores every tensor under a *sharded key* at its global shape, as
chunks with offsets. This module maps each key of crossalign's legacy Megatron state (TE names,
TP 1, layers numbered globally) to the chunks it becomes, as megatron-core 0.16.1 and 0.17.0
lay them out when one rank holds the whole model:

* layers: ``TransformerBlock.sharded_state_dict`` keys a layer ``decoder.layers.{i}.`` when the
  layers differ (``linear_attention_freq`` or ``moe_layer_freq`` > 1, core_v0.16.1
  ``transformer/transformer_block.py:824-868``), otherwise it stacks them: the key
  ``decoder.layers.X`` of global shape [L, ...], one chunk of [1, ...] per layer at offset l
  (``sharded_pp_offset = [(0, global_layer_offset, num_layers)]``). MTP layers keep their own
  prefix ``mtp.layers.{k}.``, and their inner layer is ``transformer_layer`` in both versions: 0.17.0
  renamed the module ``mtp_model_layer`` but maps its sharded keys back (core_v0.17.0
  ``transformer/multi_token_prediction.py:1185-1192``), so only the legacy keys differ;
* GatedDeltaNet's in_proj and conv1d are stored as their parts, ``in_proj.weight.query`` ...
  ``.alpha`` and ``conv1d.weight.query`` ... ``.value`` (``ssm/gated_delta_net.py``,
  ``sharded_state_dict``), each part its rows of the fused tensor;
* SwiGLU fc1 weights (dense, shared and routed experts) are one key whose gate and up halves
  are separate chunks (``transformer/mlp.py``, ``apply_swiglu_sharded_factory``);
* routed experts are one key per layer and weight, ``mlp.experts.experts.linear_fc1.weight`` of
  global shape [E, out, in], one chunk per expert at offset e (TE's grouped experts and the
  local sequential ones alike: ``transformer/moe/experts.py``, and
  ``extensions/transformer_engine.py:1738-1787`` ``_sharded_state_dict_grouped``);
* every linear layer also saves its ``_extra_state`` as a ShardedObject (``None`` without fp8),
  under ``{module}._extra_state/shard_{offsets}_{shape}`` (``dist_checkpointing/mapping.py:397-403``
  ``ShardedObject.unique_key``; ``transformer/utils.py:151-190`` for the offsets: the layer and
  expert axes, or ``0_1`` for neither); routed experts have one per expert.

The fused norms are under TE's names (a GPU run's model); ``names="local"`` gives the keys of
megatron-core's local-module model (the CPU's) instead: ``te_local.py``. tests/test_torch_dist.py
holds this layout against megatron-core's own ``sharded_state_dict`` and save.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from crossalign.config import ModelConfig
from crossalign.models.layout import ExpertForm, megatron_shapes, mtp_layer_prefix
from crossalign.sides.megatron.sharding import partition_of
from crossalign.sides.megatron.te_local import layer_renames

Names = Literal["te", "local"]
GDN_PARTS = {"self_attention.in_proj.weight": ("query", "key", "value", "z", "beta", "alpha"),
             "self_attention.conv1d.weight": ("query", "key", "value")}
SWIGLU_FC1 = ("mlp.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight", "mlp.experts.linear_fc1.weight")
# The modules whose weight comes with an ``_extra_state`` ShardedObject (megatron-core's linear layers).
LINEAR_MODULES = ("linear_qkv", "linear_proj", "in_proj", "out_proj", "linear_fc1", "linear_fc2", "eh_proj")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.*)")
_ROUTED = re.compile(r"(.*)mlp\.experts\.(linear_fc[12])\.weight(\d*)")


@dataclass(frozen=True)
class Piece:
    """One chunk of a sharded key, and which part of a legacy tensor it holds.

    ``select`` picks the part from the legacy tensor (an expert index of stacked experts, then a
    range of rows); the chunk is that part reshaped to ``sizes`` (leading axes of 1 for the layer
    and expert axes).
    """

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    expert: int | None  # the expert of a stacked legacy tensor this piece comes from
    rows: tuple[int, int] | None  # the rows of the legacy tensor (after the expert index), None: all

    def take(self, tensor):
        """This piece of the legacy tensor (a view), shaped as the chunk."""
        part = tensor if self.expert is None else tensor[self.expert]
        if self.rows is not None:
            part = part[self.rows[0]:self.rows[1]]
        return part.reshape(self.sizes)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class TorchDistLayout:
    """Every legacy key's shape and pieces (in the legacy order), and the ShardedObjects' keys."""

    shapes: dict[str, tuple[int, ...]]
    pieces: dict[str, tuple[Piece, ...]]
    objects: tuple[str, ...]

    @property
    def global_shapes(self) -> dict[str, tuple[int, ...]]:
        return {piece.key: piece.global_shape for pieces in self.pieces.values() for piece in pieces}


def homogeneous_layers(model: ModelConfig) -> bool:
    """Whether megatron-core stacks the decoder layers under one key (all layers of one kind)."""
    return model.linear_attention_freq == 1  # moe_layer_freq is 1: every layer is MoE, or none is


def _row_parts(name: str, rows: int, model: ModelConfig) -> list[tuple[str, tuple[int, int] | None]]:
    """(suffix of the sharded key, rows) of each part a legacy weight is stored as; one whole part by default."""
    if name in GDN_PARTS:
        sizes = partition_of(name, 2, model).sizes(rows)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [(f".{part}", (start, start + size)) for part, start, size in zip(GDN_PARTS[name], starts, sizes)]
    if name.endswith(SWIGLU_FC1) or _ROUTED.fullmatch(name) and "linear_fc1" in name:
        return [("", (0, rows // 2)), ("", (rows // 2, rows))]
    return [("", None)]


def _norm_renames(model: ModelConfig, names: Names) -> dict[str, dict[str, str]]:
    """Per layer kind, TE name -> the name under ``names`` of its fused norms (relative to the layer)."""
    if names == "te":
        return {"attention": {}, "gdn": {}}
    return {kind: {te: local for te, local in layer_renames(model, kind) if "mlp.experts." not in te}
            for kind in ("attention", "gdn")}


def torch_dist_layout(model: ModelConfig, core_version: str, experts: ExpertForm = "per_expert",
                      names: Names = "te") -> TorchDistLayout:
    """The torch_dist layout of the model's legacy keys (``megatron_shapes`` with ``experts``), in that order."""
    shapes = megatron_shapes(model, core_version, experts)
    stacked_layers = homogeneous_layers(model)
    num_layers, num_experts = model.num_layers, model.num_experts or 0
    renames = _norm_renames(model, names)
    mtp_inner = re.compile(rf"(mtp\.layers\.\d+\.){mtp_layer_prefix(core_version)}\.(.*)")
    pieces: dict[str, tuple[Piece, ...]] = {}
    objects: list[str] = []
    for legacy, shape in shapes.items():
        layer, inner = _LAYER.fullmatch(legacy), mtp_inner.fullmatch(legacy)
        outer: list[tuple[int, int]] = []
        if layer:
            name = renames[model.layer_kinds[int(layer.group(1))]].get(layer.group(2), layer.group(2))
            if stacked_layers:  # one key for all layers: axis 0 is the layer
                base, outer = "decoder.layers.", [(int(layer.group(1)), num_layers)]
            else:
                base = f"decoder.layers.{layer.group(1)}."
        elif inner:
            base, name = f"{inner.group(1)}transformer_layer.", renames["attention"].get(inner.group(2), inner.group(2))
        else:
            base, name = "", legacy
        routed = _ROUTED.fullmatch(name)
        if routed:
            key = f"{base}{routed.group(1)}mlp.experts.experts.{routed.group(2)}.weight"
            expert_list = [int(routed.group(3))] if routed.group(3) else list(range(num_experts))
            inner_shape = shape if routed.group(3) else shape[1:]
            module = f"{base}{routed.group(1)}mlp.experts.experts.{routed.group(2)}"
        else:
            key, expert_list, inner_shape = base + name, [None], shape
            module = base + name[:-len(".weight")] if name.endswith(".weight") else None
        made = []
        for expert in expert_list:
            axes = outer + ([(expert, num_experts)] if expert is not None else [])
            for suffix, rows in _row_parts(name, inner_shape[0], model):
                first, stop = rows if rows is not None else (0, inner_shape[0])
                part_shape = (stop - first, *inner_shape[1:])
                made.append(Piece(
                    key=key + suffix,
                    global_shape=(*(size for _, size in axes), part_shape[0] if suffix else inner_shape[0],
                                  *inner_shape[1:]),
                    offsets=(*(index for index, _ in axes), 0 if suffix else first, *(0 for _ in inner_shape[1:])),
                    sizes=(*(1 for _ in axes), *part_shape),
                    expert=None if routed and routed.group(3) else expert,  # an index into stacked experts only
                    rows=rows))
            if module is not None and module.rsplit(".", 1)[-1] in LINEAR_MODULES:
                objects.append(_object_key(module, axes))
        pieces[legacy] = tuple(made)
    return TorchDistLayout(dict(shapes), pieces, tuple(objects))


def _object_key(module: str, axes: list[tuple[int, int]]) -> str:
    """A linear module's ``_extra_state`` ShardedObject key (``ShardedObject.unique_key``)."""
    offsets, shape = (tuple(zip(*axes)) if axes else ((0,), (1,)))
    return f"{module}._extra_state/shard_{'.'.join(map(str, offsets))}_{'.'.join(map(str, shape))}"


def part_of(key: str, model: ModelConfig, parts: int) -> int:
    """Which of ``parts`` parts (0 ..) writes a legacy key: the decoder layers in equal contiguous ranges (as
    pipeline stages take them), the embedding with the first range, the final norm, output layer and MTP block
    with the last."""
    layer = _LAYER.fullmatch(key)
    if layer:
        return int(layer.group(1)) * parts // model.num_layers
    return 0 if key.startswith("embedding.") else parts - 1
