"""The Hugging Face <-> Megatron mapping of Qwen3.5, written as data, and the HF shape table.

An HF rule is a :class:`~crossalign.checkpoint.rules.Rule` whose source side (``ms``) holds
Hugging Face keys and whose target side (``mg``) holds Megatron keys, so the converter's
machinery (every key used once, specs before writing, streaming) runs it unchanged; a
MindFormers checkpoint is reached through Megatron with the rules of ``rules.py``.

Facts (transformers 5.24 ``models/qwen3_5/modeling_qwen3_5.py``, ``models/qwen3_5_moe/``):

- ``Qwen3_5RMSNorm`` is zero-centred, ``x_hat * (1 + w)`` with w initialised to 0: every
  input, post-attention, q/k, final and MTP norm. Megatron and MindFormers here use the plain
  gamma (no ``--apply-layernorm-1p``), so those weights get +1 on import and -1 on export,
  computed in fp32. The GDN gated norm (``linear_attn.norm``) is a plain ``w * x_hat``: a copy.
- ``q_proj`` rows are per head ``[q_h | gate_h]``; Megatron's ``linear_qkv`` is per query group
  ``[q heads | gate heads | k | v]`` (Megatron-Bridge ``QKVMapping`` with attention_output_gate).
- GDN: ``in_proj_qkv`` ([q|k|v]), ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` stack into Megatron's
  ``in_proj`` rows ``[q|k|v|z|beta|alpha]``; ``conv1d`` is [C, 1, K] on both sides.
- MoE: ``mlp.gate`` is the router; experts are saved one module per expert
  (``mlp.experts.{e}.gate_proj/up_proj/down_proj``, what ``save_pretrained`` and Qwen3.5 releases
  write) or packed (``mlp.experts.gate_up_proj`` [E, 2i, H], ``down_proj`` [E, H, i], Qwen3.6);
  gate_up is [gate; up] like Megatron's fc1; ``shared_expert`` and ``shared_expert_gate``.
- MTP (not in transformers' model: ``_keys_to_ignore_on_load_unexpected = [r"^mtp.*"]``; the
  layout of released checkpoints as vLLM ``qwen3_5_mtp.py`` and Megatron-Bridge load it):
  ``mtp.fc`` [H, 2H] over cat(embedding, hidden) = Megatron ``eh_proj``; ``mtp.pre_fc_norm_embedding``
  = ``enorm``, ``mtp.pre_fc_norm_hidden`` = ``hnorm``, ``mtp.norm`` = ``final_layernorm`` (all
  zero-centred); ``mtp.layers.0.*`` a full-attention decoder layer named like the trunk's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch

from crossalign.models.layout import Shape, mtp_layer_prefix
from crossalign.checkpoint.rules import Fuse, ManyToOne, OneToOne, PlacedRule, Rename, Rule, Tensors
from crossalign.config import ModelConfig

log = logging.getLogger(__name__)

HFExperts = Literal["per_expert", "packed"]
ROOTS = ("model.language_model.", "model.")  # vision-language releases, then save_pretrained of *ForCausalLM


@dataclass(frozen=True)
class ShiftNorm(OneToOne):
    """A zero-centred HF norm weight w as a plain gamma 1 + w (fp32), and back."""

    def forward(self, tensors: Tensors) -> Tensors:
        weight = tensors[0]
        gamma = weight.to(torch.promote_types(weight.dtype, torch.float32)) + 1
        lost = int(((gamma - 1).to(weight.dtype) != weight).sum())
        if lost:  # HF's forward rounds 1 + w in fp32 the same way: only an export back differs in these bits
            log.info("%s: %d values too close to 0 for 1 + w to hold them exactly in %s; an export back to "
                     "Hugging Face will not reproduce their last bits", self.source, lost, gamma.dtype)
        return [gamma]

    def inverse(self, tensors: Tensors) -> Tensors:
        gamma = tensors[0]
        return [gamma.to(torch.promote_types(gamma.dtype, torch.float32)) - 1]


@dataclass(frozen=True)
class GatedQKV(ManyToOne):
    """HF q_proj (rows per head [q_h | gate_h]), k_proj, v_proj -> Megatron linear_qkv (per group [q | gate | k | v])."""

    groups: int
    heads_per_group: int
    head_dim: int

    def forward(self, tensors: Tensors) -> Tensors:
        q_proj, k_proj, v_proj = tensors
        g, per, d, hidden = self.groups, self.heads_per_group, self.head_dim, q_proj.shape[-1]
        query_gate = q_proj.reshape(g, per, 2, d, hidden)
        return [torch.cat((query_gate[:, :, 0].reshape(g, per * d, hidden), query_gate[:, :, 1].reshape(g, per * d, hidden),
                           k_proj.reshape(g, d, hidden), v_proj.reshape(g, d, hidden)), dim=1).reshape(-1, hidden)]

    def inverse(self, tensors: Tensors) -> Tensors:
        g, per, d = self.groups, self.heads_per_group, self.head_dim
        hidden = tensors[0].shape[-1]
        grouped = tensors[0].reshape(g, 2 * per + 2, d, hidden)
        query_gate = torch.stack((grouped[:, :per], grouped[:, per:2 * per]), dim=2)  # [g, per, 2, d, hidden]
        return [query_gate.reshape(-1, hidden), grouped[:, 2 * per].reshape(-1, hidden).clone(),
                grouped[:, 2 * per + 1].reshape(-1, hidden).clone()]


@dataclass(frozen=True)
class Experts(Rule):
    """Routed experts, fc1 ([gate; up]) or fc2: HF per expert or packed <-> Megatron per expert or stacked."""

    which: Literal["fc1", "fc2"]
    num_experts: int
    hf_form: HFExperts
    mg_per_expert: bool

    @property
    def ms(self) -> tuple[str, ...]:
        if self.hf_form == "packed":
            return ("mlp.experts.gate_up_proj",) if self.which == "fc1" else ("mlp.experts.down_proj",)
        names = ("gate_proj", "up_proj") if self.which == "fc1" else ("down_proj",)
        return tuple(f"mlp.experts.{e}.{name}.weight" for e in range(self.num_experts) for name in names)

    @property
    def mg(self) -> tuple[str, ...]:
        base = f"mlp.experts.linear_{self.which}.weight"
        return tuple(f"{base}{e}" for e in range(self.num_experts)) if self.mg_per_expert else (base,)

    def forward(self, tensors: Tensors) -> Tensors:
        if self.hf_form == "packed":
            stacked = tensors[0]
        elif self.which == "fc1":
            stacked = torch.stack([torch.cat(tensors[2 * e:2 * e + 2], dim=0) for e in range(self.num_experts)])
        else:
            stacked = torch.stack(tensors)
        return [stacked[e].clone() for e in range(self.num_experts)] if self.mg_per_expert else [stacked.contiguous()]

    def inverse(self, tensors: Tensors) -> Tensors:
        stacked = torch.stack(tensors) if self.mg_per_expert else tensors[0]
        if self.hf_form == "packed":
            return [stacked.contiguous()]
        if self.which == "fc2":
            return [stacked[e].clone() for e in range(self.num_experts)]
        return [half.clone() for e in range(self.num_experts) for half in stacked[e].chunk(2, dim=0)]


# ---- rule sets per layer kind -------------------------------------------------------------------


def attention_rules(m: ModelConfig) -> list[Rule]:
    return [
        ShiftNorm("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
        GatedQKV(("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                 "self_attention.linear_qkv.weight", m.num_query_groups, m.heads_per_group, m.kv_channels),
        ShiftNorm("self_attn.q_norm.weight", "self_attention.q_layernorm.weight"),
        ShiftNorm("self_attn.k_norm.weight", "self_attention.k_layernorm.weight"),
        Rename("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
    ]


def gdn_rules(m: ModelConfig) -> list[Rule]:
    nv = m.linear_num_value_heads
    return [
        ShiftNorm("input_layernorm.weight", "self_attention.in_proj.layer_norm_weight"),
        Fuse(("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.in_proj_b.weight",
              "linear_attn.in_proj_a.weight"), "self_attention.in_proj.weight", (m.conv_channels, m.gdn_value_dim, nv, nv)),
        Rename("linear_attn.conv1d.weight", "self_attention.conv1d.weight"),
        Rename("linear_attn.A_log", "self_attention.A_log"),
        Rename("linear_attn.dt_bias", "self_attention.dt_bias"),
        Rename("linear_attn.norm.weight", "self_attention.out_norm.weight"),  # plain gamma on both sides
        Rename("linear_attn.out_proj.weight", "self_attention.out_proj.weight"),
    ]


def ffn_rules(m: ModelConfig, experts: str, hf_experts: HFExperts) -> list[Rule]:
    if not m.is_moe:
        return [
            ShiftNorm("post_attention_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
            Fuse(("mlp.gate_proj.weight", "mlp.up_proj.weight"), "mlp.linear_fc1.weight",
                 (m.ffn_hidden_size, m.ffn_hidden_size)),
            Rename("mlp.down_proj.weight", "mlp.linear_fc2.weight"),
        ]
    assert m.num_experts is not None and m.moe_shared_expert_intermediate_size is not None
    shared = m.moe_shared_expert_intermediate_size
    per_expert = experts == "per_expert"
    return [
        ShiftNorm("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
        Rename("mlp.gate.weight", "mlp.router.weight"),
        Experts("fc1", m.num_experts, hf_experts, per_expert),
        Experts("fc2", m.num_experts, hf_experts, per_expert),
        Fuse(("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
             "mlp.shared_experts.linear_fc1.weight", (shared, shared)),
        Rename("mlp.shared_expert.down_proj.weight", "mlp.shared_experts.linear_fc2.weight"),
        Rename("mlp.shared_expert_gate.weight", "mlp.shared_experts.gate_weight"),
    ]


MTP_OWN_RULES: tuple[Rule, ...] = (
    Rename("mtp.fc.weight", "eh_proj.weight"),
    ShiftNorm("mtp.pre_fc_norm_embedding.weight", "enorm.weight"),
    ShiftNorm("mtp.pre_fc_norm_hidden.weight", "hnorm.weight"),
    ShiftNorm("mtp.norm.weight", "final_layernorm.weight"),
)


def hf_plan(model: ModelConfig, core_version: str = "0.16.1", experts: str = "per_expert",
            hf_experts: HFExperts = "per_expert", root: str = "model.") -> list[PlacedRule]:
    """Every HF -> Megatron rule of the model, placed; ``root`` is the trunk's prefix in the HF checkpoint."""
    plan = [PlacedRule(Rename(f"{root}embed_tokens.weight", "embedding.word_embeddings.weight")),
            PlacedRule(ShiftNorm(f"{root}norm.weight", "decoder.final_layernorm.weight")),
            PlacedRule(Rename("lm_head.weight", "output_layer.weight"))]
    for index, kind in enumerate(model.layer_kinds):
        mixer = attention_rules(model) if kind == "attention" else gdn_rules(model)
        plan += [PlacedRule(rule, f"{root}layers.{index}.", f"decoder.layers.{index}.")
                 for rule in mixer + ffn_rules(model, experts, hf_experts)]
    if model.mtp_num_layers:
        plan += [PlacedRule(rule, "", "mtp.layers.0.") for rule in MTP_OWN_RULES]
        plan += [PlacedRule(rule, "mtp.layers.0.", f"mtp.layers.0.{mtp_layer_prefix(core_version)}.")
                 for rule in attention_rules(model) + ffn_rules(model, experts, hf_experts)]
    return plan


