"""The machinery every checkpoint conversion shares: rules run, inputs and outputs checked, tensors cast.

The front end (``convert.py``: ``convert_checkpoint`` for folders, ``convert_state`` in memory)
builds on it. Nothing here reads or writes a checkpoint folder: a conversion is a plan of rules
(one side's column of the table in ``rules.py``), a ``Fetch`` that hands over each rule's
inputs, and a consumer of the outputs (a dict in memory, or a file writer that streams them).
Every plan maps a side (MindFormers or Hugging Face) to Megatron: ``to_megatron_plan`` checks
the side's input and gives the plan run forward, ``from_megatron`` runs a plan inverse.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch

from crossalign.tensorio.blocks import ReusedBuffer
from crossalign.tensorio.errors import CheckpointError
from crossalign.checkpoint.faults import inject_fault
from crossalign.checkpoint.hf import experts_of, hf_shapes, root_of
from crossalign.models.layout import check_expert_form, megatron_shapes, mindformers_buffers, mindformers_shapes
from crossalign.sides.mindformers.checkpoint import MindFormersCheckpoint
from crossalign.tensorio.mismatch import key_mismatches
from crossalign.checkpoint.rules import PlacedRule, Side, conversion_plan
from crossalign.tensorio.safetensors_io import DTYPES as STORED_DTYPES
from crossalign.tensorio.safetensors_io import TensorInfo
from crossalign.tensorio.torch_file import TensorSpec
from crossalign.config import ModelConfig

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "keep": None}  # a conversion's --dtype
Progress = Callable[[int, int, str], None]  # (tensors done, tensors in all, what is being done)
Shapes = Mapping[str, tuple[int, ...]]
Fetch = Callable[[tuple[str, ...]], list[torch.Tensor]]  # the tensors of some keys (one rule's inputs)


@dataclass
class ConvertReport:
    direction: str
    input_dir: Path
    output_dir: Path
    iteration: int
    keys_in: int
    keys_out: int
    bytes_in: int
    bytes_out: int
    seconds: float
    files: list[Path] = field(default_factory=list)
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dtype: str = "fp32"
    format: str = "torch"
    fault: str | None = None
    output_validated: bool = True
    notes: list[str] = field(default_factory=list)  # what was left out or added, and why


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")


def check_state(shapes: Shapes, expected: Shapes, what: str,
                also_accepted: Callable[[str, tuple[int, ...]], bool] = lambda key, shape: False) -> None:
    """Keys and shapes must match the table exactly; the error lists every kind of mismatch at once."""
    problems = key_mismatches(shapes, expected, also_accepted)
    if problems:
        raise CheckpointError(f"{what}: {problems}")


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ---- handing a rule its inputs ---------------------------------------------------------------------

def from_memory(state: Mapping[str, torch.Tensor]) -> Fetch:
    return lambda keys: [state[key] for key in keys]


def reused_reads(source) -> Fetch:
    """Read each rule's inputs into buffers kept from rule to rule (its i-th input into buffer i).

    ``source`` is a checkpoint whose ``tensor(key, buffer=...)`` reads one tensor (MindFormers
    or Hugging Face). Fresh memory for every tensor would cost a page fault per page. This is
    sound only when a rule's outputs, which may be views of its inputs, are consumed before
    the next rule reads: as when they are streamed into a file.
    """
    return reused_buffer_reads(lambda key, buffer: source.tensor(key, buffer=buffer))


def reused_buffer_reads(read: Callable[[str, ReusedBuffer], torch.Tensor]) -> Fetch:
    """A ``Fetch`` that calls ``read(key, buffer)`` for a rule's i-th input with buffer i, kept from rule to rule."""
    buffers: list[ReusedBuffer] = []

    def fetch(keys: tuple[str, ...]) -> list[torch.Tensor]:
        buffers.extend(ReusedBuffer() for _ in range(len(keys) - len(buffers)))
        return [read(key, buffer) for key, buffer in zip(keys, buffers)]
    return fetch


# ---- running a plan ---------------------------------------------------------------------------------

