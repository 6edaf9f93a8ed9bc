"""The conversion pitfalls of SPEC section 9, injectable on purpose.

``convert(..., fault=NAME)`` converts with one rule broken the way a buggy third-party
converter breaks it, and writes the result without checking the output keys, so that the
self-check can prove it catches each pitfall from the training numbers alone. A broken rule
reads the same inputs as the correct one; only its outputs (values or names) are wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from crossalign.tensorio.errors import CheckpointError
from crossalign.models.layout import mtp_layer_prefix
from crossalign.checkpoint.rules import Deinterleave, Fuse, PlacedRule, Rename, Rule, Squeeze, Tensors, TransposeExperts
from crossalign.config import ModelConfig

FAULTS: dict[str, str] = {
    "routed_expert_not_transposed": "routed expert weights reshaped to Megatron's shape instead of transposed "
                                    "(invisible in the shapes when H == 2*moe_ffn)",
    "shared_fc1_not_deinterleaved": "shared-expert fc1 copied with MindSpore's interleaved gate/up rows",
    "dense_fc1_not_deinterleaved": "dense fc1 copied with MindSpore's interleaved gate/up rows",
    "in_proj_wrong_order": "GDN in_proj assembled as [qkv | z | alpha | beta] instead of [qkv | z | beta | alpha]",
    "conv1d_wrong_axis": "GDN conv1d kernel read as kernel-major (K, C): each channel gets other channels' taps",
    "a_log_not_renamed": "GDN a_log written under its MindSpore name, so Megatron never loads A_log",
    "wrong_mtp_prefix": "MTP inner layer written under the other core version's prefix "
                        "(transformer_layer vs mtp_model_layer), so Megatron never loads it",
    "gate_up_swapped": "SwiGLU fc1 written as [up; gate] instead of [gate; up] (dense, shared and routed experts)",
}


@dataclass(frozen=True)
class Faulty(Rule):
    """A rule as a buggy converter applies it: the correct rule's inputs, wrong values or names out."""

    correct: Rule
    broken: Callable[[Tensors], Tensors]
    names: tuple[str, ...] | None = None

    @property
    def sources(self) -> tuple[str, ...]:
        return self.correct.sources

    @property
    def targets(self) -> tuple[str, ...]:
        return self.names or self.correct.targets

    def forward(self, tensors: Tensors) -> Tensors:
        return self.broken(tensors)

    def inverse(self, tensors: Tensors) -> Tensors:
        raise CheckpointError("a fault-injected conversion runs one way only (MindSpore -> Megatron)")


def _swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    """[gate; up] -> [up; gate] along the row axis (dim -2 of both [2i, H] and [E, 2i, H])."""
    gate, up = tensor.chunk(2, dim=-2)
    return torch.cat((up, gate), dim=-2)


def _break(rule: Rule, fault: str, model: ModelConfig) -> Rule | None:
    """The broken form of ``rule`` under ``fault``, or None when the fault leaves this rule alone."""
    if fault == "routed_expert_not_transposed" and isinstance(rule, TransposeExperts):
        def reshaped(tensors: Tensors, r: TransposeExperts = rule) -> Tensors:
            stacked = r.stacked_input(tensors[0])
            return r.outputs(stacked.reshape(stacked.shape[0], stacked.shape[2], stacked.shape[1]))
        return Faulty(rule, reshaped)
    if fault == "shared_fc1_not_deinterleaved" and isinstance(rule, Deinterleave) and "shared_experts" in rule.source:
        return Faulty(rule, lambda tensors: [tensors[0]])
    if fault == "dense_fc1_not_deinterleaved" and isinstance(rule, Deinterleave) and "shared_experts" not in rule.source:
        return Faulty(rule, lambda tensors: [tensors[0]])
    if fault == "in_proj_wrong_order" and rule.targets == ("self_attention.in_proj.weight",):
        if isinstance(rule, Fuse):  # parts qkv, z, beta, alpha
            return Faulty(rule, lambda t: [torch.cat((t[0], t[1], t[3], t[2]), dim=0)])
        heads = model.linear_num_value_heads

        def alpha_before_beta(tensors: Tensors) -> Tensors:
            head, beta, alpha = tensors[0].tensor_split((-2 * heads, -heads), dim=0)
            return [torch.cat((head, alpha, beta), dim=0)]
        return Faulty(rule, alpha_before_beta)
    if fault == "conv1d_wrong_axis" and isinstance(rule, Squeeze):
        def kernel_major(tensors: Tensors) -> Tensors:
            channels, kernel = tensors[0].shape[0], tensors[0].shape[-1]
            return [tensors[0].reshape(kernel, channels).t().reshape(channels, 1, kernel)]
        return Faulty(rule, kernel_major)
    if fault == "a_log_not_renamed" and isinstance(rule, Rename) and rule.source == "self_attention.a_log":
        return Faulty(rule, lambda tensors: [tensors[0]], names=(rule.source,))
    if fault == "gate_up_swapped" and (isinstance(rule, Deinterleave) or
                                      (isinstance(rule, TransposeExperts) and rule.source.endswith("weight1"))):
        return Faulty(rule, lambda tensors, r=rule: [_swap_halves(t) for t in r.forward(tensors)])
    return None