# ---- the HF shape table -------------------------------------------------------------------------


def _attention(m: ModelConfig) -> dict[str, Shape]:
    h, d = m.hidden_size, m.kv_channels
    return {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (2 * m.num_attention_heads * d, h),
        "self_attn.k_proj.weight": (m.num_query_groups * d, h),
        "self_attn.v_proj.weight": (m.num_query_groups * d, h),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "self_attn.o_proj.weight": (h, m.attention_output_size),
    }


def _gdn(m: ModelConfig) -> dict[str, Shape]:
    h, nv = m.hidden_size, m.linear_num_value_heads
    return {
        "input_layernorm.weight": (h,),
        "linear_attn.in_proj_qkv.weight": (m.conv_channels, h),
        "linear_attn.in_proj_z.weight": (m.gdn_value_dim, h),
        "linear_attn.in_proj_b.weight": (nv, h),
        "linear_attn.in_proj_a.weight": (nv, h),
        "linear_attn.conv1d.weight": (m.conv_channels, 1, m.linear_conv_kernel_dim),
        "linear_attn.A_log": (nv,),
        "linear_attn.dt_bias": (nv,),
        "linear_attn.norm.weight": (m.linear_value_head_dim,),
        "linear_attn.out_proj.weight": (h, m.gdn_value_dim),
    }


