"""The conversion rules of Qwen3.5 (SPEC section 3): one table per model, written as data.

Megatron's layout is the hub. Each row of a model's table is keyed by Megatron tensor(s) and
says how each other side holds them: a MindFormers rule and a Hugging Face rule. A rule's
``sources`` are its side's keys, its ``targets`` the Megatron keys, ``forward`` goes side ->
Megatron and ``inverse`` back; MindFormers <-> Hugging Face passes through Megatron. Keys are
relative to a block (a layer, an MTP layer's own tensors, the model's global tensors), and a
block gives each side its prefix. ``conversion_plan`` reads one side's column of the table as
a list of ``PlacedRule`` (source keys, Megatron target keys, the rule), which the converter runs.

The rows of a layer follow its kind (full attention or GDN mixer, dense or MoE FFN) from the
model config. Hugging Face facts (transformers 5.24 ``models/qwen3_5/modeling_qwen3_5.py``,
``models/qwen3_5_moe/``):

- ``Qwen3_5RMSNorm`` is zero-centred, ``x_hat * (1 + w)`` with w initialised to 0: every
  input, post-attention, q/k, final and MTP norm. MindFormers and Megatron here use the plain
  gamma (no ``--apply-layernorm-1p``), so those weights get +1 on import and -1 on export,
  computed in fp32. The GDN gated norm (``linear_attn.norm``) is a plain ``w * x_hat``: a copy.
  Under ``model.norm_convention: zero_centred`` Megatron stores every gamma as HF's w: the
  zero-centred norms are copied and the GDN gated norm shifted by -1.
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
  zero-centred); ``mtp.layers.0.*`` a full-attention decoder layer named like the trunk's. A
  Hugging Face checkpoint holds one MTP layer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch

from crossalign.checkpoint.hf import HFExperts
from crossalign.config import ModelConfig
from crossalign.models.layout import NORM_SUFFIXES, mtp_layer_prefix
from crossalign.tensorio.errors import CheckpointError

log = logging.getLogger(__name__)

Tensors = list[torch.Tensor]
Side = Literal["mindformers", "hf"]  # the sides a rule maps to Megatron
SIDES: tuple[Side, ...] = ("mindformers", "hf")


class Rule:
    """How one side holds some Megatron tensors: its keys (``sources``), Megatron's (``targets``), both transforms."""

    @property
    def sources(self) -> tuple[str, ...]:
        raise NotImplementedError

    @property
    def targets(self) -> tuple[str, ...]:
        raise NotImplementedError

    def forward(self, tensors: Tensors) -> Tensors:
        raise NotImplementedError

    def inverse(self, tensors: Tensors) -> Tensors:
        raise NotImplementedError


@dataclass(frozen=True)
class OneToOne(Rule):
    """A rule from one tensor of a side to one Megatron tensor."""

    source: str
    target: str

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.source,)

    @property
    def targets(self) -> tuple[str, ...]:
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
    """A rule from several tensors of a side (``parts``, in order) to one Megatron tensor."""

    parts: tuple[str, ...]
    target: str

    @property
    def sources(self) -> tuple[str, ...]:
        return self.parts

    @property
    def targets(self) -> tuple[str, ...]:
        return (self.target,)


@dataclass(frozen=True)
class Fuse(ManyToOne):
    """Several projections stacked on rows into one Megatron projection, in the given order."""

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
    def targets(self) -> tuple[str, ...]:
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
class ZeroCentre(Rule):
    """A norm gamma under Megatron's --apply-layernorm-1p: Megatron stores w = g - 1 for MindSpore's plain g.

    Both are exact in fp32 and bf16 for gammas in [0.5, 2] (the difference of two floats within
    a factor 2 of each other is representable), so the round trip is bit for bit there.
    """

    rule: Rule

    @property
    def sources(self) -> tuple[str, ...]:
        return self.rule.sources

    @property
    def targets(self) -> tuple[str, ...]:
        return self.rule.targets

    def forward(self, tensors: Tensors) -> Tensors:
        return [tensor - 1 for tensor in self.rule.forward(tensors)]

    def inverse(self, tensors: Tensors) -> Tensors:
        return self.rule.inverse([tensor + 1 for tensor in tensors])


