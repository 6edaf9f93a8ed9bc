"""``crossalign data prepare`` and ``crossalign preflight data``.

``preflight_app`` is the shared ``preflight`` sub-app: other areas add their checks to it
(``preflight config``).

What a command runs is imported inside it, so that ``crossalign --help`` starts without torch, MindSpore or Prefect.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from crossalign.cli.common import console, user_errors

data_app = typer.Typer(name="data", help="Build the shared tokenizer and Megatron indexed dataset.",
                       no_args_is_help=True)
preflight_app = typer.Typer(name="preflight", help="Checks to run before training on real machines.",
                            no_args_is_help=True)


def register(app: typer.Typer) -> None:
    """Add this area's commands to app."""
    app.add_typer(data_app, name="data")
    app.add_typer(preflight_app, name="preflight")


@data_app.command("prepare")
def prepare(
    out: Path = typer.Option(..., "--out", help="Output folder (reused when it already holds a complete dataset)."),
    vocab_size: int = typer.Option(..., "--vocab-size", help="Largest tokenizer vocabulary (the model's vocab_size)."),
) -> None:
    """Train the BPE tokenizer on the shipped corpus and write the Megatron indexed dataset."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from crossalign.data.corpus import CorpusError
    from crossalign.data.prepare import prepare_dataset, read_manifest

    labels = {"tokenizer": "train tokenizer", "tokenize": "tokenize documents", "write": "write index"}
    with user_errors(CorpusError, ValueError, OSError), Progress(
            TextColumn("{task.description:<20}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=console, transient=False) as progress:
        tasks: dict[str, int] = {}

        def report(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = progress.add_task(labels[stage], total=total)
            progress.update(tasks[stage], completed=done, total=total)

        reused = read_manifest(out, vocab_size) is not None
        files = prepare_dataset(out, vocab_size, progress=report)
    manifest = read_manifest(out, vocab_size) or {}
    console.print(f"{'reused' if reused else 'built'} {files.prefix}.bin/.idx and {files.tokenizer}: "
                  f"{manifest.get('documents')} documents, {manifest.get('tokens')} tokens, "
                  f"vocab {manifest.get('tokenizer_vocab_size')}, eod id {manifest.get('eod_id')}, "
                  f"dtype {manifest.get('dtype')}", highlight=False)


@preflight_app.command("data")
def preflight_data(
    model: str = typer.Option(..., "--model", help="Model config name or YAML path."),
    data: Optional[Path] = typer.Option(None, "--data", help="Prepared dataset folder or indexed-dataset prefix "
                                        "(default: prepare one in the user cache)."),
    batches: int = typer.Option(8, "--batches", min=1, help="Global batches to compare."),
    megatron_args: Optional[Path] = typer.Option(None, "--megatron-args", help="Megatron arguments to take the "
                                                 "Megatron settings from (one per line, or the pretrain_gpt.py "
                                                 "command line)."),
    mindformers_yaml: Optional[Path] = typer.Option(None, "--mindformers-yaml", help="MindFormers YAML to take the "
                                                    "MindFormers settings from."),
    megatron_seed: Optional[int] = typer.Option(None, help="Override the Megatron side's --seed."),
    mindformers_seed: Optional[int] = typer.Option(None, help="Override the MindFormers dataset seed."),
    megatron_split: Optional[str] = typer.Option(None, help="Override the Megatron side's --split."),
    mindformers_split: Optional[str] = typer.Option(None, help="Override the MindFormers split."),
    megatron_blend: Optional[str] = typer.Option(None, help="Megatron data path form: bare or weighted."),
    mindformers_blend: Optional[str] = typer.Option(None, help="MindFormers data_path form: bare or weighted."),
    megatron_loader: Optional[str] = typer.Option(None, help="Megatron --dataloader-type: single or cyclic."),
    mindformers_loader: Optional[str] = typer.Option(None, help="MindFormers loader: single or cyclic."),
    megatron_num_samples: Optional[int] = typer.Option(None, help="Override Megatron's train samples."),
    mindformers_num_samples: Optional[int] = typer.Option(None, help="Override MindFormers' sizes[0]."),
) -> None:
    """Compare the token digests of the first global batches of both sides; exit 1 when they differ."""
    from crossalign.sides.megatron.side import MEGATRON
    from crossalign.sides.mindformers.side import MINDFORMERS
    from crossalign.config import ConfigError, load_config
    from crossalign.preflight.data import compare_sample_order

    with user_errors(ConfigError, ValueError, OSError):
        config = load_config(model)
        training = config.training
        prefix = _resolve_prefix(data, config.model.vocab_size)
        megatron = MEGATRON.launch_sample_order(megatron_args) if megatron_args else MEGATRON.sample_order(training)
        mindformers = (MINDFORMERS.launch_sample_order(mindformers_yaml) if mindformers_yaml
                       else MINDFORMERS.sample_order(training))
        megatron = _override(megatron, seed=megatron_seed, split=megatron_split, blend=megatron_blend,
                             dataloader_type=megatron_loader, num_samples=megatron_num_samples)
        mindformers = _override(mindformers, seed=mindformers_seed, split=mindformers_split, blend=mindformers_blend,
                                dataloader_type=mindformers_loader, num_samples=mindformers_num_samples)
        with console.status("deriving the sample order of both sides"):
            report = compare_sample_order(megatron, mindformers, prefix, training.global_batch_size, batches)
    _print_report(report)
    raise typer.Exit(0 if report.identical else 1)


def _resolve_prefix(data: Path | None, vocab_size: int) -> Path:
    """An indexed-dataset prefix from a folder, a prefix, or (none given) a dataset prepared in the user cache."""
    from crossalign.data.prepare import PREFIX_NAME, prepare_dataset

    if data is None:
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "crossalign" / f"data-vocab{vocab_size}"
        return prepare_dataset(cache, vocab_size).prefix
    if data.is_dir():
        return data / PREFIX_NAME
    return data


def _override(settings, **values):
    for name, value in values.items():
        if value is not None:
            settings = settings.with_setting(name, value)
    return settings


def _print_report(report) -> None:
    from rich.table import Table

    settings = Table("setting", "megatron", "mindformers", title="sample-order settings")
    differing = {d.name: d for d in report.differences}
    for name in ("seed", "split", "seq_length", "num_samples", "blend", "dataloader_type",
                 "micro_batch_size", "data_parallel_size"):
        mark = "[bold red]" if name in differing else ""
        settings.add_row(f"{mark}{name}", str(getattr(report.megatron, name)), str(getattr(report.mindformers, name)))
    for fact in ("dataset", "gpt_num_samples", "epochs", "samples"):
        settings.add_row(f"[dim]{fact}", str(getattr(report.megatron_facts, fact)),
                         str(getattr(report.mindformers_facts, fact)))
    console.print(settings)

    digests = Table("step", "megatron sha256", "mindformers sha256", "same", title="global batch digests")
    for step, (a, b) in enumerate(zip(report.megatron_digests, report.mindformers_digests), start=1):
        digests.add_row(str(step), a[:16], b[:16], "[green]yes" if a == b else "[bold red]no")
    console.print(digests)

    for d in report.differences:
        effect = "changes the order" if d.changes_order else "no effect on these batches"
        console.print(f"[bold]{d.name}[/]: megatron {d.megatron} vs mindformers {d.mindformers} ({effect}): "
                      f"{d.effect}", highlight=False)
    colour = "green" if report.identical else "bold red"
    console.print(f"[{colour}]{report.summary()}[/]", highlight=False)
