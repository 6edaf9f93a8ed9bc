"""Checkpoint conversion between folders: ``convert_checkpoint``, the entry point of every direction.

This module is the MindSpore (MindFormers) <-> Megatron front end (ms2mg, mg2ms) and hands
the Hugging Face directions to ``hf_convert.py``; both build on ``convert_core.py``.
The rules of ``rules.py`` do the work; this module checks the input against the model's
shape table, runs the rules (each input key exactly once), checks the output against the
other side's table, and only then writes. Any mismatch is a ``CheckpointError`` that names
the keys, and nothing is written. A fault-injected conversion (``faults.py``) skips the
output check on purpose, with a warning.

MindSpore -> Megatron streams: the output keys are checked and the Megatron files laid out
from the tables before any tensor is read, then each rule reads its inputs into reused
buffers and its outputs go straight into their records, cast on the way (``torch_file.py``),
so memory holds one rule's tensors whatever the model size. Megatron -> MindSpore streams
the same way from a checkpoint of any layout, legacy or torch_dist: ``open_megatron`` reads one
full tensor at a time by the merge path both directions share (``sides/megatron/merge.py``).
Only a MindFormers output saved as several ranks (``--tp`` of mg2ms) is gathered in memory.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Iterable, Iterator, Literal

import torch

from crossalign.tensorio.atomic import check_output_dir
from crossalign.tensorio.blocks import one_thread
from crossalign.checkpoint.convert_core import (
    ConvertReport,
    Fetch,
    Progress,
    cast,
    check_dtype,
    check_forward_output,
    check_state,
    expert_form_of,
    forward_plan,
    forward_specs,
    fresh_buffers,
    inverse_specs,
    left_out_buffers,
    nbytes,
    reused_reads,
    rule_outputs,
    run_rules,
    stored_dtype,
    to_mindformers,
)
from crossalign.tensorio.errors import CheckpointError
from crossalign.checkpoint.expert_chunks import chunked_plan, chunked_reads, joined_chunks
from crossalign.checkpoint.hf_convert import HF_DIRECTIONS, convert_hf
from crossalign.models.layout import check_expert_form, megatron_shapes
from crossalign.sides.megatron.checkpoint import (
    open_megatron,
    stream_megatron_checkpoint,
    write_torch_dist_checkpoint,
)
from crossalign.sides.mindformers.checkpoint import (
    default_common,
    read_mindformers_checkpoint,
    stream_mindformers_checkpoint,
    write_mindformers_checkpoint,
)
from crossalign.sides.megatron.sharding import check_parallel_sizes, mindformers_split_dim
from crossalign.checkpoint.rules import conversion_plan
from crossalign.tensorio.torch_file import TensorSpec
from crossalign.config import ModelConfig

log = logging.getLogger(__name__)

def _counted(fetch: Fetch, total: int, progress: Progress | None, dtype: str | None = None) -> Fetch:
    """``fetch`` reporting ``progress(bytes read so far, total, key)`` after each rule's inputs, and casting them to
    ``dtype`` when given (after they are counted, in the bytes the source holds)."""
    done = 0

    def counted(keys: tuple[str, ...]) -> list[torch.Tensor]:
        nonlocal done
        tensors = fetch(keys)
        done += sum(tensor.numel() * tensor.element_size() for tensor in tensors)
        if progress:
            progress(min(done, total), total, keys[0])
        return tensors if dtype is None else [cast(tensor, dtype) for tensor in tensors]
    return counted


def _inputs(plan, forward: bool) -> int:
    """How many input keys a plan reads (a chunk of experts counts as one)."""
    return sum(len(placed.ms_keys if forward else placed.mg_keys) for placed in plan)


Direction = Literal["ms2mg", "mg2ms", "hf2ms", "hf2mg", "ms2hf"]
FORMATS = ("torch", "torch_dist")  # Megatron's --ckpt-format


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
    ``progress(done, total, what)`` counts the bytes of the input read for ms2mg and mg2ms (so that
    a bar and its time left follow the data), the tensors for the Hugging Face directions.
    """
    input_dir, output_dir = Path(input_dir), Path(output_dir)
    if direction in HF_DIRECTIONS:
        if fault is not None:
            raise CheckpointError("fault injection simulates an ms2mg converter: it does not apply to " + direction)
        return convert_hf(model, direction, input_dir, output_dir, core_version=core_version, dtype=dtype,
                          experts=experts, tp=tp, pp=pp, global_batch_size=global_batch_size, progress=progress)
    if direction not in ("ms2mg", "mg2ms"):
        raise CheckpointError(f"direction {direction!r} is not one of ms2mg, mg2ms, hf2ms, hf2mg, ms2hf")
    check_dtype(dtype)
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
        notes = left_out_buffers(source, model)
        plan = forward_plan({k: i.shape for k, i in entries.items()}, model, core_version, experts, fault,
                             f"MindFormers checkpoint {source.directory}")
        keys_in, bytes_in = len(entries), sum(info.nbytes for info in entries.values())
    if direction == "ms2mg" and ckpt_format == "torch_dist":
        state = run_rules(plan, _counted(lambda keys: [source.tensor(key) for key in keys], bytes_in, progress, dtype),
                          keys_in, True)
        check_forward_output({k: tuple(v.shape) for k, v in state.items()}, model, core_version, experts, None)
        keys_out, bytes_out = len(state), nbytes(state.values())
        stored = state["embedding.word_embeddings.weight"].dtype
        written = write_torch_dist_checkpoint(output_dir, iteration, state, model, core_version, stored)
        files = sorted(written.glob("*.distcp"))
    elif direction == "ms2mg":
        if fault is None:
            specs = forward_specs(plan, entries, model, core_version, experts, dtype)
            chunked = chunked_plan(plan, {key: info.nbytes for key, info in entries.items()})
            tensors: Iterable[tuple[str, torch.Tensor]] = rule_outputs(
                chunked, _counted(chunked_reads(source, model.num_experts or 1), bytes_in, progress),
                _inputs(chunked, True), True, None)
        else:  # a self-check on a small model: held in memory, so that the broken output needs no table
            state = run_rules(plan, _counted(lambda keys: [source.tensor(key) for key in keys], bytes_in, progress),
                              keys_in, True)
            log.warning("fault %r injected: the Megatron output keys and shapes were NOT validated", fault)
            specs = {key: TensorSpec(tuple(t.shape), stored_dtype(t.dtype, dtype)) for key, t in state.items()}
            tensors = state.items()
        keys_out, bytes_out = len(specs), sum(spec.nbytes for spec in specs.values())
        with one_thread():
            written = stream_megatron_checkpoint(output_dir, iteration, specs, tensors, model=model, tp=tp, pp=pp,
                                                 ep=ep, etp=etp)
        files = sorted(written.glob("mp_rank_*/*.pt"))
    else:
        # Any layout, legacy or torch_dist, read a full tensor at a time by the one merge path; what several
        # ranks hold is checked against its copies meanwhile, before the output is kept.
        with open_megatron(input_dir, model, core_version) as stream, one_thread():
            shapes = stream.shapes
            experts_in = expert_form_of(shapes)
            check_state(shapes, megatron_shapes(model, core_version, experts_in), f"Megatron checkpoint "
                        f"{stream.directory} does not match model {model.name} (core {core_version}, {experts_in} "
                        "experts)")
            plan = conversion_plan(model, core_version, experts_in)
            buffers, notes = fresh_buffers(model)
            specs = inverse_specs(plan, stream.dtypes, model, dtype)
            keys_in, keys_out = len(shapes), len(specs)
            bytes_in, bytes_out = stream.nbytes, sum(spec.nbytes for spec in specs.values())
            iteration, source_format = stream.iteration, stream.format
            read = reused_reads(stream)
            common = default_common(iteration, global_batch_size)
            if tp == 1:
                specs.update({name: TensorSpec(tuple(tensor.shape), tensor.dtype) for name, tensor in buffers.items()})

                chunked = chunked_plan(plan, {key: spec.nbytes for key, spec in specs.items()})

                def outputs() -> Iterator[tuple[str, torch.Tensor]]:
                    yield from joined_chunks(rule_outputs(
                        chunked, _counted(read, bytes_in, progress, dtype), keys_in, False, None))
                    yield from buffers.items()
                    stream.check_replicas()  # before the writer keeps the folder

                written = stream_mindformers_checkpoint(output_dir, iteration, specs, outputs(), common)
            else:  # a save by tp ranks: each rank's file holds slices of every tensor, so the model is gathered
                state = to_mindformers(_counted(lambda keys: [stream.tensor(key) for key in keys], bytes_in, progress,
                                                dtype), shapes, model, core_version,
                                       f"Megatron checkpoint {stream.directory}", None)
                stream.check_replicas()
                state.update(buffers)
                written = write_mindformers_checkpoint(output_dir, iteration, state, None, common, world=tp,
                                                       split_dim=mindformers_split_dim)
        files = sorted(written.glob("*.safetensors"))
    return ConvertReport(direction=direction, input_dir=input_dir, output_dir=output_dir, iteration=iteration,
                         keys_in=keys_in, keys_out=keys_out, bytes_in=bytes_in, bytes_out=bytes_out,
                         seconds=time.perf_counter() - start, files=files, tp=tp, pp=pp, ep=ep, dtype=dtype,
                         format=ckpt_format if direction == "ms2mg" else source_format, fault=fault,
                         output_validated=fault is None, notes=notes)