def rule_outputs(plan: list[PlacedRule], fetch: Fetch, total_inputs: int, forward: bool,
                 progress: Progress | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Apply every placed rule once, yielding its outputs as they come; each input key is fetched exactly once.

    ``forward`` runs each rule from its source keys (a side's) to its target keys (Megatron's),
    otherwise from the target keys back to the source keys.
    """
    done: set[str] = set()
    used = 0
    for placed in plan:
        sources, targets = placed.source_keys, placed.target_keys
        if not forward:
            sources, targets = targets, sources
        inputs = fetch(sources)
        used += len(sources)
        outputs = placed.rule.forward(inputs) if forward else placed.rule.inverse(inputs)
        del inputs  # a streaming consumer then holds only this rule's outputs
        for key, tensor in zip(targets, outputs, strict=True):
            if key in done:
                raise CheckpointError(f"two rules write {key!r}")
            done.add(key)
            yield key, tensor
        del outputs
        if progress:
            progress(used, total_inputs, sources[0])
    if used != total_inputs:
        raise CheckpointError(f"the rules used {used} of {total_inputs} input keys")


def run_rules(plan: list[PlacedRule], fetch: Fetch, total_inputs: int, forward: bool,
              progress: Progress | None = None) -> dict[str, torch.Tensor]:
    """Every output of the plan, held in memory."""
    return dict(rule_outputs(plan, fetch, total_inputs, forward, progress))


# ---- dtypes -----------------------------------------------------------------------------------------

def stored_dtype(source: torch.dtype, dtype: str) -> torch.dtype:
    """The dtype a tensor is written in: floating ones cast to ``dtype`` (unless "keep"), the others as they are."""
    target = DTYPES[dtype]
    return target if target is not None and source.is_floating_point else source


def cast(tensor: torch.Tensor, dtype: str) -> torch.Tensor:
    return tensor.to(stored_dtype(tensor.dtype, dtype))


# ---- a side -> Megatron ------------------------------------------------------------------------------

def graph_expert_layout(model: ModelConfig) -> Callable[[str, tuple[int, ...]], bool]:
    """MindFormers graph mode stores routed experts flattened: [E*H, 2i] / [E*i, H]."""
    table = mindformers_shapes(model)

    def accepted(key: str, shape: tuple[int, ...]) -> bool:
        full = table[key]
        return key.endswith(("mlp.experts.weight1", "mlp.experts.weight2")) and shape == (full[0] * full[1], full[2])
    return accepted


def side_shapes(model: ModelConfig, side: Side, keys: Shapes | None = None,
                what: str = "") -> dict[str, tuple[int, ...]]:
    """A side's shape table: MindFormers', or Hugging Face's in the root and expert form of ``keys`` if given."""
    if side == "mindformers":
        return mindformers_shapes(model)
    if keys is None:
        return hf_shapes(model)
    return hf_shapes(model, experts_of(keys), root_of(keys, what))


def to_megatron_plan(shapes: Shapes, model: ModelConfig, core_version: str, experts: str, fault: str | None,
                     what: str, side: Side = "mindformers") -> list[PlacedRule]:
    """The rules from a side to Megatron, once the input's keys and shapes are known to match the model."""
    accepted = graph_expert_layout(model) if side == "mindformers" and model.is_moe else lambda key, shape: False
    check_state(shapes, side_shapes(model, side, shapes, what), f"{what} does not match model {model.name}", accepted)
    hf_form, root = (experts_of(shapes), root_of(shapes, what)) if side == "hf" else ("per_expert", "model.")
    plan = conversion_plan(model, core_version, check_expert_form(experts), side, hf_form, root)
    if fault is None:
        return plan
    if side != "mindformers":
        raise CheckpointError("fault injection simulates an ms2mg converter: it does not apply to a Hugging Face input")
    return inject_fault(plan, fault, model, core_version)


def check_forward_output(shapes: Shapes, model: ModelConfig, core_version: str, experts: str,
                         fault: str | None) -> None:
    if fault is None:
        check_state(shapes, megatron_shapes(model, core_version, experts),
                    f"Megatron output for model {model.name} (core {core_version})")
    else:
        log.warning("fault %r injected: the Megatron output keys and shapes were NOT validated", fault)


def forward_specs(plan: list[PlacedRule], entries: Mapping[str, TensorInfo], model: ModelConfig,
                  core_version: str, experts: str, dtype: str) -> dict[str, TensorSpec]:
    """Every Megatron tensor the plan writes, in its order, with its shape and stored dtype, before any is computed.

    The output keys are checked against Megatron's table here, before anything is written;
    the shapes come from that table, and the writer checks each computed tensor against them.
    A rule's output has its inputs' (promoted) dtype: the rules move data without computing
    on it, so they run in the input's dtype and the writer casts, which gives the same bits
    as casting first at a fraction of the memory.
    """
    table = megatron_shapes(model, core_version, experts)
    keys = [key for placed in plan for key in placed.target_keys]
    only_keys = {key: table[key] if key in table else () for key in keys}  # the shapes are the table's by design
    check_state(only_keys, table, f"Megatron output for model {model.name} (core {core_version})")
    specs = {}
    for placed in plan:
        source = functools.reduce(torch.promote_types,
                                  (STORED_DTYPES[entries[key].dtype] for key in placed.source_keys))
        for key in placed.target_keys:
            specs[key] = TensorSpec(table[key], stored_dtype(source, dtype))
    return specs


# ---- Megatron -> a side ------------------------------------------------------------------------------

def expert_form_of(keys) -> str:
    """Megatron's routed experts as one tensor per expert (TE grouped experts) or one stacked tensor."""
    return "per_expert" if any(key.endswith("mlp.experts.linear_fc1.weight0") for key in keys) else "stacked"


def from_megatron(fetch: Fetch, shapes: Shapes, model: ModelConfig, core_version: str, what: str,
                  progress: Progress | None, side: Side = "mindformers") -> dict[str, torch.Tensor]:
    """A Megatron model (its keys and shapes, each tensor fetched once) as a checked state dict of ``side``.

    MindFormers' output comes in the rules' order, Hugging Face's in its table's (the text model
    under ``model.``, one tensor per routed expert), as ``save_pretrained`` orders it.
    """
    experts = expert_form_of(shapes)
    check_state(shapes, megatron_shapes(model, core_version, experts),
                f"{what} does not match model {model.name} (core {core_version}, {experts} experts)")
    out = run_rules(conversion_plan(model, core_version, experts, side), fetch, len(shapes), False, progress)
    table = side_shapes(model, side)
    name = "MindFormers" if side == "mindformers" else "Hugging Face"
    check_state({k: tuple(v.shape) for k, v in out.items()}, table, f"{name} output for model {model.name}")
    return out if side == "mindformers" else {key: out[key] for key in table}


def inverse_specs(plan: list[PlacedRule], dtypes: Mapping[str, torch.dtype], model: ModelConfig,
                  dtype: str) -> dict[str, TensorSpec]:
    """Every MindFormers tensor the plan writes from Megatron's, in its order, with shape and stored dtype.

    As ``forward_specs`` the other way: the keys are checked against MindFormers' table before
    anything is written, the shapes are the table's, and a rule's output has its inputs' dtype.
    """
    table = mindformers_shapes(model)
    keys = [key for placed in plan for key in placed.source_keys]
    check_state({key: table[key] if key in table else () for key in keys}, table,
                f"MindFormers output for model {model.name}")
    specs = {}
    for placed in plan:
        source = functools.reduce(torch.promote_types, (dtypes[key] for key in placed.target_keys))
        for key in placed.source_keys:
            specs[key] = TensorSpec(table[key], stored_dtype(source, dtype))
    return specs


# ---- MindFormers buffers (mlp.tokens_per_expert) ----------------------------------------------------

def left_out_buffers(source: MindFormersCheckpoint, model: ModelConfig) -> list[str]:
    """The input's buffers, each checked against the model's by name and shape: Megatron keeps none of them."""
    shapes = {name: info.shape for name, info in source.buffer_entries().items()}
    expected = mindformers_buffers(model)
    check_state(shapes, {name: shape for name, shape in expected.items() if name in shapes},
                f"MindFormers checkpoint {source.directory}: buffers do not match model {model.name}")
    if not shapes:
        return []
    note = (f"left out {len(shapes)} buffer(s) that Megatron does not keep (mlp.tokens_per_expert: MindFormers' "
            "count of the tokens routed to each expert)")
    log.info(note)
    return [note]


def fresh_buffers(model: ModelConfig) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The buffers MindFormers' model saves, as its reset leaves them (zeros): Megatron's checkpoint has no counts.

    MindFormers' MoE layer holds ``tokens_per_expert`` as a Parameter (requires_grad False,
    zeros at init; mindformers 2.1.0 ``pynative/transformers/moe/moe_layer.py:84``), so it is in
    every checkpoint MindFormers saves and its strict load expects it. Megatron's counterpart,
    the router's ``local_tokens_per_expert``, is a non-persistent buffer (core_v0.16.1
    ``megatron/core/transformer/moe/router.py:165-171``): a Megatron checkpoint never holds the
    counts, so mg2ms writes them as a fresh MindFormers model starts them, and says so.
    """
    buffers = {name: torch.zeros(shape, dtype=torch.float32) for name, shape in mindformers_buffers(model).items()}
    notes = [f"added {len(buffers)} buffer(s) mlp.tokens_per_expert as zeros, as MindFormers' MoE layer starts "
             "them (Megatron does not save its token counts)"] if buffers else []
    return buffers, notes
