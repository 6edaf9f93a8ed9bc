"""MindSpore (MindFormers) <-> Megatron checkpoint conversion, checked before anything is written.

The rules of ``rules.py`` do the work; this module checks the input against the model's
shape table, runs the rules (each input key exactly once), checks the output against the
other side's table, and only then writes. Any mismatch is a ``CheckpointError`` that names
the keys, and nothing is written. A fault-injected conversion (``faults.py``) skips the
output check on purpose, with a warning.

MindSpore -> Megatron streams: the output keys are checked and the Megatron files laid out
from the tables before any tensor is read, then each rule reads its inputs into reused
buffers and its outputs go straight into their records, cast on the way (``torch_file.py``),
so memory holds one rule's tensors whatever the model size.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Literal, Mapping

import torch

from crossalign.checkpoint.atomic import check_output_dir
from crossalign.checkpoint.blocks import ReusedBuffer, one_thread
from crossalign.checkpoint.errors import CheckpointError
from crossalign.checkpoint.faults import inject_fault
from crossalign.checkpoint.layout import check_expert_form, megatron_shapes, mindformers_buffers, mindformers_shapes
from crossalign.checkpoint.megatron import (
    read_megatron_checkpoint,
    stream_megatron_checkpoint,
    write_torch_dist_checkpoint,
)
from crossalign.checkpoint.mismatch import key_mismatches
from crossalign.checkpoint.mindformers import (
    MindFormersCheckpoint,
    default_common,
    read_mindformers_checkpoint,
    write_mindformers_checkpoint,
)
from crossalign.checkpoint.reshard import check_parallel_sizes, mindformers_split_dim
from crossalign.checkpoint.rules import PlacedRule, conversion_plan
from crossalign.checkpoint.safetensors_io import DTYPES as STORED_DTYPES
from crossalign.checkpoint.safetensors_io import TensorInfo
from crossalign.checkpoint.torch_file import TensorSpec
from crossalign.config import ModelConfig

log = logging.getLogger(__name__)

Direction = Literal["ms2mg", "mg2ms", "hf2ms", "hf2mg", "ms2hf"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "keep": None}
FORMATS = ("torch", "torch_dist")  # Megatron's --ckpt-format
Progress = Callable[[int, int, str], None]  # (tensors done, tensors in all, what is being done)
Shapes = Mapping[str, tuple[int, ...]]


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


def check_state(shapes: Shapes, expected: Shapes, what: str,
                also_accepted: Callable[[str, tuple[int, ...]], bool] = lambda key, shape: False) -> None:
    """Keys and shapes must match the table exactly; the error lists every kind of mismatch at once."""
    problems = key_mismatches(shapes, expected, also_accepted)
    if problems:
        raise CheckpointError(f"{what}: {problems}")


def _graph_expert_layout(model: ModelConfig) -> Callable[[str, tuple[int, ...]], bool]:
    """MindFormers graph mode stores routed experts flattened: [E*H, 2i] / [E*i, H]."""
    table = mindformers_shapes(model)

    def accepted(key: str, shape: tuple[int, ...]) -> bool:
        full = table[key]
        return key.endswith(("mlp.experts.weight1", "mlp.experts.weight2")) and shape == (full[0] * full[1], full[2])
    return accepted


Fetch = Callable[[tuple[str, ...]], list[torch.Tensor]]  # the tensors of some keys (one rule's inputs)


def _from_memory(state: Mapping[str, torch.Tensor]) -> Fetch:
    return lambda keys: [state[key] for key in keys]


def _reused_reads(source: MindFormersCheckpoint) -> Fetch:
    """Read each rule's inputs into buffers kept from rule to rule (its i-th input into buffer i).

    Fresh memory for every tensor would cost a page fault per page. This is sound only when
    a rule's outputs, which may be views of its inputs, are consumed before the next rule
    reads: as when they are streamed into a file.
    """
    buffers: list[ReusedBuffer] = []

    def fetch(keys: tuple[str, ...]) -> list[torch.Tensor]:
        buffers.extend(ReusedBuffer() for _ in range(len(keys) - len(buffers)))
        return [source.tensor(key, buffer=buffer) for key, buffer in zip(keys, buffers)]
    return fetch


def _outputs(plan: list[PlacedRule], fetch: Fetch, total_inputs: int, forward: bool,
             progress: Progress | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Apply every placed rule once, yielding its outputs as they come; each input key is fetched exactly once."""
    done: set[str] = set()
    used = 0
    for placed in plan:
        sources, targets = (placed.ms_keys, placed.mg_keys) if forward else (placed.mg_keys, placed.ms_keys)
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