@dataclass(frozen=True)
class ShiftNorm(OneToOne):
    """A zero-centred Hugging Face norm weight w as a plain gamma w + 1 (fp32), and back; ``by`` -1: the other way."""

    by: int = 1

    def forward(self, tensors: Tensors) -> Tensors:
        weight = tensors[0]
        gamma = weight.to(torch.promote_types(weight.dtype, torch.float32)) + self.by
        lost = int(((gamma - self.by).to(weight.dtype) != weight).sum())
        if lost:  # HF's forward rounds 1 + w in fp32 the same way: only an export back differs in these bits
            log.info("%s: %d values too close to 0 for w %+d to hold them exactly in %s; an export back to "
                     "Hugging Face will not reproduce their last bits", self.source, lost, self.by, gamma.dtype)
        return [gamma]

    def inverse(self, tensors: Tensors) -> Tensors:
        gamma = tensors[0]
        return [gamma.to(torch.promote_types(gamma.dtype, torch.float32)) - self.by]


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
    """Hugging Face routed experts, fc1 ([gate; up]) or fc2: per expert or packed <-> Megatron per expert or stacked."""

    which: Literal["fc1", "fc2"]
    num_experts: int
    hf_form: HFExperts
    mg_per_expert: bool

    @property
    def sources(self) -> tuple[str, ...]:
        if self.hf_form == "packed":
            return ("mlp.experts.gate_up_proj",) if self.which == "fc1" else ("mlp.experts.down_proj",)
        names = ("gate_proj", "up_proj") if self.which == "fc1" else ("down_proj",)
        return tuple(f"mlp.experts.{e}.{name}.weight" for e in range(self.num_experts) for name in names)

    @property
    def targets(self) -> tuple[str, ...]:
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


# ---- the table: rows keyed by Megatron tensors, a rule per side ---------------------------------


@dataclass(frozen=True)
class Row:
    """Megatron tensor(s) and how MindFormers and Hugging Face hold them (both rules write the same Megatron keys)."""

    mindformers: Rule
    hf: Rule

    def __post_init__(self) -> None:
        if self.mindformers.targets != self.hf.targets:
            raise ValueError(f"a row's rules write different Megatron keys: {self.mindformers.targets} "
                             f"and {self.hf.targets}")

    @property
    def megatron(self) -> tuple[str, ...]:
        return self.mindformers.targets

    def rule(self, side: Side) -> Rule:
        return self.mindformers if side == "mindformers" else self.hf


@dataclass(frozen=True)
class Block:
    """Rows under one prefix per side; ``hf`` None: Hugging Face has no such block (an MTP layer past the first)."""

    rows: tuple[Row, ...]
    megatron: str = ""
    mindformers: str = ""
    hf: str | None = ""


@dataclass(frozen=True)
class PlacedRule:
    """A rule of one side under its block's prefixes: it reads ``source_keys`` forward and writes ``target_keys``.

    The source keys are the side's (MindFormers or Hugging Face), the target keys Megatron's;
    run inverse, a placed rule reads the target keys and writes the source keys.
    """

    rule: Rule
    source_prefix: str = ""
    target_prefix: str = ""

    @property
    def source_keys(self) -> tuple[str, ...]:
        return tuple(self.source_prefix + key for key in self.rule.sources)

    @property
    def target_keys(self) -> tuple[str, ...]:
        return tuple(self.target_prefix + key for key in self.rule.targets)


def global_rows(root: str) -> list[Row]:
    """The embedding, final norm and output layer; ``root`` is the trunk's prefix in the HF checkpoint."""
    return [
        Row(Copy("embedding.word_embeddings.weight"),
            Rename(f"{root}embed_tokens.weight", "embedding.word_embeddings.weight")),
        Row(Copy("decoder.final_layernorm.weight"), ShiftNorm(f"{root}norm.weight", "decoder.final_layernorm.weight")),
        Row(Copy("output_layer.weight"), Rename("lm_head.weight", "output_layer.weight")),
    ]


