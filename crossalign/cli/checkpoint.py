"""``crossalign cast-bf16`` and ``crossalign convert``: the checkpoint steps of the DAG (2 and 3)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from crossalign.cli.common import console, user_errors
from crossalign.report.units import size_text


def register(app: typer.Typer) -> None:
    """Add this area's commands to app."""
    app.command("cast-bf16")(cast_bf16_command)
    app.command("convert")(convert_command)


def _use_huge_pages() -> None:
    """Let torch back large tensors with transparent huge pages (read when torch first allocates).

    Filling gigabytes of fresh memory costs a page fault per 4 KiB page otherwise; with
    ``THP_MEM_ALLOC_ENABLE`` a conversion's upcast of the model runs about twice as fast.
    """
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description:<28.28}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True)


def _byte_progress():
    """A bar by bytes, with the rate and the time left (a conversion reports the bytes of its input read)."""
    # rich's progress module is imported when a command runs, not when the CLI starts
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    return Progress(TextColumn("{task.description:<28.28}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=console, transient=True)


def cast_bf16_command(
    input_dir: Path = typer.Option(..., "--input", help="MindFormers checkpoint: root with the tracker, an "
                                   "iteration_%08d folder, or a bare folder of safetensors."),
    output_dir: Path = typer.Option(..., "--output", help="New (or empty) folder for the bf16 copy."),
) -> None:
    """Cast every floating tensor of a MindFormers checkpoint to bf16, keeping its layout (any model)."""
    _use_huge_pages()
    from crossalign.checkpoint.cast import cast_bf16
    from crossalign.tensorio.errors import CheckpointError

    with user_errors(CheckpointError, OSError), _progress() as progress:
        task = progress.add_task("casting", total=None)

        def report(done: int, total: int, name: str) -> None:
            progress.update(task, completed=done, total=total, description=name)

        result = cast_bf16(input_dir, output_dir, progress=report)
    console.print(f"cast {result.cast} of {result.tensors} tensors to bf16 in {len(result.files)} file(s): "
                  f"{size_text(result.bytes_in)} -> {size_text(result.bytes_out)} in {result.seconds:.1f} s -> {output_dir}",
                  highlight=False)
    if result.buffers or result.optimizer_files:
        console.print(f"kept {result.buffers} buffer(s) and {len(result.optimizer_files)} optimizer file(s) "
                      "as they are", highlight=False)


def convert_command(
    model: str = typer.Option(..., "--model", help="Model config name or YAML path."),
    direction: str = typer.Option(..., "--direction", help="ms2mg (MindFormers -> Megatron), mg2ms, hf2ms "
                                  "(Hugging Face -> MindFormers), hf2mg, ms2hf or mg2hf."),
    input_dir: Path = typer.Option(..., "--input", help="Checkpoint folder to read (a Hugging Face one: config.json "
                                   "and model.safetensors or its shards with model.safetensors.index.json)."),
    output_dir: Path = typer.Option(..., "--output", help="New (or empty) folder to write."),
    core_version: Optional[str] = typer.Option(None, "--core-version", help="Megatron core version (decides the MTP "
                                               "key prefix); default: the config's training.megatron_core_version."),
    dtype: str = typer.Option("fp32", "--dtype", help="fp32 (as the source converter), bf16, or keep."),
    experts: str = typer.Option("per-expert", "--experts", help="per-expert (TE grouped linear_fc1.weight0..N, "
                                "loads strictly) or stacked (one [E, 2i, H] tensor)."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel ranks of the output: Megatron's (ms2mg, hf2mg), or "
                           "MindFormers rank files with metadata.json (mg2ms)."),
    pp: int = typer.Option(1, "--pp", help="Pipeline stages of the Megatron output (ms2mg, hf2mg)."),
    ep: int = typer.Option(1, "--ep", help="Expert-parallel ranks of the Megatron output (ms2mg, hf2mg): each holds "
                           "num_experts/ep routed experts, numbered locally, in mp_rank_TT[_PPP]_EEE."),
    etp: Optional[int] = typer.Option(None, "--etp", help="Expert tensor-parallel size of the Megatron output "
                                      "(ms2mg, hf2mg; default: --tp, as Megatron defaults it; must divide --tp)."),
    ckpt_format: str = typer.Option("torch", "--format", help="Megatron checkpoint format written by ms2mg: torch "
                                    "(legacy mp_rank_* files at --tp/--pp/--ep) or torch_dist (Megatron's default "
                                    "--ckpt-format, resharded by Megatron at load; streamed without the model). "
                                    "mg2ms and mg2hf read either."),
    part: Optional[str] = typer.Option(None, "--part", help="P/N: ms2mg --format torch_dist writes only part P of N "
                                       "(a range of layers) into OUTPUT.parts, shared by the N machines that write "
                                       "the parts at the same time; then --finish N."),
    finish: Optional[int] = typer.Option(None, "--finish", help="N: the index of the N parts written by --part into "
                                         "OUTPUT.parts, which then becomes OUTPUT."),
    fault: Optional[str] = typer.Option(None, "--fault", help="Inject a known conversion bug (self-check only); "
                                        "the output is then written without validation."),
) -> None:
    """Convert a checkpoint between the MindFormers, Megatron and Hugging Face layouts, validated before anything
    is written."""
    _use_huge_pages()
    from rich.table import Table

    from crossalign.checkpoint.convert import convert_checkpoint, convert_part, finish_parts, parts_folder
    from crossalign.tensorio.errors import CheckpointError
    from crossalign.checkpoint.faults import FAULTS
    from crossalign.config import ConfigError, load_config

    forms = {"per-expert": "per_expert", "stacked": "stacked"}
    with user_errors(CheckpointError, ConfigError, OSError):
        if experts not in forms:
            raise CheckpointError(f"--experts {experts!r} is not one of {', '.join(forms)}")
        if fault is not None and fault not in FAULTS:
            raise CheckpointError(f"--fault {fault!r} is not one of {', '.join(FAULTS)}")
        config = load_config(model)
        version = core_version or config.training.megatron_core_version
        with _byte_progress() if direction in ("ms2mg", "mg2ms") else _progress() as progress:
            task = progress.add_task("converting", total=None)

            def report(done: int, total: int, what: str) -> None:
                progress.update(task, completed=done, total=total, description=what)

            if part is not None or finish is not None:
                if (direction, ckpt_format, tp, pp, ep, etp, fault) != ("ms2mg", "torch_dist", 1, 1, 1, None, None):
                    raise CheckpointError("--part and --finish split ms2mg --format torch_dist (without --tp/--pp/"
                                          "--ep/--etp/--fault) over machines")
                options = dict(core_version=version, dtype=dtype, experts=forms[experts])
                if finish is not None:
                    result = finish_parts(config.model, input_dir, parts_folder(output_dir), output_dir, finish,
                                          **options)
                else:
                    number, _, count = part.partition("/")
                    if not (number.isdigit() and count.isdigit()):
                        raise CheckpointError(f"--part {part!r}: give it as P/N, part P of N (from 0)")
                    result = convert_part(config.model, input_dir, parts_folder(output_dir), int(number), int(count),
                                          progress=report, **options)
            else:
                result = convert_checkpoint(
                    config.model, direction, input_dir, output_dir,  # type: ignore[arg-type]
                    core_version=version, dtype=dtype, experts=forms[experts], tp=tp, pp=pp, ep=ep, etp=etp,
                    fault=fault, global_batch_size=config.training.global_batch_size, progress=report,
                    ckpt_format=ckpt_format)
    table = Table(title=f"{direction} {config.model.name} (core {version})", show_header=False)
    table.add_row("keys", f"{result.keys_in} in -> {result.keys_out} out")
    table.add_row("bytes", f"{size_text(result.bytes_in)} in -> {size_text(result.bytes_out)} out ({dtype})")
    table.add_row("layout", f"{result.format} tp={result.tp} pp={result.pp} ep={result.ep}, iteration {result.iteration}, {len(result.files)} file(s)")
    table.add_row("time", f"{result.seconds:.1f} s")
    table.add_row("output", str(result.output_dir))
    console.print(table)
    for note in result.notes:
        console.print(f"note: {note}", highlight=False)
    if fault is not None:
        console.print(f"[bold yellow]warning:[/] fault {fault!r} injected ({FAULTS[fault]}); "
                      "the output was written WITHOUT validation", highlight=False)