def inject_fault(plan: list[PlacedRule], fault: str, model: ModelConfig, core_version: str) -> list[PlacedRule]:
    """The plan with ``fault`` applied; a fault that touches no rule of this model is an error."""
    if fault not in FAULTS:
        raise CheckpointError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
    if fault == "wrong_mtp_prefix":
        right = f".{mtp_layer_prefix(core_version)}."
        wrong = ".mtp_model_layer." if right == ".transformer_layer." else ".transformer_layer."
        faulty = [replace(p, target_prefix=p.target_prefix.replace(right, wrong)) for p in plan]
    else:
        faulty = []
        for placed in plan:
            broken = _break(placed.rule, fault, model)
            faulty.append(placed if broken is None else replace(placed, rule=broken))
    if faulty == plan:
        raise CheckpointError(f"fault {fault!r} does not apply to model {model.name} "
                              f"({model.kind}, {model.mtp_num_layers} MTP layers): it breaks no rule of it")
    return faulty


# ---- faults of the parallel layout: invisible in a single-rank checkpoint ------------------------------------

LAYOUT_FAULTS: dict[str, str] = {
    "in_proj_split_as_one_block": "GDN in_proj cut into TP contiguous row blocks instead of each rank's "
                                  "[q_r | k_r | v_r | z_r | beta_r | alpha_r] (only shows at TP > 1)",
    "experts_not_renumbered": "routed experts keep their global numbers on each EP rank instead of Megatron's "
                              "local ids 0 .. E/EP-1 (only shows at EP > 1)",
}


def break_layout(shards: dict, fault: str, model: ModelConfig) -> None:
    """Break a correct sharded state ``{(tp, pp, ep) rank: state}`` in place, as a converter with ``fault`` writes
    it; a fault this layout cannot show is an error."""
    import re

    from crossalign.sides.megatron.merge import FullTensor, HeldTensor
    from crossalign.sides.megatron.sharding import partition_of

    tp, ep = 1 + max(rank[0] for rank in shards), 1 + max(rank[2] for rank in shards)
    if fault == "in_proj_split_as_one_block":
        if tp == 1:
            raise CheckpointError("in_proj_split_as_one_block needs tensor parallel size > 1")
        for (t, p, e), state in shards.items():
            for key in [k for k in state if k.endswith("self_attention.in_proj.weight")]:
                parts = [shards[(r, p, e)][key] for r in range(tp)]
                held = tuple(HeldTensor(part, f"tensor rank {r}") for r, part in enumerate(parts))
                whole = FullTensor((held,), partition_of(key, parts[0].dim(), model)).read()
                state[key] = torch.chunk(whole, tp, dim=0)[t].clone()
        return
    if fault == "experts_not_renumbered":
        if ep == 1 or not model.is_moe:
            raise CheckpointError("experts_not_renumbered needs an MoE model and expert parallel size > 1")
        local = model.num_experts // ep
        expert = re.compile(r"(.*mlp\.experts\.linear_fc[12]\.weight)(\d+)")
        for (t, p, e), state in shards.items():
            for key in list(state):
                match = expert.fullmatch(key)
                if match:
                    state[f"{match.group(1)}{e * local + int(match.group(2))}"] = state.pop(key)
        return
    raise CheckpointError(f"unknown layout fault {fault!r}; known: {', '.join(LAYOUT_FAULTS)}")


def inject_layout_fault(iteration_dir, fault: str, model: ModelConfig, tp: int, pp: int, ep: int) -> None:
    """Rewrite the rank files of a converted tp x pp x ep checkpoint (its ``iter_N`` folder) with ``fault``."""
    from pathlib import Path

    from crossalign.sides.megatron.checkpoint import MODEL_FILE, rank_dir_name

    files = {(t, p, e): Path(iteration_dir) / rank_dir_name(t, p, pp, e, ep) / MODEL_FILE
             for t in range(tp) for p in range(pp) for e in range(ep)}
    records = {rank: torch.load(file, map_location="cpu", weights_only=True) for rank, file in files.items()}
    shards = {rank: dict(record["model"]) for rank, record in records.items()}
    break_layout(shards, fault, model)
    for rank, file in files.items():
        torch.save({**records[rank], "model": shards[rank]}, file)
