"""``crossalign rehearse RUN``: a run's real launches, rehearsed on this machine's CPU before any GPU or NPU hour."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from crossalign.cli.common import console, err_console
from crossalign.cli.run import rerun_dump_settings
from crossalign.cli.runs import located_run


def register(app: typer.Typer) -> None:
    app.command("rehearse")(rehearse)


def _framework(given: Optional[Path], env: str | None, site_path) -> Optional[Path]:
    for candidate in (given, os.environ.get(env) if env else None, site_path):
        if candidate:
            return Path(candidate).expanduser().absolute()
    return None


def rehearse(
    run_id: str = typer.Argument(..., help="the run whose steps to rehearse (its converted checkpoint and dataset): "
                                 "its id, or its folder (runs/ID)"),
    store: Optional[Path] = typer.Option(None, help="the run store (default: the site's store)"),
    megatron: Optional[Path] = typer.Option(None, help="Megatron-LM checkout (default: $MEGATRON_LM_PATH, then "
                                                       "the site's megatron.path)"),
    mindformers: Optional[Path] = typer.Option(None, help="MindFormers checkout (default: the site's "
                                                          "mindformers.path)"),
    mindformers_python: Optional[str] = typer.Option(None, help="MindFormers' interpreter (default: the site's)"),
    checkpoint: Optional[Path] = typer.Option(None, help="rehearse the gpu side from this Megatron checkpoint "
                                                         "instead of the run's converted one"),
    out: Optional[Path] = typer.Option(None, help="where the rehearsal writes (default: ./rehearsal-RUN)"),
    bf16: bool = typer.Option(False, help="keep the generated --bf16 (default: fp32, the embedded run's "
                                          "precision, so the losses can be held against it)"),
    dump: bool = typer.Option(False, "--dump", help="rehearse the dump-enabled launch: msprobe dumps an iteration "
                              "(the site's diagnose.dump, changed by --dump-*) into OUT/gpu/msprobe_dump"),
    dump_step: Optional[int] = typer.Option(None, help="with --dump: the iteration to dump, from 0"),
    dump_level: Optional[str] = typer.Option(None, help="with --dump: L0 (modules) or mix (modules and APIs)"),
    dump_task: Optional[str] = typer.Option(None, help="with --dump: statistics, md5 or tensor"),
) -> None:
    """Run the gpu step's real launch (generated arguments, launcher, Megatron's pretrain()) on CPU, and read the
    npu step's YAML with MindFormers' own loader; report what ran and what was stood in for.

    Exit 0 when every rehearsed side ran and loaded the checkpoint it was given, 1 when one failed,
    2 on bad input.
    """
    import sys

    from crossalign.site import load_site
    from crossalign.store import StoreError

    site = load_site()
    try:
        run = located_run(run_id, store)
        settings = rerun_dump_settings(dump, dump_step, dump_level, dump_task)
        if settings is not None and settings.step >= run.config.training.train_iters:
            raise ValueError(f"--dump-step {settings.step}: the run trains {run.config.training.train_iters} "
                             f"iterations (msprobe counts them from 0)")
    except (StoreError, ValueError) as exc:
        err_console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from None
    megatron_path = _framework(megatron, "MEGATRON_LM_PATH", site.megatron.path)
    mindformers_path = _framework(mindformers, None, site.mindformers.path)
    if megatron_path is None and mindformers_path is None:
        err_console.print("[bold red]error:[/] nothing to rehearse: give --megatron (or $MEGATRON_LM_PATH) and/or "
                          "--mindformers, or set megatron.path / mindformers.path in the site config")
        raise typer.Exit(2)
    folder = (out or Path(f"rehearsal-{run.run_id}")).absolute()
    failed = False
    if megatron_path is not None:
        failed |= not _gpu(run, megatron_path, folder / "gpu", checkpoint, fp32=not bf16, dump=settings)
    else:
        console.print("gpu: not rehearsed (no Megatron-LM checkout given)")
    if mindformers_path is not None:
        failed |= not _npu(run, mindformers_path, mindformers_python or site.mindformers.python or sys.executable,
                           folder / "npu")
    else:
        console.print("npu: not rehearsed (no MindFormers checkout given)")
    raise typer.Exit(1 if failed else 0)


def _gpu(run, checkout: Path, folder: Path, checkpoint: Optional[Path], *, fp32: bool, dump=None) -> bool:
    from crossalign.dump_settings import DumpMissingError
    from crossalign.sides.launch import BackendRunError, BackendSetupError
    from crossalign.tensorio.errors import CheckpointError
    from crossalign.sides.megatron.rehearsal import rehearse_gpu
    from crossalign.sides.megatron.embedded.mcore_cpu import MegatronCpuError

    console.print(f"gpu: rehearsing {run.run_id}'s megatron-train launch with {checkout} in {folder} ...")
    try:
        result = rehearse_gpu(run.config, run.dataset, checkpoint or run.step_dir("convert") / "checkpoint", checkout,
                              folder, fp32=fp32, dump=dump)
    except (BackendRunError, BackendSetupError, CheckpointError, MegatronCpuError, DumpMissingError) as exc:
        err_console.print(f"[bold red]gpu rehearsal failed:[/] {exc}", highlight=False, soft_wrap=True)
        err_console.print(f"  log: {folder / 'train.log'}")
        return False
    console.print(f"gpu: ran Megatron-LM {result.megatron_core} ({checkout}): torchrun, 1 process, "
                  f"patches/megatron/pretrain_qwen35.py -> pretrain_gpt.py -> pretrain(), gloo, on CPU; "
                  f"{len(result.losses)} iterations; load digest verified for {result.digest_tensors} tensors")
    console.print(f"gpu: {result.precision_statement}", highlight=False)
    if result.dump is not None:
        console.print(f"gpu: msprobe dumped iteration {result.dump['step']} ({result.dump['level']}, "
                      f"{result.dump['task']}): {', '.join(result.dump['rank_folders'])} in "
                      f"{folder / result.dump['folder']} ({result.dump['files']} files)", highlight=False)
    if result.core_differences:
        console.print(f"[yellow]gpu: the checkout's megatron/core differs from the installed megatron-core in "
                      f"{len(result.core_differences)} files[/] (e.g. {', '.join(result.core_differences[:5])}): the "
                      "CPU workarounds and the embedded run are the installed one's")
    else:
        console.print("gpu: the checkout's megatron/core is the installed megatron-core (every .py file equal)")
    console.print("gpu: stood in for (generated arguments changed):")
    for change in result.argument_changes:
        console.print(f"  {change.flag} -> {' '.join(change.becomes) or '(dropped)'}: {change.reason}",
                      highlight=False)
    console.print("  --load -> the same checkpoint under megatron-core's local-module names (te_local.py)")
    console.print("gpu: stood in for (at run time, crossalign/sides/megatron/rehearsal_cpu.py):")
    for name, reason in result.workarounds:
        console.print(f"  {name}: {reason}", highlight=False)
    embedded = embedded_losses(run)
    for iteration, losses in sorted(result.losses.items()):
        line = "  ".join(f"{name} {value:.6E}" for name, value in sorted(losses.items()))
        console.print(f"  iteration {iteration}: {line}")
    if embedded is not None:
        console.print("gpu: " + result.embedded_comparison(embedded, run.config.training.embedded_precision),
                      highlight=False)
    return True


def _npu(run, checkout: Path, python: str, folder: Path) -> bool:
    from crossalign.sides.launch import BackendSetupError
    from crossalign.sides.mindformers.rehearsal import NpuRehearsalError, rehearse_npu

    try:
        result = rehearse_npu(run.config, run.dataset, run.step_dir("cast-bf16") / "checkpoint", checkout, python,
                              folder)
    except (NpuRehearsalError, BackendSetupError) as exc:
        err_console.print(f"[bold red]npu rehearsal failed:[/] {exc}", highlight=False, soft_wrap=True)
        return False
    console.print(f"npu: {result.yaml} {result.loader} ({checkout}); the model build, load and training need "
                  "the NPU and were not rehearsed")
    return True


def embedded_losses(run) -> dict[int, dict[str, float]] | None:
    """The losses of the run's own megatron-train step where the embedded megatron-core trained it, else None."""
    from crossalign.sides.megatron.rehearsal import logged_losses

    manifest = run.manifest("megatron-train") or {}
    details = manifest.get("details", manifest)
    if details.get("backend") != "local-megatron":
        return None
    log = run.step_dir("megatron-train") / "train.log"
    return logged_losses(log) if log.exists() else None