def attention_rows(m: ModelConfig) -> list[Row]:
    """Full-attention mixer: MindFormers' linear_qkv is per query group [q, gate, k, v]; TE fuses the input norm."""
    qkv = "self_attention.linear_qkv.weight"
    return [
        Row(Rename("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
            ShiftNorm("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")),
        Row(Copy(qkv), GatedQKV(("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                                qkv, m.num_query_groups, m.heads_per_group, m.kv_channels)),
        Row(Copy("self_attention.q_layernorm.weight"),
            ShiftNorm("self_attn.q_norm.weight", "self_attention.q_layernorm.weight")),
        Row(Copy("self_attention.k_layernorm.weight"),
            ShiftNorm("self_attn.k_norm.weight", "self_attention.k_layernorm.weight")),
        Row(Copy("self_attention.linear_proj.weight"),
            Rename("self_attn.o_proj.weight", "self_attention.linear_proj.weight")),
    ]


def gdn_rows(m: ModelConfig) -> list[Row]:
    """GatedDeltaNet mixer; dense MindFormers checkpoints split in_proj into qkv | z | beta | alpha, as HF does."""
    nv, in_proj = m.linear_num_value_heads, "self_attention.in_proj.weight"
    sizes = (m.conv_channels, m.gdn_value_dim, nv, nv)
    ms_in_proj: Rule = Copy(in_proj)
    if m.in_proj_layout == "split":
        ms_in_proj = Fuse(("self_attention.in_proj_qkv.weight", "self_attention.linear_g.weight",
                           "self_attention.linear_b.weight", "self_attention.linear_a.weight"), in_proj, sizes)
    return [
        Row(Rename("input_layernorm.weight", "self_attention.in_proj.layer_norm_weight"),
            ShiftNorm("input_layernorm.weight", "self_attention.in_proj.layer_norm_weight")),
        Row(ms_in_proj, Fuse(("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
                              "linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"), in_proj, sizes)),
        Row(Squeeze("self_attention.conv1d.weight", "self_attention.conv1d.weight", dim=2),
            Rename("linear_attn.conv1d.weight", "self_attention.conv1d.weight")),
        Row(Rename("self_attention.a_log", "self_attention.A_log"),
            Rename("linear_attn.A_log", "self_attention.A_log")),
        Row(Copy("self_attention.dt_bias"), Rename("linear_attn.dt_bias", "self_attention.dt_bias")),
        Row(Copy("self_attention.out_norm.weight"),  # a plain gamma on both sides
            Rename("linear_attn.norm.weight", "self_attention.out_norm.weight")),
        Row(Rename("self_attention.linear_proj.weight", "self_attention.out_proj.weight"),
            Rename("linear_attn.out_proj.weight", "self_attention.out_proj.weight")),
    ]


def dense_ffn_rows(m: ModelConfig) -> list[Row]:
    fc1, f = "mlp.linear_fc1.weight", m.ffn_hidden_size
    return [
        Row(Rename("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
            ShiftNorm("post_attention_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")),
        Row(Deinterleave(fc1, fc1), Fuse(("mlp.gate_proj.weight", "mlp.up_proj.weight"), fc1, (f, f))),
        Row(Copy("mlp.linear_fc2.weight"), Rename("mlp.down_proj.weight", "mlp.linear_fc2.weight")),
    ]


def moe_ffn_rows(m: ModelConfig, experts: str, hf_experts: HFExperts) -> list[Row]:
    assert m.num_experts is not None and m.moe_shared_expert_intermediate_size is not None
    per_expert, shared = experts == "per_expert", m.moe_shared_expert_intermediate_size
    fc1 = "mlp.shared_experts.linear_fc1.weight"
    rows = [
        Row(Copy("pre_mlp_layernorm.weight"), ShiftNorm("post_attention_layernorm.weight", "pre_mlp_layernorm.weight")),
        Row(Copy("mlp.router.weight"), Rename("mlp.gate.weight", "mlp.router.weight")),
        Row(TransposeExperts("mlp.experts.weight1", "mlp.experts.linear_fc1.weight", m.num_experts, per_expert),
            Experts("fc1", m.num_experts, hf_experts, per_expert)),
        Row(TransposeExperts("mlp.experts.weight2", "mlp.experts.linear_fc2.weight", m.num_experts, per_expert),
            Experts("fc2", m.num_experts, hf_experts, per_expert)),
        Row(Deinterleave(fc1, fc1),
            Fuse(("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"), fc1, (shared, shared))),
        Row(Copy("mlp.shared_experts.linear_fc2.weight"),
            Rename("mlp.shared_expert.down_proj.weight", "mlp.shared_experts.linear_fc2.weight")),
    ]
    if m.moe_shared_expert_gate:
        rows.append(Row(Rename("mlp.shared_experts.shared_experts_gate.weight", "mlp.shared_experts.gate_weight"),
                        Rename("mlp.shared_expert_gate.weight", "mlp.shared_experts.gate_weight")))
    return rows


def ffn_rows(m: ModelConfig, experts: str, hf_experts: HFExperts) -> list[Row]:
    return moe_ffn_rows(m, experts, hf_experts) if m.is_moe else dense_ffn_rows(m)


MTP_OWN_ROWS: tuple[Row, ...] = (  # Hugging Face's keys are whole: its MTP block has no prefix
    Row(Copy("enorm.weight"), ShiftNorm("mtp.pre_fc_norm_embedding.weight", "enorm.weight")),
    Row(Copy("hnorm.weight"), ShiftNorm("mtp.pre_fc_norm_hidden.weight", "hnorm.weight")),
    Row(Copy("eh_proj.weight"), Rename("mtp.fc.weight", "eh_proj.weight")),
    Row(Copy("final_layernorm.weight"), ShiftNorm("mtp.norm.weight", "final_layernorm.weight")),
)


def _zero_centred(row: Row) -> Row:
    """The row under --apply-layernorm-1p: Megatron stores every norm gamma g as w = g - 1.

    MindFormers' plain gammas are shifted; Hugging Face's zero-centred norms are already in
    that form (a copy), its plain GDN gated norm is shifted like MindFormers' (in fp32).
    """
    if not row.mindformers.sources[0].endswith(NORM_SUFFIXES):
        return row
    assert isinstance(row.hf, (ShiftNorm, Rename)), row.hf
    shifted = isinstance(row.hf, ShiftNorm)
    return Row(ZeroCentre(row.mindformers), Rename(row.hf.source, row.hf.target) if shifted
               else ShiftNorm(row.hf.source, row.hf.target, by=-1))


def rule_table(model: ModelConfig, core_version: str = "0.16.1", experts: str = "per_expert",
               hf_experts: HFExperts = "per_expert", root: str = "model.") -> list[Block]:
    """Every row of the model, in blocks; ``root`` is the trunk's prefix in the Hugging Face checkpoint."""
    m = model
    blocks = [Block(tuple(global_rows(root)))]
    for index, kind in enumerate(m.layer_kinds):
        prefix = f"decoder.layers.{index}."
        mixer = attention_rows(m) if kind == "attention" else gdn_rows(m)
        blocks.append(Block(tuple(mixer + ffn_rows(m, experts, hf_experts)), prefix, prefix, f"{root}layers.{index}."))
    inner = mtp_layer_prefix(core_version)
    for k in range(m.mtp_num_layers):
        base, first = f"mtp.layers.{k}.", k == 0
        blocks.append(Block(MTP_OWN_ROWS, base, base, "" if first else None))
        blocks.append(Block(tuple(attention_rows(m) + ffn_rows(m, experts, hf_experts)), f"{base}{inner}.",
                            f"{base}transformer_layer.", base if first else None))
    if m.norm_convention == "zero_centred":
        blocks = [Block(tuple(_zero_centred(row) for row in b.rows), b.megatron, b.mindformers, b.hf) for b in blocks]
    return blocks


def conversion_plan(model: ModelConfig, core_version: str = "0.16.1", experts: str = "per_expert",
                    side: Side = "mindformers", hf_experts: HFExperts = "per_expert",
                    root: str = "model.") -> list[PlacedRule]:
    """One side's column of the model's table, placed; each of that side's keys and each Megatron key appears once.

    ``experts`` is Megatron's routed-expert form, ``hf_experts`` and ``root`` the Hugging Face
    checkpoint's (they apply to ``side="hf"`` only).
    """
    if side not in SIDES:
        raise CheckpointError(f"side {side!r} is not one of {', '.join(SIDES)}")
    plan = []
    for block in rule_table(model, core_version, experts, hf_experts, root):
        prefix = block.mindformers if side == "mindformers" else block.hf
        if prefix is None:
            raise CheckpointError(f"model {model.name} has {model.mtp_num_layers} MTP layers: a Hugging Face "
                                  "checkpoint holds one")
        plan += [PlacedRule(row.rule(side), prefix, block.megatron) for row in block.rows]
    return plan
