"""Known causes of a first divergence, by the module where it shows and the evidence the comparison holds (the
pitfalls of SPEC sections 3 and 9).

Each entry says where a fault first shows in a layer-by-layer comparison, why, what to check, which evidence it
needs, and which fault of ``crossalign.checkpoint.faults`` reproduces it (``FAULTS``, and ``LAYOUT_FAULTS`` for the
faults only a sharded checkpoint can have), so that the tests can prove every hint against the fault it names.

The evidence (:class:`Evidence`) is where the comparison first parts: a weight differs, the forward diverges first,
only the backward diverges (every weight and forward output agrees), or only a weight gradient does (weights,
forward and backward activations agree). A cause is offered only where the evidence shows it: a conversion fault
changes a weight, so it shows at the weight or, where the weight could not be held side by side, in the forward;
where the module's weights were compared exactly and agree, or where only gradients differ, the conversion is ruled
out and the gradient-side causes (gradient or loss scaling, a missing all-reduce, a hook, a backward kernel) remain.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from crossalign.config import ModelConfig

WEIGHT, FORWARD, BACKWARD, GRADIENT = "weight", "forward", "backward", "gradient"
EVIDENCE = {WEIGHT: "a weight differs", FORWARD: "the forward diverges first",
            BACKWARD: "only the backward diverges", GRADIENT: "only a weight gradient diverges"}


@dataclass(frozen=True)
class Evidence:
    """What the comparison shows at its first divergence.

    ``kind``: WEIGHT, FORWARD, BACKWARD or GRADIENT; ``weights_agree``: every weight of the module was held side by
    side exactly (tensor or md5) and agrees, which rules the conversion out; ``parallel``: whether a side splits
    the model over tensor or expert ranks (None: not known)."""

    kind: str = FORWARD
    weights_agree: bool = False
    parallel: bool | None = None


@dataclass(frozen=True)
class KnownCause:
    """A pitfall: the Megatron module names where it first shows (regex), the cause, what to check, and the
    evidence it needs (``evidence``: kinds of :data:`EVIDENCE`); ``conversion``: a fault of the checkpoint
    conversion, which changes a weight. For the gradient kinds, ``where`` is matched against the parameter's full
    name (a gradient belongs to one parameter)."""

    where: str
    cause: str
    check: str
    faults: tuple[str, ...] = ()
    layer_kind: str | None = None  # "attention" / "gdn": only for layers of that kind
    ffn: str | None = None  # "dense" / "moe": only for models with that FFN
    parallel: int | None = None  # 0 tensor / 2 expert: a fault of the rank files, only when that size > 1
    evidence: tuple[str, ...] = (WEIGHT, FORWARD)
    conversion: bool = True
    needs_parallel: bool = False  # only where a side splits the model over tensor or expert ranks

    @property
    def needs(self) -> str:
        """The evidence it needs, in words."""
        return " or ".join(EVIDENCE[kind] for kind in self.evidence)

    def matches(self, module: str, model: ModelConfig, layout: tuple[int, int, int] | None = None,
                evidence: Evidence = Evidence()) -> bool:
        """``layout``: the (tp, pp, ep) of the Megatron checkpoint compared; None when not known (dumps of a run)."""
        if evidence.kind not in self.evidence:
            return False
        if self.conversion and evidence.weights_agree:
            return False
        if self.needs_parallel and evidence.parallel is False:
            return False
        if not re.search(self.where, module):
            return False
        if self.ffn is not None and self.ffn != model.kind:
            return False
        if self.layer_kind is not None and layer_kind_of(module, model) != self.layer_kind:
            return False
        if self.parallel is not None and layout is not None and layout[self.parallel] == 1:
            return False
        return True


def layer_kind_of(module: str, model: ModelConfig) -> str | None:
    """"attention"/"gdn" for a module inside a decoder layer or MTP layer (MTP layers are full attention)."""
    found = re.match(r"decoder\.layers\.(\d+)\.", module + ".")
    if found:
        index = int(found.group(1))
        return model.layer_kind(index) if index < model.num_layers else None
    return "attention" if module.startswith("mtp.layers.") else None


TENSOR, EXPERT = 0, 2  # index in a (tp, pp, ep) layout

KNOWN_CAUSES: tuple[KnownCause, ...] = (
    # Faults of a sharded checkpoint first: they apply only where the layout can show them.
    KnownCause(
        where=r"\.self_attention(\.(in_proj|conv1d|out_norm|out_proj))?$",
        cause="GDN in_proj cut into TP contiguous row blocks: each tensor rank must hold its own "
              "[q_r | k_r | v_r | z_r | beta_r | alpha_r], every segment split over the ranks; cut as one block, "
              "rank 0 holds the leading segments whole and the last rank the trailing ones, so each rank's heads "
              "compute with other heads' rows (invisible at TP 1)",
        check="split each in_proj segment over the tensor ranks and concatenate per rank (a TP 1 conversion of the "
              "same source passes)",
        faults=("in_proj_split_as_one_block",),
        layer_kind="gdn",
        parallel=TENSOR,
    ),
    KnownCause(
        where=r"\.mlp\.experts(\.|$)",
        cause="routed experts not renumbered per EP rank: Megatron numbers each rank's experts locally "
              "(global expert e is weight{e % (E/EP)} on EP rank e // (E/EP)); under their global numbers the "
              "ranks past 0 load none of their experts, which keep their initial values",
        check="the expert keys of each mp_rank_*_EEE file run 0 .. E/EP-1 (the load problems name the rank)",
        faults=("experts_not_renumbered",),
        ffn="moe",
        parallel=EXPERT,
    ),
    KnownCause(
        where=r"^mtp\.",
        cause="the MTP layer alone differs: MTP weights under the wrong inner-layer prefix (transformer_layer up "
              "to megatron-core 0.16, mtp_model_layer from 0.17) stay random in Megatron, or enorm/hnorm or the "
              "eh_proj input order [embedding, hidden] is swapped",
        check="the MTP prefix for training.megatron_core_version, the load_return line of the Megatron log, "
              "enorm vs hnorm and the eh_proj concat order",
        faults=("wrong_mtp_prefix",),
    ),
    KnownCause(
        where=r"\.mlp\.experts(\.|$)",
        cause="routed expert weights not transposed: MindSpore weight1 [E,H,2i] / weight2 [E,i,H] must become "
              "TE's [E,2i,H] / [E,H,i]; a square weight1 (hidden == 2*moe_ffn) hides this from shape checks",
        check="transpose(-1,-2) of mlp.experts.weight1 and weight2 (no gate/up swap, no de-interleave)",
        faults=("routed_expert_not_transposed", "gate_up_swapped"),
        ffn="moe",
    ),
    KnownCause(
        where=r"\.mlp\.shared_experts(\.|$)",
        cause="shared-expert fc1 not de-interleaved (MindFormers stores SwiGLU rows interleaved [g0,u0,g1,u1,...], "
              "Megatron expects [G;U]) or its gate and up halves swapped; about a 5% step-1 loss error",
        check="cat(w[0::2], w[1::2]) on mlp.shared_experts.linear_fc1.weight, gate half first",
        faults=("shared_fc1_not_deinterleaved", "gate_up_swapped"),
        ffn="moe",
    ),
    KnownCause(
        where=r"\.mlp(\.linear_fc1|\.linear_fc2)?$",
        cause="dense fc1 not de-interleaved (MindFormers [g0,u0,g1,u1,...] vs Megatron [G;U]) or gate and up "
              "halves swapped",
        check="cat(w[0::2], w[1::2]) on mlp.linear_fc1.weight, gate half first",
        faults=("dense_fc1_not_deinterleaved", "gate_up_swapped"),
        ffn="dense",
    ),
    KnownCause(
        where=r"\.mlp\.router$",
        cause="router weights differ: the router weight must be copied as is",
        check="mlp.router.weight copied as is",
    ),
    KnownCause(
        where=r"\.mlp(\.router|\.experts)?$",
        cause="the routing differs with the same weights: norm_topk_prob false on one side (expert weights off by "
              "~2x), the score function, top-k or the router's dtype",
        check="norm_topk_prob true on the MindSpore side; moe_router_score_function, moe_router_topk, "
              "moe_router_dtype",
        ffn="moe",
        evidence=(FORWARD,),
        conversion=False,
    ),
    KnownCause(
        where=r"\.self_attention\.in_proj$",
        cause="GDN in_proj rows in the wrong order: Megatron expects [q | k | v | z | beta | alpha]; dense "
              "checkpoints must concatenate in_proj_qkv, linear_g (z), linear_b (beta), linear_a (alpha) in that order",
        check="the order of the fused in_proj segments",
        faults=("in_proj_wrong_order",),
        layer_kind="gdn",
    ),
    KnownCause(
        where=r"\.self_attention(\.(conv1d|out_norm|out_proj))?$",
        cause="GDN internals differ: the conv1d weight (C,1,1,K) reshaped along the wrong axis, a_log not renamed "
              "to A_log (left random), dt_bias, or the in_proj segment order (when in_proj itself could not be "
              "compared: dense checkpoints split it in four)",
        check="conv1d squeeze of dim 2 only, the a_log -> A_log rename, dt_bias copy, in_proj order",
        faults=("conv1d_wrong_axis", "a_log_not_renamed", "in_proj_wrong_order"),
        layer_kind="gdn",
    ),
    KnownCause(
        where=r"\.self_attention(\.(linear_qkv|linear_proj|q_layernorm|k_layernorm|core_attention))?$",
        cause="gated attention differs: linear_qkv rows must stay per query group [q heads | gate heads | k | v], "
              "the input norm becomes linear_qkv.layer_norm_weight, q/k layernorm copied",
        check="linear_qkv copied without regrouping; input_layernorm -> linear_qkv.layer_norm_weight",
        layer_kind="attention",
    ),
    KnownCause(
        where=r"(^|\.)(pre_mlp_layernorm|input_layernorm|final_layernorm|enorm|hnorm)$",
        cause="a norm weight differs: zero-centred (1+w) vs plain gamma, or a fused norm weight not moved to the "
              "linear's layer_norm_weight",
        check="norms copied as is (no --apply-layernorm-1p), fused norms under <linear>.layer_norm_weight",
    ),
    KnownCause(
        where=r"^embedding(\.|$)",
        cause="embedding differs: rows must equal padded_vocab_size and are copied as is",
        check="embedding.word_embeddings.weight shape and padded vocab size",
    ),
    KnownCause(
        where=r"^output_layer$",
        cause="output layer differs: untied embedding and output weights must both be converted",
        check="output_layer.weight copied; --untie-embeddings-and-output-weights",
    ),
    # Gradient-side causes: the forward agrees, so the weights it ran with are the same.
    KnownCause(
        where=r"(^|\.)(input_layernorm|pre_mlp_layernorm|final_layernorm|q_layernorm|k_layernorm|out_norm|enorm|"
              r"hnorm|router)\.weight$|\.layer_norm_weight$|\.gate_weight$",
        cause="a replicated parameter's gradient not all-reduced over the ranks that hold it: with sequence "
              "parallelism each tensor rank's gradient of a norm, the router or the shared-expert gate covers its "
              "part of the sequence until Megatron's finalize_model_grads sums them over the tensor ranks, and a "
              "parameter the expert ranks share is summed over its data-parallel group; on one side it was not",
        check="the ratio of the two gradients (about 1/TP of the other where a sum over TP ranks is missing); "
              "the all-reduce of sequence-parallel parameters' gradients on each side",
        evidence=(GRADIENT,),
        conversion=False,
        needs_parallel=True,
    ),
    KnownCause(
        where=r".",
        cause="one gradient scaled on one side: a gradient hook or a per-parameter scale (clipping applied before "
              "the dump, a grad scaler, a parameter excluded from the loss scale's unscaling)",
        check="the two gradients' ratio (a constant factor is a scale) and the hooks registered on that parameter",
        evidence=(GRADIENT,),
        conversion=False,
    ),
    KnownCause(
        where=r"^output_layer$|(^|\.)final_layernorm$|^mtp\.",
        cause="the loss differs while the forward agrees: a loss scale not undone, the loss averaged over other "
              "tokens or micro batches (per-token loss, gradient accumulation), or the MTP or auxiliary loss "
              "coefficient",
        check="the ratio of the incoming gradients at the output layer; calculate_per_token_loss, "
              "mtp_loss_scaling_factor, moe_aux_loss_coeff on both sides",
        evidence=(BACKWARD,),
        conversion=False,
    ),
    KnownCause(
        where=r"\.self_attention(\.(in_proj|conv1d|out_norm|out_proj))?$",
        cause="the GatedDeltaNet backward kernel differs while its forward agrees (fla's gated chunk backward "
              "returns wrong db/dg on Hopper with Triton in [3.4.0, 3.7.1) for some fla versions)",
        check="the megatron-train step's kernel probe (its manifest: every GatedDeltaNet kernel against "
              "megatron-core's torch rule, forward and backward) and scripts/gpu_check.sh (the fla and Triton versions)",
        layer_kind="gdn",
        evidence=(BACKWARD,),
        conversion=False,
    ),
    KnownCause(
        where=r".",
        cause="a backward hook or a custom backward on one side changes the gradient of this module",
        check="the hooks registered on the module (full backward hooks) and its autograd function",
        evidence=(BACKWARD,),
        conversion=False,
    ),
)


def explain(module: str, model: ModelConfig, layout: tuple[int, int, int] | None = None,
            evidence: Evidence = Evidence()) -> list[KnownCause]:
    """The known causes for a first divergence at the Megatron module ``module`` (the parameter's full name for a
    gradient) of a checkpoint in ``layout`` (tp, pp, ep; None: not known) that fit ``evidence``, most specific
    first."""
    return [cause for cause in KNOWN_CAUSES if cause.matches(module, model, layout, evidence)]
