"""Megatron's TransformerEngine parameter names <-> megatron-core's local-module names, as data.

A converted checkpoint is in the TE layout (what a GPU run loads). megatron-core built with
its local modules (the CPU path: ``patches/megatron/pretrain_qwen35.py``'s specs, ``use_te=False``)
holds the same tensors under other names, because TE fuses each norm into the linear after it
and groups the routed experts into one module:

| TE (per layer) | local |
|---|---|
| self_attention.linear_qkv.layer_norm_weight (attention) | input_layernorm.weight |
| self_attention.in_proj.layer_norm_weight (GDN) | input_layernorm.weight |
| mlp.linear_fc1.layer_norm_weight (dense) | pre_mlp_layernorm.weight |
| mlp.experts.linear_fc{1,2}.weight{j} (MoE) | mlp.experts.local_experts.{j}.linear_fc{1,2}.weight |

Every other key is the same on both sides. The map is built per layer from the model config,
like the conversion rules (``rules.py``), so it has an exact inverse. Keys not in the map pass
through unchanged: a missing or unexpected key is left for the strict load to name.
"""

from __future__ import annotations

from typing import Mapping, TypeVar

from crossalign.models.layout import mtp_layer_prefix
from crossalign.config import ModelConfig

T = TypeVar("T")


def layer_renames(model: ModelConfig, kind: str) -> list[tuple[str, str]]:
    """(TE name, local name) of one layer of ``kind`` ("attention" or "gdn"), relative to the layer."""
    mixer = "self_attention.linear_qkv" if kind == "attention" else "self_attention.in_proj"
    renames = [(f"{mixer}.layer_norm_weight", "input_layernorm.weight")]
    if model.is_moe:
        renames += [(f"mlp.experts.linear_fc{n}.weight{j}", f"mlp.experts.local_experts.{j}.linear_fc{n}.weight")
                    for n in (1, 2) for j in range(model.num_experts)]
    else:
        renames.append(("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"))
    return renames


def te_to_local_names(model: ModelConfig, core_version: str) -> dict[str, str]:
    """Every renamed key of the model, TE name -> local name (decoder layers and MTP inner layers)."""
    names = {}
    for index, kind in enumerate(model.layer_kinds):
        prefix = f"decoder.layers.{index}."
        names.update({prefix + te: prefix + local for te, local in layer_renames(model, kind)})
    inner = mtp_layer_prefix(core_version)
    for k in range(model.mtp_num_layers):
        prefix = f"mtp.layers.{k}.{inner}."
        names.update({prefix + te: prefix + local for te, local in layer_renames(model, "attention")})
    return names


def local_to_te_names(model: ModelConfig, core_version: str) -> dict[str, str]:
    """The inverse map, local name -> TE name."""
    return {local: te for te, local in te_to_local_names(model, core_version).items()}


def _renamed(state: Mapping[str, T], names: Mapping[str, str]) -> dict[str, T]:
    return {names.get(key, key): value for key, value in state.items()}


def te_to_local(state: Mapping[str, T], model: ModelConfig, core_version: str) -> dict[str, T]:
    """A TE-layout state dict under megatron-core's local names (TE ``*._extra_state`` entries dropped)."""
    kept = {key: value for key, value in state.items() if not key.endswith("._extra_state")}
    return _renamed(kept, te_to_local_names(model, core_version))


def local_to_te(state: Mapping[str, T], model: ModelConfig, core_version: str) -> dict[str, T]:
    """A local-layout state dict under the TE names (what a GPU run loads)."""
    return _renamed(state, local_to_te_names(model, core_version))
