"""The MindSpore <-> Megatron mapping of SPEC section 3, written as data.

Each rule is one row of a table: the MindFormers keys it reads, the Megatron keys it
writes, ``forward`` (MindSpore -> Megatron) and ``inverse``. Keys are relative to a layer;
a ``PlacedRule`` puts a rule under a layer's prefix on each side. The rule set of a layer
follows its kind (full attention or GDN mixer, dense or MoE FFN) from the model config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from crossalign.tensorio.errors import CheckpointError
from crossalign.models.layout import NORM_SUFFIXES, mtp_layer_prefix
from crossalign.config import ModelConfig

Tensors = list[torch.Tensor]


class Rule:
    """One row of a mapping table."""

    @property
    def ms(self) -> tuple[str, ...]:
        raise NotImplementedError

    @property
    def mg(self) -> tuple[str, ...]:
        raise NotImplementedError

    def forward(self, tensors: Tensors) -> Tensors:
        raise NotImplementedError

    def inverse(self, tensors: Tensors) -> Tensors:
        raise NotImplementedError


@dataclass(frozen=True)
class OneToOne(Rule):
    """A rule from one MindFormers tensor to one Megatron tensor."""

    source: str
    target: str

    @property
    def ms(self) -> tuple[str, ...]:
        return (self.source,)

    @property
    def mg(self) -> tuple[str, ...]:
        return (self.target,)


@dataclass(frozen=True)
class Rename(OneToOne):
    """Same tensor, another name (a plain copy when the names agree)."""

    def forward(self, tensors: Tensors) -> Tensors:
        return [tensors[0]]

    def inverse(self, tensors: Tensors) -> Tensors:
        return [tensors[0]]


def Copy(name: str) -> Rename:  # noqa: N802 - reads as a table row, like the classes
    return Rename(name, name)


@dataclass(frozen=True)
class ManyToOne(Rule):
    """A rule from several source tensors (``parts``, in order) to one Megatron tensor."""

    parts: tuple[str, ...]
    target: str

    @property
    def ms(self) -> tuple[str, ...]:
        return self.parts

    @property
    def mg(self) -> tuple[str, ...]:
        return (self.target,)


@dataclass(frozen=True)
class Fuse(ManyToOne):
    """Several MindSpore projections stacked on rows into one Megatron projection, in the given order."""

    sizes: tuple[int, ...]

    def forward(self, tensors: Tensors) -> Tensors:
        return [torch.cat(tensors, dim=0)]

    def inverse(self, tensors: Tensors) -> Tensors:
        return list(torch.split(tensors[0], self.sizes, dim=0))


@dataclass(frozen=True)
class Squeeze(OneToOne):
    """Drop a size-1 axis (MindSpore stores the depthwise conv1d as a Conv2d weight, (C, 1, 1, K))."""

    dim: int

    def forward(self, tensors: Tensors) -> Tensors:
        if tensors[0].shape[self.dim] != 1:
            raise CheckpointError(f"{self.source}: axis {self.dim} of shape {list(tensors[0].shape)} is not 1")
        return [tensors[0].squeeze(self.dim)]

    def inverse(self, tensors: Tensors) -> Tensors:
        return [tensors[0].unsqueeze(self.dim)]


@dataclass(frozen=True)
class Deinterleave(OneToOne):
    """SwiGLU fc1: MindSpore rows [g0, u0, g1, u1, ...] -> Megatron [G; U] = cat(w[0::2], w[1::2])."""

    def forward(self, tensors: Tensors) -> Tensors:
        weight = tensors[0]
        return [torch.cat((weight[0::2], weight[1::2]), dim=0)]

    def inverse(self, tensors: Tensors) -> Tensors:
        gate, up = tensors[0].chunk(2, dim=0)
        return [torch.stack((gate, up), dim=1).reshape(tensors[0].shape)]


@dataclass(frozen=True)
class TransposeExperts(OneToOne):
    """Routed experts: MindSpore [E, in, out] -> Megatron [E, out, in], stacked or one tensor per expert.

    MindSpore's pynative layout is [E, H, 2i] / [E, i, H]; graph mode flattens it to
    [E*H, 2i] / [E*i, H], read here as the same memory. Megatron's TE grouped experts hold
    ``weight0..weight{E-1}`` (per_expert); ``stacked`` sends one [E, out, in] tensor.
    The gate|up halves are not swapped, and routed experts are never interleaved.
    """

    num_experts: int
    per_expert: bool

    @property
    def mg(self) -> tuple[str, ...]:
        if self.per_expert:
            return tuple(f"{self.target}{e}" for e in range(self.num_experts))
        return (self.target,)

    def stacked_input(self, weight: torch.Tensor) -> torch.Tensor:
        """The MindSpore weight as [E, in, out], whichever of its two layouts it came in."""
        return weight.reshape(self.num_experts, -1, weight.shape[-1])

    def outputs(self, stacked: torch.Tensor) -> Tensors:
        """Megatron tensors from a stacked [E, out, in] tensor, each with storage of its own."""
        if self.per_expert:
            return [stacked[e].clone() for e in range(self.num_experts)]
        return [stacked.contiguous()]

    def forward(self, tensors: Tensors) -> Tensors:
        return self.outputs(self.stacked_input(tensors[0]).transpose(1, 2))

    def inverse(self, tensors: Tensors) -> Tensors:
        if not self.per_expert:
            return [tensors[0].transpose(1, 2).contiguous()]
        # Each expert transposed straight into its place: stacking first would copy every expert twice.
        out, inp = tensors[0].shape
        weight = torch.empty((len(tensors), inp, out), dtype=tensors[0].dtype)
        for e, tensor in enumerate(tensors):
            weight[e].copy_(tensor.transpose(0, 1))
        return [weight]


@dataclass(frozen=True)
class PlacedRule:
    """A rule under a layer's prefix on each side."""

    rule: Rule
    ms_prefix: str = ""
    mg_prefix: str = ""

    @property
    def ms_keys(self) -> tuple[str, ...]:
        return tuple(self.ms_prefix + key for key in self.rule.ms)

    @property
    def mg_keys(self) -> tuple[str, ...]:
        return tuple(self.mg_prefix + key for key in self.rule.mg)