def _ffn(m: ModelConfig, hf_experts: HFExperts) -> dict[str, Shape]:
    h = m.hidden_size
    if not m.is_moe:
        f = m.ffn_hidden_size
        return {"post_attention_layernorm.weight": (h,), "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h),
                "mlp.down_proj.weight": (h, f)}
    e, i, s = m.num_experts, m.moe_ffn_hidden_size, m.moe_shared_expert_intermediate_size
    assert e is not None and i is not None and s is not None
    if hf_experts == "packed":
        routed = {"mlp.experts.gate_up_proj": (e, 2 * i, h), "mlp.experts.down_proj": (e, h, i)}
    else:
        routed = {}
        for j in range(e):
            routed.update({f"mlp.experts.{j}.gate_proj.weight": (i, h), f"mlp.experts.{j}.up_proj.weight": (i, h),
                           f"mlp.experts.{j}.down_proj.weight": (h, i)})
    return {"post_attention_layernorm.weight": (h,), "mlp.gate.weight": (e, h), **routed,
            "mlp.shared_expert.gate_proj.weight": (s, h), "mlp.shared_expert.up_proj.weight": (s, h),
            "mlp.shared_expert.down_proj.weight": (h, s), "mlp.shared_expert_gate.weight": (1, h)}


def hf_shapes(model: ModelConfig, hf_experts: HFExperts = "per_expert", root: str = "model.") -> dict[str, Shape]:
    """Every HF text-model key (MTP included) and its shape, in model order."""
    m, h = model, model.hidden_size
    shapes: dict[str, Shape] = {f"{root}embed_tokens.weight": (m.vocab_size, h)}
    for i, kind in enumerate(m.layer_kinds):
        mixer = _attention(m) if kind == "attention" else _gdn(m)
        shapes.update({f"{root}layers.{i}.{k}": v for k, v in {**mixer, **_ffn(m, hf_experts)}.items()})
    shapes[f"{root}norm.weight"] = (h,)
    shapes["lm_head.weight"] = (m.vocab_size, h)
    if m.mtp_num_layers:
        shapes.update({"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
                       "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)})
        shapes.update({f"mtp.layers.0.{k}": v for k, v in {**_attention(m), **_ffn(m, hf_experts)}.items()})
    return shapes