def _run(plan: list[PlacedRule], fetch: Fetch, total_inputs: int, forward: bool,
         progress: Progress | None = None) -> dict[str, torch.Tensor]:
    """Every output of the plan, held in memory."""
    return dict(_outputs(plan, fetch, total_inputs, forward, progress))


def _forward_plan(shapes: Shapes, model: ModelConfig, core_version: str, experts: str, fault: str | None,
                  what: str) -> list[PlacedRule]:
    """The MindSpore -> Megatron rules, once the input's keys and shapes are known to match the model."""
    check_state(shapes, mindformers_shapes(model), f"{what} does not match model {model.name}",
                _graph_expert_layout(model) if model.is_moe else lambda key, shape: False)
    plan = conversion_plan(model, core_version, check_expert_form(experts))
    return plan if fault is None else inject_fault(plan, fault, model, core_version)


def _check_forward_output(shapes: Shapes, model: ModelConfig, core_version: str, experts: str,
                          fault: str | None) -> None:
    if fault is None:
        check_state(shapes, megatron_shapes(model, core_version, experts),
                    f"Megatron output for model {model.name} (core {core_version})")
    else:
        log.warning("fault %r injected: the Megatron output keys and shapes were NOT validated", fault)


def mindformers_to_megatron(state: Mapping[str, torch.Tensor], model: ModelConfig, core_version: str = "0.16.1",
                            experts: str = "per_expert", fault: str | None = None) -> dict[str, torch.Tensor]:
    """A MindFormers state dict (pynative or graph expert layout) as a Megatron state dict (TP=1, PP=1)."""
    shapes = {key: tuple(tensor.shape) for key, tensor in state.items()}
    plan = _forward_plan(shapes, model, core_version, experts, fault, "MindFormers state")
    out = _run(plan, _from_memory(state), len(shapes), True)
    _check_forward_output({key: tuple(tensor.shape) for key, tensor in out.items()}, model, core_version, experts,
                          fault)
    return out


def _expert_form_of(keys) -> str:
    return "per_expert" if any(key.endswith("mlp.experts.linear_fc1.weight0") for key in keys) else "stacked"


def _inverse(fetch: Fetch, shapes: Shapes, model: ModelConfig, core_version: str,
             what: str, progress: Progress | None) -> dict[str, torch.Tensor]:
    experts = _expert_form_of(shapes)
    check_state(shapes, megatron_shapes(model, core_version, experts),
                f"{what} does not match model {model.name} (core {core_version}, {experts} experts)")
    out = _run(conversion_plan(model, core_version, experts), fetch, len(shapes), False, progress)
    check_state({k: tuple(v.shape) for k, v in out.items()}, mindformers_shapes(model),
                f"MindFormers output for model {model.name}")
    return out


def megatron_to_mindformers(state: Mapping[str, torch.Tensor], model: ModelConfig,
                            core_version: str = "0.16.1") -> dict[str, torch.Tensor]:
    """The exact inverse of mindformers_to_megatron (either expert form in; pynative expert layout out)."""
    shapes = {key: tuple(tensor.shape) for key, tensor in state.items()}
    return _inverse(_from_memory(state), shapes, model, core_version, "Megatron state", None)


def _stored_dtype(source: torch.dtype, dtype: str) -> torch.dtype:
    """The dtype a tensor is written in: floating ones cast to ``dtype`` (unless "keep"), the others as they are."""
    target = DTYPES[dtype]
    return target if target is not None and source.is_floating_point else source


def _cast(tensor: torch.Tensor, dtype: str) -> torch.Tensor:
    return tensor.to(_stored_dtype(tensor.dtype, dtype))