@dataclass(frozen=True)
class ZeroCentre(Rule):
    """A norm gamma under Megatron's --apply-layernorm-1p: Megatron stores w = g - 1 for MindSpore's plain g.

    Both are exact in fp32 and bf16 for gammas in [0.5, 2] (the difference of two floats within
    a factor 2 of each other is representable), so the round trip is bit for bit there.
    """

    rule: Rule

    @property
    def ms(self) -> tuple[str, ...]:
        return self.rule.ms

    @property
    def mg(self) -> tuple[str, ...]:
        return self.rule.mg

    def forward(self, tensors: Tensors) -> Tensors:
        return [tensor - 1 for tensor in self.rule.forward(tensors)]

    def inverse(self, tensors: Tensors) -> Tensors:
        return self.rule.inverse([tensor + 1 for tensor in tensors])


# ---- rule sets per layer kind (SPEC section 3) --------------------------------------------------

GLOBAL_RULES: tuple[Rule, ...] = (
    Copy("embedding.word_embeddings.weight"),
    Copy("decoder.final_layernorm.weight"),
    Copy("output_layer.weight"),
)


def attention_rules(model: ModelConfig) -> list[Rule]:
    """Full-attention mixer: linear_qkv is already per query group [q, gate, k, v]; TE fuses the input norm."""
    return [
        Rename("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
        Copy("self_attention.linear_qkv.weight"),
        Copy("self_attention.q_layernorm.weight"),
        Copy("self_attention.k_layernorm.weight"),
        Copy("self_attention.linear_proj.weight"),
    ]


def gdn_rules(model: ModelConfig) -> list[Rule]:
    """GatedDeltaNet mixer; dense MindFormers checkpoints split in_proj into qkv | z | beta | alpha."""
    m = model
    if m.in_proj_layout == "split":
        in_proj: Rule = Fuse(
            ("self_attention.in_proj_qkv.weight", "self_attention.linear_g.weight",
             "self_attention.linear_b.weight", "self_attention.linear_a.weight"),
            "self_attention.in_proj.weight",
            (m.conv_channels, m.gdn_value_dim, m.linear_num_value_heads, m.linear_num_value_heads),
        )
    else:
        in_proj = Copy("self_attention.in_proj.weight")
    return [
        Rename("input_layernorm.weight", "self_attention.in_proj.layer_norm_weight"),
        in_proj,
        Squeeze("self_attention.conv1d.weight", "self_attention.conv1d.weight", dim=2),
        Rename("self_attention.a_log", "self_attention.A_log"),
        Copy("self_attention.dt_bias"),
        Copy("self_attention.out_norm.weight"),
        Rename("self_attention.linear_proj.weight", "self_attention.out_proj.weight"),
    ]


def dense_ffn_rules(model: ModelConfig) -> list[Rule]:
    return [
        Rename("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
        Deinterleave("mlp.linear_fc1.weight", "mlp.linear_fc1.weight"),
        Copy("mlp.linear_fc2.weight"),
    ]


def moe_ffn_rules(model: ModelConfig, experts: str) -> list[Rule]:
    per_expert = experts == "per_expert"
    rules: list[Rule] = [
        Copy("pre_mlp_layernorm.weight"),
        Copy("mlp.router.weight"),
        TransposeExperts("mlp.experts.weight1", "mlp.experts.linear_fc1.weight", model.num_experts, per_expert),
        TransposeExperts("mlp.experts.weight2", "mlp.experts.linear_fc2.weight", model.num_experts, per_expert),
        Deinterleave("mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight"),
        Copy("mlp.shared_experts.linear_fc2.weight"),
    ]
    if model.moe_shared_expert_gate:
        rules.append(Rename("mlp.shared_experts.shared_experts_gate.weight", "mlp.shared_experts.gate_weight"))
    return rules


def ffn_rules(model: ModelConfig, experts: str) -> list[Rule]:
    return moe_ffn_rules(model, experts) if model.is_moe else dense_ffn_rules(model)


MTP_OWN_RULES: tuple[Rule, ...] = (
    Copy("enorm.weight"),
    Copy("hnorm.weight"),
    Copy("eh_proj.weight"),
    Copy("final_layernorm.weight"),
)


def conversion_plan(model: ModelConfig, core_version: str = "0.16.1", experts: str = "per_expert") -> list[PlacedRule]:
    """Every rule of the model, placed; each MindFormers and each Megatron key appears exactly once."""
    plan = [PlacedRule(rule) for rule in GLOBAL_RULES]
    for index, kind in enumerate(model.layer_kinds):
        prefix = f"decoder.layers.{index}."
        mixer = attention_rules(model) if kind == "attention" else gdn_rules(model)
        plan += [PlacedRule(rule, prefix, prefix) for rule in mixer + ffn_rules(model, experts)]
    inner = mtp_layer_prefix(core_version)
    for k in range(model.mtp_num_layers):
        base = f"mtp.layers.{k}."
        plan += [PlacedRule(rule, base, base) for rule in MTP_OWN_RULES]
        plan += [PlacedRule(rule, f"{base}transformer_layer.", f"{base}{inner}.")
                 for rule in attention_rules(model) + ffn_rules(model, experts)]
    if model.norm_convention == "zero_centred":
        plan = [PlacedRule(ZeroCentre(p.rule), p.ms_prefix, p.mg_prefix) if p.rule.ms[0].endswith(NORM_SUFFIXES)
                else p for p in plan]
    return plan
