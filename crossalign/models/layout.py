"""Every parameter of the Qwen3.5 model on both sides, with its shape, derived from the model config.

These tables are the single statement of what a correct checkpoint holds. The MindSpore
model, the PyTorch model, the converter's validation and the self-check all build on them,
so they are written out plainly per layer kind (SPEC section 3) rather than derived from
the conversion rules they check.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal, Mapping

from crossalign.config import ModelConfig
from crossalign.tensorio.errors import CheckpointError
from crossalign.versions import version_tuple

if TYPE_CHECKING:
    import torch

Shape = tuple[int, ...]
ExpertForm = Literal["per_expert", "stacked"]
EXPERT_FORMS: tuple[str, ...] = ("per_expert", "stacked")


def mtp_layer_prefix(core_version: str) -> str:
    """Attribute name of the MTP inner layer: renamed from transformer_layer to mtp_model_layer in core 0.17."""
    try:
        version = version_tuple(core_version)
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    return "mtp_model_layer" if version >= (0, 17) else "transformer_layer"


# ---- MindSpore / MindFormers side ---------------------------------------------------------------


def _ms_attention(m: ModelConfig) -> dict[str, Shape]:
    h = m.hidden_size
    return {
        "input_layernorm.weight": (h,),
        "self_attention.linear_qkv.weight": (m.qkv_rows, h),
        "self_attention.q_layernorm.weight": (m.kv_channels,),
        "self_attention.k_layernorm.weight": (m.kv_channels,),
        "self_attention.linear_proj.weight": (h, m.attention_output_size),
    }


def _ms_gdn(m: ModelConfig) -> dict[str, Shape]:
    h, nv = m.hidden_size, m.linear_num_value_heads
    if m.in_proj_layout == "fused":
        in_proj = {"self_attention.in_proj.weight": (m.in_proj_rows, h)}
    else:
        in_proj = {
            "self_attention.in_proj_qkv.weight": (m.conv_channels, h),
            "self_attention.linear_g.weight": (m.gdn_value_dim, h),
            "self_attention.linear_b.weight": (nv, h),
            "self_attention.linear_a.weight": (nv, h),
        }
    return {
        "input_layernorm.weight": (h,),
        **in_proj,
        "self_attention.conv1d.weight": (m.conv_channels, 1, 1, m.linear_conv_kernel_dim),
        "self_attention.a_log": (nv,),
        "self_attention.dt_bias": (nv,),
        "self_attention.out_norm.weight": (m.linear_value_head_dim,),
        "self_attention.linear_proj.weight": (h, m.gdn_value_dim),
    }


def _ms_ffn(m: ModelConfig) -> dict[str, Shape]:
    h = m.hidden_size
    if not m.is_moe:
        return {
            "pre_mlp_layernorm.weight": (h,),
            "mlp.linear_fc1.weight": (2 * m.ffn_hidden_size, h),
            "mlp.linear_fc2.weight": (h, m.ffn_hidden_size),
        }
    e, i, s = m.num_experts, m.moe_ffn_hidden_size, m.moe_shared_expert_intermediate_size
    shapes = {
        "pre_mlp_layernorm.weight": (h,),
        "mlp.router.weight": (e, h),
        "mlp.experts.weight1": (e, h, 2 * i),
        "mlp.experts.weight2": (e, i, h),
        "mlp.shared_experts.linear_fc1.weight": (2 * s, h),
        "mlp.shared_experts.linear_fc2.weight": (h, s),
    }
    if m.moe_shared_expert_gate:
        shapes["mlp.shared_experts.shared_experts_gate.weight"] = (1, h)
    return shapes


def _ms_mtp(m: ModelConfig) -> dict[str, Shape]:
    h = m.hidden_size
    inner = {**_ms_attention(m), **_ms_ffn(m)}
    return {
        "enorm.weight": (h,),
        "hnorm.weight": (h,),
        "eh_proj.weight": (h, 2 * h),
        **{f"transformer_layer.{k}": v for k, v in inner.items()},
        "final_layernorm.weight": (h,),
    }


def mindformers_shapes(model: ModelConfig) -> dict[str, Shape]:
    """Every MindFormers parameter name (pynative expert layout) and its shape, in model order."""
    m = model
    shapes: dict[str, Shape] = {"embedding.word_embeddings.weight": (m.padded_vocab_size, m.hidden_size)}
    for i, kind in enumerate(m.layer_kinds):
        mixer = _ms_attention(m) if kind == "attention" else _ms_gdn(m)
        shapes.update({f"decoder.layers.{i}.{k}": v for k, v in {**mixer, **_ms_ffn(m)}.items()})
    shapes["decoder.final_layernorm.weight"] = (m.hidden_size,)
    shapes["output_layer.weight"] = (m.padded_vocab_size, m.hidden_size)
    for k in range(m.mtp_num_layers):
        shapes.update({f"mtp.layers.{k}.{key}": v for key, v in _ms_mtp(m).items()})
    return shapes


def mindformers_buffers(model: ModelConfig) -> dict[str, Shape]:
    """The non-trainable buffers MindFormers' pynative model saves beside its weights, with their shapes.

    Each MoE layer, the MTP layer's included, counts the tokens routed to each expert in
    ``mlp.tokens_per_expert`` (E,) float32 (mindformers 2.1.0 ``pynative/transformers/moe/moe_layer.py:84``).
    Megatron has no such state (its counts are not saved), so a conversion leaves them out.
    """
    if not model.is_moe:
        return {}
    layers = [f"decoder.layers.{i}." for i in range(model.num_layers)]
    layers += [f"mtp.layers.{k}.transformer_layer." for k in range(model.mtp_num_layers)]
    return {f"{prefix}mlp.tokens_per_expert": (model.num_experts,) for prefix in layers}


# ---- Megatron (TE spec, torch state dict) side --------------------------------------------------


def _mg_attention(m: ModelConfig) -> dict[str, Shape]:
    h = m.hidden_size
    return {
        "self_attention.linear_qkv.layer_norm_weight": (h,),
        "self_attention.linear_qkv.weight": (m.qkv_rows, h),
        "self_attention.q_layernorm.weight": (m.kv_channels,),
        "self_attention.k_layernorm.weight": (m.kv_channels,),
        "self_attention.linear_proj.weight": (h, m.attention_output_size),
    }


def _mg_gdn(m: ModelConfig) -> dict[str, Shape]:
    h, nv = m.hidden_size, m.linear_num_value_heads
    return {
        "self_attention.in_proj.layer_norm_weight": (h,),
        "self_attention.in_proj.weight": (m.in_proj_rows, h),
        "self_attention.conv1d.weight": (m.conv_channels, 1, m.linear_conv_kernel_dim),
        "self_attention.A_log": (nv,),
        "self_attention.dt_bias": (nv,),
        "self_attention.out_norm.weight": (m.linear_value_head_dim,),
        "self_attention.out_proj.weight": (h, m.gdn_value_dim),
    }


def _mg_ffn(m: ModelConfig, experts: ExpertForm) -> dict[str, Shape]:
    h = m.hidden_size
    if not m.is_moe:
        return {
            "mlp.linear_fc1.layer_norm_weight": (h,),
            "mlp.linear_fc1.weight": (2 * m.ffn_hidden_size, h),
            "mlp.linear_fc2.weight": (h, m.ffn_hidden_size),
        }
    e, i, s = m.num_experts, m.moe_ffn_hidden_size, m.moe_shared_expert_intermediate_size
    if experts == "stacked":
        routed = {"mlp.experts.linear_fc1.weight": (e, 2 * i, h), "mlp.experts.linear_fc2.weight": (e, h, i)}
    else:
        routed = {f"mlp.experts.linear_fc1.weight{j}": (2 * i, h) for j in range(e)}
        routed.update({f"mlp.experts.linear_fc2.weight{j}": (h, i) for j in range(e)})
    shapes = {
        "pre_mlp_layernorm.weight": (h,),
        "mlp.router.weight": (e, h),
        **routed,
        "mlp.shared_experts.linear_fc1.weight": (2 * s, h),
        "mlp.shared_experts.linear_fc2.weight": (h, s),
    }
    if m.moe_shared_expert_gate:
        shapes["mlp.shared_experts.gate_weight"] = (1, h)
    return shapes


def check_expert_form(experts: str) -> ExpertForm:
    if experts not in EXPERT_FORMS:
        raise CheckpointError(f"expert form {experts!r} is not one of {', '.join(EXPERT_FORMS)}")
    return experts  # type: ignore[return-value]


def megatron_shapes(model: ModelConfig, core_version: str = "0.16.1",
                    experts: str = "per_expert") -> dict[str, Shape]:
    """Every Megatron state-dict key (TP=1, PP=1, no ``_extra_state``) and its shape, in model order."""
    m, form = model, check_expert_form(experts)
    shapes: dict[str, Shape] = {"embedding.word_embeddings.weight": (m.padded_vocab_size, m.hidden_size)}
    for i, kind in enumerate(m.layer_kinds):
        mixer = _mg_attention(m) if kind == "attention" else _mg_gdn(m)
        shapes.update({f"decoder.layers.{i}.{k}": v for k, v in {**mixer, **_mg_ffn(m, form)}.items()})
    shapes["decoder.final_layernorm.weight"] = (m.hidden_size,)
    shapes["output_layer.weight"] = (m.padded_vocab_size, m.hidden_size)
    prefix = mtp_layer_prefix(core_version)
    h = m.hidden_size
    for k in range(m.mtp_num_layers):
        base = f"mtp.layers.{k}."
        shapes[base + "enorm.weight"] = (h,)
        shapes[base + "hnorm.weight"] = (h,)
        shapes[base + "eh_proj.weight"] = (h, 2 * h)
        for key, v in {**_mg_attention(m), **_mg_ffn(m, form)}.items():
            shapes[f"{base}{prefix}.{key}"] = v
        shapes[base + "final_layernorm.weight"] = (h,)
    return shapes


# ---- a realistic random initialisation ----------------------------------------------------------

NORM_SUFFIXES = ("layernorm.weight", "enorm.weight", "hnorm.weight", "out_norm.weight")  # MindFormers' gammas


def random_mindformers_state(model: ModelConfig, seed: int) -> dict:
    """A fresh fp32 model in MindFormers layout, initialised the way both frameworks do.

    Linear weights and the embedding are normal(0, init_method_std); norms are 1.0;
    A_log = log(uniform(1, 16)); dt_bias is the softplus inverse of dt drawn log-uniformly
    in [1e-3, 1e-1]; the depthwise conv1d keeps torch's default uniform(+-1/sqrt(K)).
    The result depends only on the config and the seed.
    """
    # torch: an optional framework (not in the base install), needed only here
    import torch

    gen = torch.Generator().manual_seed(seed)
    std = model.init_method_std
    state: dict[str, torch.Tensor] = {}
    for name, shape in mindformers_shapes(model).items():
        if name.endswith(NORM_SUFFIXES):
            tensor = torch.ones(shape)
        elif name.endswith("a_log"):
            tensor = torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log_()
        elif name.endswith("dt_bias"):
            log_dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen)
            dt = log_dt.exp()
            tensor = dt + torch.log(-torch.expm1(-dt))
        elif name.endswith("conv1d.weight"):
            bound = 1.0 / math.sqrt(model.linear_conv_kernel_dim)
            tensor = torch.empty(shape).uniform_(-bound, bound, generator=gen)
        else:
            tensor = torch.empty(shape).normal_(0.0, std, generator=gen)
        state[name] = tensor
    return state


def unstack_expert_weights(state: dict, prefix: str, num_experts: int) -> None:
    """Replace a stacked ``<prefix>weight`` [E, out, in] in ``state`` by ``<prefix>weight0..weight{E-1}``.

    Megatron's TE grouped experts save one tensor per expert; converters may send the stacked form
    and rely on a load hook. A tensor of any other shape is left alone (and reported as unexpected).
    """
    stacked = state.get(prefix + "weight")
    if stacked is None or stacked.dim() != 3 or stacked.shape[0] != num_experts:
        return
    del state[prefix + "weight"]
    for index in range(num_experts):
        state[f"{prefix}weight{index}"] = stacked[index]


def split_stacked_experts(state: Mapping[str, torch.Tensor], num_experts: int | None) -> dict[str, torch.Tensor]:
    """The state with stacked routed experts ([E, out, in] under ``linear_fc{1,2}.weight``) split into
    ``weight0 .. weight{E-1}``, as TransformerEngine's load hook splits them (and every model holds them)."""
    out = dict(state)
    if num_experts is not None:
        for key in list(out):
            if key.endswith((".mlp.experts.linear_fc1.weight", ".mlp.experts.linear_fc2.weight")):
                unstack_expert_weights(out, key[: -len("weight")], num_experts)
    return out
