"""A Hugging Face Qwen3.5 ``config.json`` read into a crossalign model config, and written back from one.

transformers 5.24 describes the text model with ``Qwen3_5TextConfig`` (``model_type``
``qwen3_5_text``) and ``Qwen3_5MoeTextConfig`` (``qwen3_5_moe_text``); released checkpoints
are the vision-language wrappers (``qwen3_5``, ``qwen3_5_moe``) with the text model under
``text_config``. Fields map one to one, except:

- ``layer_types`` must be the 3:1 pattern (layer i full attention iff (i+1) % freq == 0);
- RoPE sits in ``rope_parameters`` (``rope_theta``, ``partial_rotary_factor``, default 0.25);
- ``mtp_num_hidden_layers`` (released checkpoints; absent in ``save_pretrained`` output, where
  the MTP weights tell);
- HF renormalises the top-k router weights always and always gates the shared expert;
- the embedding has exactly ``vocab_size`` rows, so vocab and padded vocab are the same.

Anything the crossalign model cannot express (tied embeddings, biases, another activation, an
irregular layer pattern, more than one MTP layer) is an error naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from crossalign.config import ConfigError, ModelConfig

TEXT_TYPES = {"qwen3_5_text": "dense", "qwen3_5_moe_text": "moe"}
WRAPPER_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
ARCHITECTURES = {"dense": "Qwen3_5ForCausalLM", "moe": "Qwen3_5MoeForCausalLM"}
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25  # Qwen3_5TextConfig.__post_init__


def read_config_json(directory: Path) -> dict[str, Any]:
    """The text-model part of ``DIR/config.json`` (``text_config`` of a vision-language checkpoint)."""
    path = Path(directory) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no config.json in the Hugging Face checkpoint folder") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from None
    model_type = raw.get("model_type")
    if model_type in WRAPPER_TYPES:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{path}: model_type {model_type!r} without a text_config")
        return {"model_type": WRAPPER_TYPES[model_type], **text}
    if model_type not in TEXT_TYPES:
        known = ", ".join([*TEXT_TYPES, *WRAPPER_TYPES])
        raise ConfigError(f"{path}: model_type {model_type!r} is not a Qwen3.5 model ({known})")
    return raw


def _field(hf: dict[str, Any], key: str, origin: str) -> Any:
    if key not in hf:
        raise ConfigError(f"{origin}: missing field {key}")
    return hf[key]


def _attention_frequency(layer_types: list[str], origin: str) -> int:
    """The freq of the pattern 'layer i is full attention iff (i+1) % freq == 0'."""
    if "full_attention" not in layer_types:
        raise ConfigError(f"{origin}: layer_types has no full_attention layer")
    freq = layer_types.index("full_attention") + 1
    expected = ["full_attention" if (i + 1) % freq == 0 else "linear_attention" for i in range(len(layer_types))]
    if layer_types != expected:
        raise ConfigError(f"{origin}: layer_types {layer_types} is not the pattern 'every {freq}th layer is "
                          "full attention'")
    return freq


def model_config_from_hf(hf: dict[str, Any], name: str, has_mtp_weights: bool, origin: str = "config.json") -> ModelConfig:
    """A crossalign ModelConfig from an HF text config (as read by :func:`read_config_json`)."""
    kind = TEXT_TYPES[hf["model_type"]]
    get = lambda key: _field(hf, key, origin)  # noqa: E731 - one short alias for the many lookups
    if hf.get("tie_word_embeddings", False):
        raise ConfigError(f"{origin}: tie_word_embeddings is true; crossalign models have an untied output layer")
    if hf.get("attention_bias", False):
        raise ConfigError(f"{origin}: attention_bias is true; crossalign models have no biases")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{origin}: hidden_act {hf['hidden_act']!r}; crossalign models use silu (SwiGLU)")
    rope = hf.get("rope_parameters") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise ConfigError(f"{origin}: missing field rope_parameters.rope_theta")
    layers = get("num_hidden_layers")
    layer_types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % hf.get("full_attention_interval", 4) == 0 else "linear_attention"
        for i in range(layers)]
    mtp_layers = hf.get("mtp_num_hidden_layers", 1 if has_mtp_weights else 0)
    if mtp_layers > 1:
        raise ConfigError(f"{origin}: mtp_num_hidden_layers {mtp_layers}: the Hugging Face layout holds one "
                          "MTP fc and norm pair, so crossalign imports at most one MTP layer")
    fields: dict[str, Any] = dict(
        name=name,
        hidden_size=get("hidden_size"),
        num_layers=layers,
        num_attention_heads=get("num_attention_heads"),
        num_query_groups=get("num_key_value_heads"),
        kv_channels=get("head_dim"),
        vocab_size=get("vocab_size"),
        padded_vocab_size=get("vocab_size"),
        max_position_embeddings=get("max_position_embeddings"),
        norm_epsilon=get("rms_norm_eps"),
        rotary_base=theta,
        rotary_percent=rope.get("partial_rotary_factor", hf.get("partial_rotary_factor",
                                                                DEFAULT_PARTIAL_ROTARY_FACTOR)),
        init_method_std=hf.get("initializer_range", 0.02),
        linear_attention_freq=_attention_frequency(list(layer_types), origin),
        linear_conv_kernel_dim=get("linear_conv_kernel_dim"),
        linear_key_head_dim=get("linear_key_head_dim"),
        linear_value_head_dim=get("linear_value_head_dim"),
        linear_num_key_heads=get("linear_num_key_heads"),
        linear_num_value_heads=get("linear_num_value_heads"),
        mtp_num_layers=mtp_layers,
    )
    if kind == "dense":
        fields["ffn_hidden_size"] = get("intermediate_size")
    else:
        fields.update(
            ffn_hidden_size=hf.get("intermediate_size", get("moe_intermediate_size")),
            num_experts=get("num_experts"),
            moe_router_topk=get("num_experts_per_tok"),
            moe_ffn_hidden_size=get("moe_intermediate_size"),
            moe_shared_expert_intermediate_size=get("shared_expert_intermediate_size"),
            moe_shared_expert_gate=True,
            norm_topk_prob=True,
            moe_aux_loss_coeff=hf.get("router_aux_loss_coef", 0.001),
        )
    try:
        return ModelConfig.model_validate(fields)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}"
                             for e in exc.errors())
        raise ConfigError(f"{origin}: does not make a valid crossalign model: {problems}") from None


def hf_config_from_model(model: ModelConfig, dtype: str) -> dict[str, Any]:
    """The ``config.json`` of the text model (what ``save_pretrained`` of Qwen3_5(Moe)ForCausalLM writes)."""
    m = model
    if m.vocab_size != m.padded_vocab_size:
        raise ConfigError(f"model {m.name}: vocab_size {m.vocab_size} != padded_vocab_size {m.padded_vocab_size}; "
                          "a Hugging Face embedding has exactly vocab_size rows")
    if m.mtp_num_layers > 1:
        raise ConfigError(f"model {m.name}: {m.mtp_num_layers} MTP layers; the Hugging Face layout holds one")
    if m.is_moe and not (m.norm_topk_prob and m.moe_shared_expert_gate and m.moe_router_topk_scaling_factor == 1.0):
        raise ConfigError(f"model {m.name}: Hugging Face Qwen3.5 always renormalises the top-k weights (scaling 1) "
                          "and gates the shared expert")
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[m.kind]],
        "model_type": "qwen3_5_moe_text" if m.is_moe else "qwen3_5_text",
        "dtype": dtype,
        "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups,
        "head_dim": m.kv_channels,
        "vocab_size": m.vocab_size,
        "max_position_embeddings": m.max_position_embeddings,
        "rms_norm_eps": m.norm_epsilon,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rotary_base,
                            "partial_rotary_factor": m.rotary_percent},
        "initializer_range": m.init_method_std,
        "layer_types": ["full_attention" if kind == "attention" else "linear_attention" for kind in m.layer_kinds],
        "linear_conv_kernel_dim": m.linear_conv_kernel_dim,
        "linear_key_head_dim": m.linear_key_head_dim,
        "linear_value_head_dim": m.linear_value_head_dim,
        "linear_num_key_heads": m.linear_num_key_heads,
        "linear_num_value_heads": m.linear_num_value_heads,
        "mtp_num_hidden_layers": m.mtp_num_layers,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
    }
    if m.is_moe:
        config.update(num_experts=m.num_experts, num_experts_per_tok=m.moe_router_topk,
                      moe_intermediate_size=m.moe_ffn_hidden_size,
                      shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
                      router_aux_loss_coef=m.moe_aux_loss_coeff)
    else:
        config["intermediate_size"] = m.ffn_hidden_size
    return config