def _forward_specs(plan: list[PlacedRule], entries: Mapping[str, TensorInfo], model: ModelConfig,
                   core_version: str, experts: str, dtype: str) -> dict[str, TensorSpec]:
    """Every Megatron tensor the plan writes, in its order, with its shape and stored dtype, before any is computed.

    The output keys are checked against Megatron's table here, before anything is written;
    the shapes come from that table, and the writer checks each computed tensor against them.
    A rule's output has its inputs' (promoted) dtype: the rules move data without computing
    on it, so they run in the input's dtype and the writer casts, which gives the same bits
    as casting first at a fraction of the memory.
    """
    table = megatron_shapes(model, core_version, experts)
    keys = [key for placed in plan for key in placed.mg_keys]
    only_keys = {key: table[key] if key in table else () for key in keys}  # the shapes are the table's by design
    check_state(only_keys, table, f"Megatron output for model {model.name} (core {core_version})")
    specs = {}
    for placed in plan:
        source = functools.reduce(torch.promote_types, (STORED_DTYPES[entries[key].dtype] for key in placed.ms_keys))
        for key in placed.mg_keys:
            specs[key] = TensorSpec(table[key], _stored_dtype(source, dtype))
    return specs


def _left_out_buffers(source: MindFormersCheckpoint, model: ModelConfig) -> list[str]:
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


