"""Tiny Hugging Face Qwen3.5 checkpoints made here: transformers' own config and model, random weights,
``save_pretrained`` in shards, and an MTP layer added in the layout released checkpoints use
(``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.norm``,
``mtp.layers.0.*`` named like a trunk full-attention layer) in a shard of its own. Nothing is downloaded.

The sizes are those of the shipped tiny configs, written out here as HF fields so that the
import is checked against an independent statement of them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

COMMON = dict(vocab_size=2048, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=4096,
              rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
              tie_word_embeddings=False)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
           router_aux_loss_coef=0.001)
ZERO_CENTRED = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight")


def hf_model(kind: str, seed: int):
    """A transformers Qwen3.5 (dense) or Qwen3.5-MoE text model with random weights, norms included."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    torch.manual_seed(seed)
    if kind == "dense":
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(intermediate_size=192, **COMMON))
    else:
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**COMMON, **MOE))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(ZERO_CENTRED) or name.endswith("linear_attn.norm.weight"):
                param.normal_(0.0, 0.2)  # trained norms are not at their initial value
    return model


def mtp_state(directory: Path, seed: int) -> dict[str, torch.Tensor]:
    """An MTP layer in the released layout, shaped like the saved checkpoint's full-attention layer."""
    from safetensors import safe_open

    config = json.loads((directory / "config.json").read_text())
    gen = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    source = f"model.layers.{config['layer_types'].index('full_attention')}."
    state = {"mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=gen) * 0.02}
    for name in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
        state[name] = torch.randn(hidden, generator=gen) * 0.2
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                if key.startswith(source):
                    scale = 0.2 if key.endswith(ZERO_CENTRED) else 0.02
                    shape = handle.get_slice(key).get_shape()
                    state["mtp.layers.0." + key[len(source):]] = torch.randn(shape, generator=gen) * scale
    return state


def make_hf_checkpoint(directory: Path, kind: str, seed: int = 7, dtype: torch.dtype = torch.bfloat16) -> Path:
    """save_pretrained in shards (so there is an index), then the MTP shard added to the index."""
    model = hf_model(kind, seed).to(dtype)
    model.save_pretrained(directory, max_shard_size="200KB")
    mtp = {key: tensor.to(dtype) for key, tensor in mtp_state(directory, seed + 1).items()}
    save_file(mtp, str(directory / "model-mtp.safetensors"), metadata={"format": "pt"})
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update({key: "model-mtp.safetensors" for key in mtp})
    index_path.write_text(json.dumps(index, indent=2))
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["mtp_num_hidden_layers"] = 1
    config_path.write_text(json.dumps(config, indent=2))
    return directory
