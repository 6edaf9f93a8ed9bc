"""Which MindSpore module's output must equal which Megatron module's output, derived from the conversion rules.

Each conversion rule names the MindSpore parameters it reads and the Megatron parameters it
writes. A parameter's module is its name without the last part, so a rule that turns one
MindSpore module's parameter into one Megatron module's parameter at the same depth pairs
those two modules, and every ancestor pair on the way up (``mtp.layers.0.transformer_layer.mlp``
<-> ``mtp.layers.0.mtp_model_layer.mlp``). Where the two sides are built differently, the rule
says so by its shape, and the modules are not paired:

- fused norm: TransformerEngine fuses a norm into the linear that follows it (the MindSpore
  ``input_layernorm.weight`` becomes ``self_attention.linear_qkv.layer_norm_weight``). The MindSpore
  norm's output (the normalised hidden state) exists nowhere on the Megatron side, whose
  ``input_layernorm`` is an identity; the linear's output (norm then linear) is the same on both
  sides and is paired by the linear's own rule.
- several modules into one (dense GDN ``in_proj_qkv``/``linear_g``/``linear_b``/``linear_a`` into
  ``in_proj``): each part's output is a slice of the fused output, so only their common parent pairs.
- different depth (``mlp.experts.weight1`` into ``mlp.experts.linear_fc1.weight0..``): the deeper
  module computes something else (one grouped GEMM vs the whole expert block); only the common
  prefix (``mlp.experts``) pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from crossalign.config import ModelConfig

# The parameter name TransformerEngine gives a norm fused into the linear it feeds.
FUSED_NORM_PARAMETER = "layer_norm_weight"

RuleNames = tuple[Sequence[str], Sequence[str]]  # (MindSpore parameter names, Megatron parameter names)


def module_of(parameter: str) -> str:
    """``decoder.layers.1.mlp.linear_fc1.weight`` -> ``decoder.layers.1.mlp.linear_fc1``; top-level -> ''."""
    return parameter.rpartition(".")[0]


class MappingError(ValueError):
    """Two conversion rules pair one module with two different counterparts."""


@dataclass(frozen=True)
class ModuleMapping:
    """MindSpore module -> Megatron module whose forward outputs are the same tensors.

    ``output_permutations`` holds, for a paired linear whose rule reorders the weight's rows
    (the SwiGLU fc1 de-interleave), the order of the output features: the Megatron output
    ``y[..., j]`` is the MindSpore output ``y[..., perm[j]]``. ``fused`` lists MindSpore norms that have no output of their own on the Megatron side
    (key: the norm, value: the Megatron linear that holds it). ``unpaired`` lists modules
    of either side that hold parameters but have no comparable counterpart, with the reason.
    """

    pairs: dict[str, str]
    fused: dict[str, str]
    unpaired: dict[str, str]
    output_permutations: dict[str, np.ndarray] = field(default_factory=dict)

    def megatron_name(self, mindspore_name: str) -> str | None:
        return self.pairs.get(mindspore_name)

    @property
    def reverse(self) -> dict[str, str]:
        return {mg: ms for ms, mg in self.pairs.items()}


def module_mapping_from_rules(rules: Iterable[RuleNames]) -> ModuleMapping:
    """Derive the module pairs from the (MindSpore names, Megatron names) of every conversion rule.

    For each MindSpore module and Megatron module a rule connects, their ancestors pair level by
    level from the root (``mtp.layers.0.transformer_layer`` <-> ``mtp.layers.0.mtp_model_layer``).
    The modules themselves pair when the rule is one module to one module at the same depth, or
    when one is the other's ancestor by name (``mlp.experts`` <-> ``mlp.experts``.linear_fc1), and
    never for a fused norm.
    """
    pairs: dict[str, str] = {}
    fused: dict[str, str] = {}
    unpaired: dict[str, str] = {}

    def pair(ms: str, mg: str, rule: RuleNames) -> None:
        known = pairs.get(ms)
        if known is not None and known != mg:
            raise MappingError(f"module {ms!r} pairs with both {known!r} and {mg!r} (rule {list(rule[0])} -> "
                               f"{list(rule[1])})")
        pairs[ms] = mg

    for rule in rules:
        ms_modules = sorted({module_of(n) for n in rule[0]})
        mg_modules = sorted({module_of(n) for n in rule[1]})
        is_fused = any(n.rpartition(".")[2] == FUSED_NORM_PARAMETER for n in rule[1])
        one_to_one = len(ms_modules) == 1 and len(mg_modules) == 1
        for ms in ms_modules:
            for mg in mg_modules:
                ms_parts, mg_parts = ms.split(".") if ms else [], mg.split(".") if mg else []
                depth = min(len(ms_parts), len(mg_parts))
                for level in range(1, depth):
                    pair(".".join(ms_parts[:level]), ".".join(mg_parts[:level]), rule)
                if depth == 0 or is_fused:
                    paired = False
                elif len(ms_parts) == len(mg_parts):
                    paired = one_to_one
                else:
                    paired = ms_parts[depth - 1] == mg_parts[depth - 1]
                if paired:
                    pair(".".join(ms_parts[:depth]), ".".join(mg_parts[:depth]), rule)
        if is_fused:
            fused.update({ms: ", ".join(mg_modules) for ms in ms_modules})
            continue
        for ms in ms_modules:
            unpaired.setdefault(f"mindspore:{ms}", "its parameters go to " + ", ".join(mg_modules))
        for mg in mg_modules:
            unpaired.setdefault(f"megatron:{mg}", "its parameters come from " + ", ".join(ms_modules))

    # Drop from ``unpaired`` every module some rule did pair.
    reverse = set(pairs.values())
    unpaired = {k: v for k, v in unpaired.items()
                if not (k.startswith("mindspore:") and k.removeprefix("mindspore:") in pairs)
                and not (k.startswith("megatron:") and k.removeprefix("megatron:") in reverse)}
    return ModuleMapping(pairs=dict(sorted(pairs.items())), fused=fused, unpaired=unpaired)


def _row_permutation(rule, rows: int) -> np.ndarray | None:
    """Where each output row of a single-weight rule comes from, or None if the rule keeps the row order.

    Found by running the rule itself on a weight whose every row holds its own index.
    """
    import torch

    index = torch.arange(rows, dtype=torch.float64).reshape(rows, 1)
    (moved,) = rule.forward([index])
    order = moved.reshape(-1).round().long().numpy()
    return None if np.array_equal(order, np.arange(rows)) else order


def module_mapping(model: ModelConfig, core_version: str = "0.16.1") -> ModuleMapping:
    """The module mapping of ``model`` from the converter's own rules (``conversion_plan``)."""
    from crossalign.models.layout import mindformers_shapes
    from crossalign.checkpoint.rules import conversion_plan

    plan = conversion_plan(model, core_version, "per_expert")
    mapping = module_mapping_from_rules((placed.source_keys, placed.target_keys) for placed in plan)
    shapes = mindformers_shapes(model)
    for placed in plan:
        if len(placed.source_keys) != 1 or len(placed.target_keys) != 1:
            continue
        (ms_key,), (mg_key,) = placed.source_keys, placed.target_keys
        ms_module = module_of(ms_key)
        if mapping.pairs.get(ms_module) != module_of(mg_key) or len(shapes[ms_key]) != 2:
            continue
        order = _row_permutation(placed.rule, shapes[ms_key][0])
        if order is not None:
            mapping.output_permutations[ms_module] = order
    return mapping