def _fresh_buffers(model: ModelConfig) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The buffers MindFormers' model saves, as its reset leaves them (zeros): Megatron's checkpoint has no counts."""
    buffers = {name: torch.zeros(shape, dtype=torch.float32) for name, shape in mindformers_buffers(model).items()}
    notes = [f"added {len(buffers)} buffer(s) mlp.tokens_per_expert as zeros, as MindFormers' MoE layer starts "
             "them (Megatron does not save its token counts)"] if buffers else []
    return buffers, notes


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def convert_checkpoint(model: ModelConfig, direction: Direction, input_dir: Path, output_dir: Path, *,
                       core_version: str = "0.16.1", dtype: str = "fp32", experts: str = "per_expert",
                       tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None, fault: str | None = None,
                       global_batch_size: int | None = None, progress: Progress | None = None,
                       ckpt_format: str = "torch") -> ConvertReport:
    """Convert a checkpoint folder into a new folder (which must not exist or be empty).

    ms2mg reads a MindFormers checkpoint (one rank's, or several ranks' slices stitched by
    their metadata.json) tensor by tensor, leaves out its optimizer state and buffers, and
    writes a Megatron legacy checkpoint resharded to tp x pp x ep (routed experts split
    over ``etp`` tensor ranks, None: tp); mg2ms merges a Megatron checkpoint of any layout
    and writes a MindFormers checkpoint as ``tp`` ranks save it (one file per rank and
    metadata.json when tp > 1), with the buffers of MindFormers' MoE layers, and whose
    common.json records the Megatron iteration (and ``global_batch_size`` with the samples
    consumed, when given).
    ``dtype`` casts floating tensors (fp32, as the source converter does, bf16, or keep).
    ``ckpt_format`` torch_dist makes ms2mg write Megatron's torch_dist checkpoint instead
    (``torch_dist.py``): one copy of the whole model, resharded by Megatron at load, so it
    takes no tp/pp/ep. mg2ms reads either format.
    """
    input_dir, output_dir = Path(input_dir), Path(output_dir)
    if direction in ("hf2ms", "hf2mg", "ms2hf"):
        if fault is not None:
            raise CheckpointError("fault injection simulates an ms2mg converter: it does not apply to " + direction)
        from crossalign.checkpoint.hf_convert import convert_hf  # builds on this module

        return convert_hf(model, direction, input_dir, output_dir, core_version=core_version, dtype=dtype,
                          experts=experts, tp=tp, pp=pp, global_batch_size=global_batch_size, progress=progress)
    if direction not in ("ms2mg", "mg2ms"):
        raise CheckpointError(f"direction {direction!r} is not one of ms2mg, mg2ms, hf2ms, hf2mg, ms2hf")
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    check_expert_form(experts)
    check_parallel_sizes(model, tp, pp, ep, etp)
    if direction == "mg2ms" and (pp, ep, etp) != (1, 1, None):
        raise CheckpointError("mg2ms writes the ranks of one tensor-parallel group: --pp, --ep and --etp apply to "
                              "ms2mg only (mg2ms reads any Megatron layout)")
    if fault is not None and (direction != "ms2mg" or (tp, pp, ep, etp) != (1, 1, 1, None)):
        raise CheckpointError("fault injection simulates a single-rank ms2mg converter: use it with ms2mg, tp=1, pp=1")
    if ckpt_format not in FORMATS:
        raise CheckpointError(f"format {ckpt_format!r} is not one of {', '.join(FORMATS)}")
    if ckpt_format == "torch_dist" and (direction != "ms2mg" or fault is not None
                                        or (tp, pp, ep, etp) != (1, 1, 1, None)):
        raise CheckpointError("--format torch_dist is written by ms2mg without --tp/--pp/--ep/--etp or --fault: "
                              "Megatron reshards a torch_dist checkpoint to its own layout at load "
                              "(mg2ms reads either format)")
    check_output_dir(output_dir)
    start = time.perf_counter()
    if direction == "ms2mg":
        source = read_mindformers_checkpoint(input_dir)
        entries = source.model_entries()
        iteration = source.iteration or 0
        notes = _left_out_buffers(source, model)
        plan = _forward_plan({k: i.shape for k, i in entries.items()}, model, core_version, experts, fault,
                             f"MindFormers checkpoint {source.directory}")
        keys_in, bytes_in = len(entries), sum(info.nbytes for info in entries.values())
    if direction == "ms2mg" and ckpt_format == "torch_dist":
        state = _run(plan, lambda keys: [_cast(source.tensor(key), dtype) for key in keys], keys_in, True, progress)
        _check_forward_output({k: tuple(v.shape) for k, v in state.items()}, model, core_version, experts, None)
        keys_out, bytes_out = len(state), _nbytes(state.values())
        stored = state["embedding.word_embeddings.weight"].dtype
        written = write_torch_dist_checkpoint(output_dir, iteration, state, model, core_version, stored)
        files = sorted(written.glob("*.distcp"))
    elif direction == "ms2mg":
        if fault is None:
            specs = _forward_specs(plan, entries, model, core_version, experts, dtype)
            tensors: Iterable[tuple[str, torch.Tensor]] = _outputs(plan, _reused_reads(source), keys_in, True,
                                                                   progress)
        else:  # a self-check on a small model: held in memory, so that the broken output needs no table
            state = _run(plan, lambda keys: [source.tensor(key) for key in keys], keys_in, True, progress)
            log.warning("fault %r injected: the Megatron output keys and shapes were NOT validated", fault)
            specs = {key: TensorSpec(tuple(t.shape), _stored_dtype(t.dtype, dtype)) for key, t in state.items()}
            tensors = state.items()
        keys_out, bytes_out = len(specs), sum(spec.nbytes for spec in specs.values())
        with one_thread():
            written = stream_megatron_checkpoint(output_dir, iteration, specs, tensors, model=model, tp=tp, pp=pp,
                                                 ep=ep, etp=etp)
        files = sorted(written.glob("mp_rank_*/*.pt"))
    else:
        source_mg = read_megatron_checkpoint(input_dir, model, core_version)
        iteration = source_mg.iteration
        loaded = source_mg.state
        keys_in, bytes_in = len(loaded), _nbytes(loaded.values())
        shapes = {key: tuple(tensor.shape) for key, tensor in loaded.items()}
        state = _inverse(lambda keys: [_cast(loaded.pop(key), dtype) for key in keys], shapes,
                         model, core_version, f"Megatron checkpoint {source_mg.directory}", progress)
        keys_out, bytes_out = len(state), _nbytes(state.values())
        buffers, notes = _fresh_buffers(model)
        state.update(buffers)
        if progress:
            progress(keys_in, keys_in, "writing the MindFormers files")
        written = write_mindformers_checkpoint(output_dir, iteration, state, None,
                                               default_common(iteration, global_batch_size),
                                               world=tp, split_dim=mindformers_split_dim)
        files = sorted(written.glob("*.safetensors"))
    return ConvertReport(direction=direction, input_dir=input_dir, output_dir=output_dir, iteration=iteration,
                         keys_in=keys_in, keys_out=keys_out, bytes_in=bytes_in, bytes_out=bytes_out,
                         seconds=time.perf_counter() - start, files=files, tp=tp, pp=pp, ep=ep, dtype=dtype,
                         format=ckpt_format if direction == "ms2mg" else source_mg.format, fault=fault,
                         output_validated=fault is None, notes=notes)
