"""Hugging Face <-> MindFormers / Megatron conversion: ``hf2mg``, ``hf2ms`` and ``ms2hf``.

The HF rules (``hf_rules.py``) map to Megatron's layout; MindFormers is reached through it with
the existing rules, so every direction uses rules that each state their inverse. The input is
checked against its shape table before anything is computed, the output against the other
side's table before anything is written, and the output folder appears whole or not at all.
hf2mg streams (one rule's tensors in memory at a time, as ms2mg); hf2ms and ms2hf hold the
model once in memory on the way through Megatron's layout.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from crossalign.tensorio.atomic import check_output_dir
from crossalign.tensorio.blocks import one_thread
from crossalign.checkpoint.convert_core import (
    ConvertReport,
    Progress,
    cast,
    check_dtype,
    check_state,
    expert_form_of,
    forward_specs,
    fresh_buffers,
    from_memory,
    left_out_buffers,
    mindformers_to_megatron,
    nbytes,
    reused_reads,
    rule_outputs,
    run_rules,
    to_mindformers,
)
from crossalign.tensorio.errors import CheckpointError
from crossalign.checkpoint.hf import HFCheckpoint, read_hf_checkpoint, write_hf_checkpoint
from crossalign.checkpoint.hf_rules import hf_plan, hf_shapes
from crossalign.models.layout import check_expert_form
from crossalign.sides.megatron.checkpoint import stream_megatron_checkpoint
from crossalign.sides.mindformers.checkpoint import default_common, read_mindformers_checkpoint, write_mindformers_checkpoint
from crossalign.sides.megatron.sharding import check_parallel_sizes
from crossalign.config import ConfigError, ModelConfig
from crossalign.hf_config import hf_config_from_model

HF_DIRECTIONS = ("hf2ms", "hf2mg", "ms2hf")
THROUGH = "0.16.1"  # the Megatron layout an hf2ms / ms2hf conversion passes through (any version gives the same)
CONFIG_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _checked_source(path: Path, model: ModelConfig) -> HFCheckpoint:
    source = read_hf_checkpoint(path)
    shapes = {key: info.shape for key, info in source.entries.items()}
    check_state(shapes, hf_shapes(model, source.experts, source.root),
                f"Hugging Face checkpoint {source.directory} does not match model {model.name}")
    return source


def hf_to_megatron_state(source: HFCheckpoint, model: ModelConfig, core_version: str = THROUGH,
                         experts: str = "stacked") -> dict[str, torch.Tensor]:
    """A checked HF checkpoint as a Megatron state dict in memory (norms as plain gammas)."""
    plan = hf_plan(model, core_version, experts, source.experts, source.root)
    return run_rules(plan, lambda keys: [source.tensor(key) for key in keys], len(source.entries), True)


def megatron_to_hf_state(state: dict[str, torch.Tensor], model: ModelConfig,
                         core_version: str = THROUGH) -> dict[str, torch.Tensor]:
    """A Megatron state dict (either expert form) as the HF text model's state, in HF key order."""
    experts = expert_form_of(state)
    out = run_rules(hf_plan(model, core_version, experts), from_memory(state), len(state), False)
    table = hf_shapes(model)
    check_state({key: tuple(t.shape) for key, t in out.items()}, table, f"Hugging Face output for model {model.name}")
    return {key: out[key] for key in table}


def convert_hf(model: ModelConfig, direction: str, input_dir: Path, output_dir: Path, *, core_version: str = "0.16.1",
               dtype: str = "fp32", experts: str = "per_expert", tp: int = 1, pp: int = 1,
               global_batch_size: int | None = None, iteration: int = 0,
               progress: Progress | None = None) -> ConvertReport:
    """Convert between a Hugging Face checkpoint folder and a MindFormers (hf2ms, ms2hf) or Megatron (hf2mg) one.

    A checkpoint converted from HF has the iteration ``iteration`` (0: nothing trained yet).
    """
    input_dir, output_dir = Path(input_dir), Path(output_dir)
    if direction not in HF_DIRECTIONS:
        raise CheckpointError(f"direction {direction!r} is not one of {', '.join(HF_DIRECTIONS)}")
    check_dtype(dtype)
    check_expert_form(experts)
    if direction != "hf2mg" and (tp, pp) != (1, 1):
        raise CheckpointError(f"{direction} reads or writes a single-rank checkpoint: --tp and --pp apply to hf2mg only")
    check_parallel_sizes(model, tp, pp)
    check_output_dir(output_dir)
    start = time.perf_counter()
    notes: list[str] = []
    if direction == "hf2mg":
        source = _checked_source(input_dir, model)
        plan = hf_plan(model, core_version, experts, source.experts, source.root)
        specs = forward_specs(plan, source.entries, model, core_version, experts, dtype)
        keys_in = len(source.entries)
        with one_thread():
            written = stream_megatron_checkpoint(output_dir, iteration, specs,
                                                 rule_outputs(plan, reused_reads(source), keys_in, True, progress),
                                                 model=model, tp=tp, pp=pp)
        files = sorted(written.glob("mp_rank_*/*.pt"))
        bytes_in = sum(info.nbytes for info in source.entries.values())
        keys_out, bytes_out = len(specs), sum(spec.nbytes for spec in specs.values())
    elif direction == "hf2ms":
        source = _checked_source(input_dir, model)
        keys_in, bytes_in = len(source.entries), sum(info.nbytes for info in source.entries.values())
        megatron = hf_to_megatron_state(source, model)
        shapes = {key: tuple(t.shape) for key, t in megatron.items()}
        state = to_mindformers(lambda keys: [cast(megatron.pop(key), dtype) for key in keys], shapes, model, THROUGH,
                               f"Megatron form of {source.directory}", progress)
        keys_out, bytes_out = len(state), nbytes(state.values())
        buffers, notes = fresh_buffers(model)  # as MindFormers' MoE layer saves them
        state.update(buffers)
        written = write_mindformers_checkpoint(output_dir, iteration, state, None,
                                               default_common(iteration, global_batch_size))
        files = sorted(written.glob("*.safetensors"))
    else:
        try:
            config = hf_config_from_model(model, "float32")
        except ConfigError as exc:
            raise CheckpointError(str(exc)) from None
        source_ms = read_mindformers_checkpoint(input_dir)
        notes = left_out_buffers(source_ms, model)
        loaded = source_ms.model_state()
        iteration = source_ms.iteration or 0
        keys_in, bytes_in = len(loaded), nbytes(loaded.values())
        hf_state = {key: cast(tensor, dtype) for key, tensor in
                    megatron_to_hf_state(mindformers_to_megatron(loaded, model, THROUGH, "stacked"), model).items()}
        del loaded
        config["dtype"] = CONFIG_DTYPES.get(next(iter(hf_state.values())).dtype, "float32")
        files = write_hf_checkpoint(output_dir, hf_state, config)
        keys_out, bytes_out = len(hf_state), nbytes(hf_state.values())
    return ConvertReport(direction=direction, input_dir=input_dir, output_dir=output_dir, iteration=iteration,
                         keys_in=keys_in, keys_out=keys_out, bytes_in=bytes_in, bytes_out=bytes_out,
                         seconds=time.perf_counter() - start, files=files, tp=tp, pp=pp, dtype=dtype, notes=notes)
