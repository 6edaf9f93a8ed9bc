"""The conversion front end: ``convert_checkpoint`` (folders) and ``convert_state`` (in memory), every direction.

Directions: ms2mg, mg2ms (MindSpore / MindFormers <-> Megatron), hf2mg, mg2hf (Hugging Face
<-> Megatron), hf2ms, ms2hf (through Megatron's layout). Every direction runs one side's column
of the rule table (``rules.py``) forward or inverse with the machinery of ``convert_core.py``:
the input is checked against its side's shape table, the rules run (each input key exactly
once), the output is checked against the other side's table, and only then written. Any
mismatch is a ``CheckpointError`` that names the keys, and nothing is written. A
fault-injected conversion (``faults.py``) skips the output check on purpose, with a warning.

MindSpore -> Megatron streams: the output keys are checked and the Megatron files laid out
from the tables before any tensor is read, then each rule reads its inputs into reused
buffers and its outputs go straight into their records, cast on the way (``torch_file.py``),
so memory holds one rule's tensors whatever the model size; into torch_dist each output goes
chunk by chunk into torch's own writer (``sides/megatron/torch_dist_write.py``), in one process
or as parts (ranges of layers, ``convert_part``) that several machines write at the same time and
``finish_parts`` then indexes. Megatron -> MindSpore streams the same way from a checkpoint of any
layout, legacy or torch_dist: ``open_megatron`` reads one full tensor at a time (a routed expert
of torch_dist from its own chunks) by the merge path both directions share (``sides/megatron/merge.py``),
into one MindFormers file or, with ``--tp``, into the files of that many ranks at once, each
tensor cut into its rank slices as it comes.

Hugging Face -> Megatron streams as MindSpore -> Megatron does; Megatron -> Hugging Face merges
the Megatron checkpoint in memory; hf2ms and ms2hf hold the model once in memory on the way
through Megatron's layout.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Iterable, Iterator, Literal, Mapping, get_args

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
    forward_specs,
    fresh_buffers,
    from_megatron,
    from_memory,
    inverse_specs,
    left_out_buffers,
    nbytes,
    reused_reads,
    rule_outputs,
    run_rules,
    stored_dtype,
    to_megatron_plan,
)
from crossalign.tensorio.errors import CheckpointError
from crossalign.checkpoint.expert_chunks import chunked_plan, chunked_reads, joined_chunks
from crossalign.checkpoint.hf import read_hf_checkpoint, write_hf_checkpoint
from crossalign.models.layout import check_expert_form, megatron_shapes
from crossalign.sides.megatron.checkpoint import (
    TRACKER,
    iteration_dir_name,
    open_megatron,
    read_megatron_checkpoint,
    stream_megatron_checkpoint,
    write_torch_dist_checkpoint,
)
from crossalign.sides.mindformers.checkpoint import (
    MindFormersCheckpoint,
    default_common,
    read_mindformers_checkpoint,
    stream_mindformers_checkpoint,
    write_mindformers_checkpoint,
)
from crossalign.sides.megatron.sharding import check_parallel_sizes, mindformers_split_dim
from crossalign.sides.megatron.torch_dist_layout import part_of, torch_dist_layout
from crossalign.sides.megatron.torch_dist_write import finish_torch_dist, write_part
from crossalign.checkpoint.rules import PlacedRule, conversion_plan
from crossalign.tensorio.torch_file import TensorSpec
from crossalign.config import ConfigError, ModelConfig
from crossalign.hf_config import hf_config_from_model

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
    return sum(len(placed.source_keys if forward else placed.target_keys) for placed in plan)


Direction = Literal["ms2mg", "mg2ms", "hf2mg", "mg2hf", "hf2ms", "ms2hf"]
DIRECTIONS: tuple[str, ...] = get_args(Direction)
HF_DIRECTIONS = ("hf2mg", "mg2hf", "hf2ms", "ms2hf")
FORMATS = ("torch", "torch_dist")  # Megatron's --ckpt-format
THROUGH = "0.16.1"  # the Megatron layout an hf2ms / ms2hf conversion passes through (any version gives the same)
CONFIG_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def check_direction(direction: str) -> None:
    if direction not in DIRECTIONS:
        raise CheckpointError(f"direction {direction!r} is not one of {', '.join(DIRECTIONS)}")


def convert_state(state: Mapping[str, torch.Tensor], model: ModelConfig, direction: Direction,
                  core_version: str = "0.16.1", experts: str = "per_expert",
                  fault: str | None = None) -> dict[str, torch.Tensor]:
    """A state dict converted in memory, checked against both sides' tables like a folder conversion.

    ``core_version`` and ``experts`` (Megatron's routed-expert form) shape the Megatron output of
    ms2mg and hf2mg; a Megatron input of either expert form is read. MindFormers input may hold
    routed experts in pynative or graph layout; Hugging Face input sits under either root, with
    per-expert or packed experts; Hugging Face output is the text model of ``save_pretrained``.
    ``fault`` (ms2mg only) breaks one rule as ``faults.py`` describes and skips the output check.
    """
    check_direction(direction)
    if fault is not None and direction != "ms2mg":
        raise CheckpointError("fault injection simulates an ms2mg converter: it does not apply to " + direction)
    if direction == "hf2ms":
        return convert_state(convert_state(state, model, "hf2mg", THROUGH, "stacked"), model, "mg2ms", THROUGH)
    if direction == "ms2hf":
        return convert_state(convert_state(state, model, "ms2mg", THROUGH, "stacked"), model, "mg2hf", THROUGH)
    shapes = {key: tuple(tensor.shape) for key, tensor in state.items()}
    if direction in ("mg2ms", "mg2hf"):
        side = "mindformers" if direction == "mg2ms" else "hf"
        return from_megatron(from_memory(state), shapes, model, core_version, "Megatron state", None, side)
    side, what = ("mindformers", "MindFormers state") if direction == "ms2mg" else ("hf", "Hugging Face state")
    plan = to_megatron_plan(shapes, model, core_version, experts, fault, what, side)
    out = run_rules(plan, from_memory(state), len(shapes), True)
    check_forward_output({key: tuple(tensor.shape) for key, tensor in out.items()}, model, core_version, experts,
                         fault)
    return out


def mindformers_to_megatron(state: Mapping[str, torch.Tensor], model: ModelConfig, core_version: str = "0.16.1",
                            experts: str = "per_expert", fault: str | None = None) -> dict[str, torch.Tensor]:
    """``convert_state`` ms2mg: a MindFormers state dict as a Megatron one (TP=1, PP=1)."""
    return convert_state(state, model, "ms2mg", core_version, experts, fault)


def megatron_to_mindformers(state: Mapping[str, torch.Tensor], model: ModelConfig,
                            core_version: str = "0.16.1") -> dict[str, torch.Tensor]:
    """``convert_state`` mg2ms: the exact inverse of ms2mg (either expert form in; pynative expert layout out)."""
    return convert_state(state, model, "mg2ms", core_version)


def convert_checkpoint(model: ModelConfig, direction: Direction, input_dir: Path, output_dir: Path, *,
                       core_version: str = "0.16.1", dtype: str = "fp32", experts: str = "per_expert",
                       tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None, fault: str | None = None,
                       global_batch_size: int | None = None, progress: Progress | None = None,
                       ckpt_format: str = "torch") -> ConvertReport:
    """Convert a checkpoint folder into a new folder (which must not exist or be empty), in any direction.

    ms2mg reads a MindFormers checkpoint (one rank's, or several ranks' slices stitched by
    their metadata.json) tensor by tensor, leaves out its optimizer state and buffers, and
    writes a Megatron legacy checkpoint resharded to tp x pp x ep (routed experts split
    over ``etp`` tensor ranks, None: tp); mg2ms merges a Megatron checkpoint of any layout
    and writes a MindFormers checkpoint as ``tp`` ranks save it (one file per rank and
    metadata.json when tp > 1), with the buffers of MindFormers' MoE layers, and whose
    common.json records the Megatron iteration (and ``global_batch_size`` with the samples
    consumed, when given).
    ``dtype`` casts floating tensors (fp32, as the source converter does, bf16, or keep).
    ``ckpt_format`` torch_dist makes ms2mg write Megatron's torch_dist checkpoint instead, streamed
    (``torch_dist_write.py``): one copy of the whole model, resharded by Megatron at load, so it
    takes no tp/pp/ep. mg2ms reads either format.
    hf2mg reads a Hugging Face folder tensor by tensor and writes Megatron's legacy checkpoint
    as ms2mg does (iteration 0: nothing trained yet); mg2hf merges a Megatron checkpoint of
    any layout and writes the Hugging Face text model (config.json from ``model``); hf2ms and
    ms2hf pass through Megatron's layout in memory. The Hugging Face side holds no iteration.
    ``progress(done, total, what)`` counts the bytes of the input read for ms2mg and mg2ms (so that
    a bar and its time left follow the data), the tensors for the Hugging Face directions.
    """
    input_dir, output_dir = Path(input_dir), Path(output_dir)
    check_direction(direction)
    if fault is not None and direction != "ms2mg":
        raise CheckpointError("fault injection simulates an ms2mg converter: it does not apply to " + direction)
    check_dtype(dtype)
    check_expert_form(experts)
    check_parallel_sizes(model, tp, pp, ep, etp)
    if direction == "mg2ms" and (pp, ep, etp) != (1, 1, None):
        raise CheckpointError("mg2ms writes the ranks of one tensor-parallel group: --pp, --ep and --etp apply to "
                              "ms2mg only (mg2ms reads any Megatron layout)")
    if direction in ("mg2hf", "hf2ms", "ms2hf") and (tp, pp, ep, etp) != (1, 1, 1, None):
        raise CheckpointError(f"{direction} reads or writes a single-rank checkpoint: --tp, --pp, --ep and --etp "
                              "apply to ms2mg and hf2mg (and --tp to mg2ms)")
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
    if direction in HF_DIRECTIONS:
        return _convert_hf(model, direction, input_dir, output_dir, start, core_version=core_version, dtype=dtype,
                           experts=experts, tp=tp, pp=pp, ep=ep, etp=etp, global_batch_size=global_batch_size,
                           progress=progress)
    if direction == "ms2mg":
        source = read_mindformers_checkpoint(input_dir)
        entries = source.model_entries()
        iteration = source.iteration or 0
        notes = left_out_buffers(source, model)
        plan = to_megatron_plan({k: i.shape for k, i in entries.items()}, model, core_version, experts, fault,
                                f"MindFormers checkpoint {source.directory}")
        keys_in, bytes_in = len(entries), sum(info.nbytes for info in entries.values())
    if direction == "ms2mg" and ckpt_format == "torch_dist":
        specs = forward_specs(plan, entries, model, core_version, experts, dtype)
        keys_out, bytes_out = len(specs), sum(spec.nbytes for spec in specs.values())
        with one_thread():
            written = write_torch_dist_checkpoint(output_dir, iteration, specs, _part_outputs(
                model, source, plan, 0, 1, progress), torch_dist_layout(model, core_version, experts))
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
            specs.update({name: TensorSpec(tuple(tensor.shape), tensor.dtype) for name, tensor in buffers.items()})
            chunked = chunked_plan(plan, {key: spec.nbytes for key, spec in specs.items()})

            def outputs() -> Iterator[tuple[str, torch.Tensor]]:
                yield from joined_chunks(rule_outputs(
                    chunked, _counted(read, bytes_in, progress, dtype), keys_in, False, None))
                yield from buffers.items()
                stream.check_replicas()  # before the writer keeps the folder

            # With tp > 1 each tensor is cut into its tp rank slices as it comes, into tp files open at once.
            written = stream_mindformers_checkpoint(output_dir, iteration, specs, outputs(), common, world=tp,
                                                    split_dim=mindformers_split_dim)
        files = sorted(written.glob("*.safetensors"))
    return ConvertReport(direction=direction, input_dir=input_dir, output_dir=output_dir, iteration=iteration,
                         keys_in=keys_in, keys_out=keys_out, bytes_in=bytes_in, bytes_out=bytes_out,
                         seconds=time.perf_counter() - start, files=files, tp=tp, pp=pp, ep=ep, dtype=dtype,
                         format=ckpt_format if direction == "ms2mg" else source_format, fault=fault,
                         output_validated=fault is None, notes=notes)


def _part_plan(model: ModelConfig, plan: list[PlacedRule], part: int, parts: int) -> list[PlacedRule]:
    """The rules of ``part`` of ``parts``: those whose Megatron keys are in its layer range (``part_of``)."""
    return [placed for placed in plan if part_of(placed.target_keys[0], model, parts) == part]


def _part_outputs(model: ModelConfig, source: MindFormersCheckpoint, plan: list[PlacedRule], part: int, parts: int,
                  progress: Progress | None) -> Iterator[tuple[str, torch.Tensor]]:
    """The Megatron tensors of ``part`` of ``parts``, each rule's as it comes (routed experts a chunk at a time)."""
    mine = _part_plan(model, plan, part, parts)
    entries = source.model_entries()
    chunked = chunked_plan(mine, {key: info.nbytes for key, info in entries.items()})
    bytes_in = sum(entries[key].nbytes for placed in mine for key in placed.source_keys)
    return rule_outputs(chunked, _counted(chunked_reads(source, model.num_experts or 1), bytes_in, progress),
                        _inputs(chunked, True), True, None)


def _torch_dist_source(model: ModelConfig, input_dir: Path, core_version: str, dtype: str, experts: str):
    """A MindFormers checkpoint's plan into torch_dist: (source, plan, specs, layout, notes), checked."""
    check_dtype(dtype)
    check_expert_form(experts)
    source = read_mindformers_checkpoint(input_dir)
    entries = source.model_entries()
    notes = left_out_buffers(source, model)
    plan = to_megatron_plan({k: i.shape for k, i in entries.items()}, model, core_version, experts, None,
                            f"MindFormers checkpoint {source.directory}")
    specs = forward_specs(plan, entries, model, core_version, experts, dtype)
    return source, plan, specs, torch_dist_layout(model, core_version, experts), notes


def parts_folder(output_dir: Path) -> Path:
    """Where the parts of a torch_dist conversion into ``output_dir`` are written: its sibling ``<name>.parts``."""
    return Path(output_dir).with_name(Path(output_dir).name + ".parts")


def convert_part(model: ModelConfig, input_dir: Path, parts_dir: Path, part: int, parts: int, *,
                 core_version: str = "0.16.1", dtype: str = "fp32", experts: str = "per_expert",
                 progress: Progress | None = None) -> ConvertReport:
    """ms2mg into torch_dist, part ``part`` of ``parts``: the layer range ``part_of`` gives it, written into
    ``parts_dir`` (shared by every part, on any machine) as ``iter_N/__{part}_0.distcp`` and its own index.

    Parts run at the same time; ``finish_parts`` then writes the checkpoint's index and moves it
    into place. A part written again replaces its files.
    """
    if not 0 <= part < parts:
        raise CheckpointError(f"part {part} of {parts}: parts are numbered 0 .. {parts - 1}")
    start = time.perf_counter()
    source, plan, specs, layout, notes = _torch_dist_source(model, Path(input_dir), core_version, dtype, experts)
    iteration = source.iteration or 0
    folder = Path(parts_dir) / iteration_dir_name(iteration)
    folder.mkdir(parents=True, exist_ok=True)
    mine = _part_plan(model, plan, part, parts)
    specs = {key: specs[key] for placed in mine for key in placed.target_keys}
    with one_thread():
        write_part(folder, part, specs, _part_outputs(model, source, plan, part, parts, progress), layout,
                   with_objects=part == 0)
    entries = source.model_entries()
    bytes_in = sum(entries[key].nbytes for placed in mine for key in placed.source_keys)
    bytes_out = sum(spec.nbytes for spec in specs.values())
    return ConvertReport(direction="ms2mg", input_dir=Path(input_dir), output_dir=Path(parts_dir),
                         iteration=iteration, keys_in=len(source.model_entries()), keys_out=len(specs),
                         bytes_in=bytes_in, bytes_out=bytes_out, seconds=time.perf_counter() - start,
                         files=[folder / f"__{part}_0.distcp"], dtype=dtype, format="torch_dist", notes=notes)


def finish_parts(model: ModelConfig, input_dir: Path, parts_dir: Path, output_dir: Path, parts: int, *,
                 core_version: str = "0.16.1", dtype: str = "fp32", experts: str = "per_expert") -> ConvertReport:
    """The torch_dist checkpoint of ``parts`` parts written into ``parts_dir`` (``convert_part``): its index
    (every chunk of the model stored exactly once, or nothing is done), metadata.json, common.pt and tracker;
    then ``parts_dir`` becomes ``output_dir``, which appears only complete."""
    start = time.perf_counter()
    output_dir = Path(output_dir)
    check_output_dir(output_dir)
    source, _, specs, layout, notes = _torch_dist_source(model, Path(input_dir), core_version, dtype, experts)
    iteration = source.iteration or 0
    folder = Path(parts_dir) / iteration_dir_name(iteration)
    finish_torch_dist(folder, parts, layout, iteration)
    (Path(parts_dir) / TRACKER).write_text(str(iteration))
    if output_dir.exists():
        output_dir.rmdir()
    Path(parts_dir).rename(output_dir)
    written = output_dir / iteration_dir_name(iteration)
    return ConvertReport(direction="ms2mg", input_dir=Path(input_dir), output_dir=output_dir, iteration=iteration,
                         keys_in=len(source.model_entries()), keys_out=len(specs),
                         bytes_in=sum(info.nbytes for info in source.model_entries().values()),
                         bytes_out=sum(spec.nbytes for spec in specs.values()), seconds=time.perf_counter() - start,
                         files=sorted(written.glob("*.distcp")), dtype=dtype, format="torch_dist", notes=notes)


def _convert_hf(model: ModelConfig, direction: str, input_dir: Path, output_dir: Path, start: float, *,
                core_version: str, dtype: str, experts: str, tp: int, pp: int, ep: int, etp: int | None,
                global_batch_size: int | None, progress: Progress | None) -> ConvertReport:
    """hf2mg, hf2ms, ms2hf and mg2hf between folders, the arguments already checked."""
    iteration, notes, source_format = 0, [], "torch"

    def report(keys_in: int, keys_out: int, bytes_in: int, bytes_out: int, files: list[Path]) -> ConvertReport:
        return ConvertReport(direction=direction, input_dir=input_dir, output_dir=output_dir, iteration=iteration,
                             keys_in=keys_in, keys_out=keys_out, bytes_in=bytes_in, bytes_out=bytes_out,
                             seconds=time.perf_counter() - start, files=files, tp=tp, pp=pp, ep=ep, dtype=dtype,
                             format=source_format, notes=notes)

    if direction in ("hf2mg", "hf2ms"):
        source = read_hf_checkpoint(input_dir)
        shapes = {key: info.shape for key, info in source.entries.items()}
        keys_in, bytes_in = len(shapes), sum(info.nbytes for info in source.entries.values())
        what = f"Hugging Face checkpoint {source.directory}"
        if direction == "hf2mg":
            plan = to_megatron_plan(shapes, model, core_version, experts, None, what, "hf")
            specs = forward_specs(plan, source.entries, model, core_version, experts, dtype)
            keys_out, bytes_out = len(specs), sum(spec.nbytes for spec in specs.values())
            with one_thread():
                written = stream_megatron_checkpoint(output_dir, iteration, specs,
                                                     rule_outputs(plan, reused_reads(source), keys_in, True, progress),
                                                     model=model, tp=tp, pp=pp, ep=ep, etp=etp)
            return report(keys_in, keys_out, bytes_in, bytes_out, sorted(written.glob("mp_rank_*/*.pt")))
        plan = to_megatron_plan(shapes, model, THROUGH, "stacked", None, what, "hf")
        megatron = run_rules(plan, lambda keys: [source.tensor(key) for key in keys], keys_in, True)
        state = from_megatron(lambda keys: [cast(megatron.pop(key), dtype) for key in keys],
                              {key: tuple(t.shape) for key, t in megatron.items()}, model, THROUGH,
                              f"Megatron form of {source.directory}", progress)
        keys_out, bytes_out = len(state), nbytes(state.values())
        buffers, notes = fresh_buffers(model)  # as MindFormers' MoE layer saves them
        state.update(buffers)
        written = write_mindformers_checkpoint(output_dir, iteration, state, None,
                                               default_common(iteration, global_batch_size))
        return report(keys_in, keys_out, bytes_in, bytes_out, sorted(written.glob("*.safetensors")))
    try:
        config = hf_config_from_model(model, "float32")
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None
    if direction == "ms2hf":
        source_ms = read_mindformers_checkpoint(input_dir)
        notes = left_out_buffers(source_ms, model)
        loaded = source_ms.model_state()
        iteration = source_ms.iteration or 0
        converted = convert_state(loaded, model, "ms2hf")
    else:
        source_mg = read_megatron_checkpoint(input_dir, model, core_version)
        loaded, iteration, source_format = source_mg.state, source_mg.iteration, source_mg.format
        converted = from_megatron(from_memory(loaded), {key: tuple(t.shape) for key, t in loaded.items()}, model,
                                  core_version, f"Megatron checkpoint {source_mg.directory}", progress, "hf")
    keys_in, bytes_in = len(loaded), nbytes(loaded.values())
    del loaded
    hf_state = {key: cast(tensor, dtype) for key, tensor in converted.items()}
    del converted
    config["dtype"] = CONFIG_DTYPES.get(next(iter(hf_state.values())).dtype, "float32")
    files = write_hf_checkpoint(output_dir, hf_state, config)
    return report(keys_in, len(hf_state), bytes_in, nbytes(hf_state.values()), files)
