"""``crossalign patch check|apply``, ``crossalign preflight config`` and ``crossalign preflight gpu``.

What a command runs is imported inside it, so that ``crossalign --help`` starts without torch, MindSpore or Prefect.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from crossalign.cli.common import console, err_console, user_errors
from crossalign.cli.data import preflight_app

patch_app = typer.Typer(name="patch", help="Check or apply the framework patches (patches/).", no_args_is_help=True)

STATUS_STYLE = {"applied": "green", "applicable": "yellow", "not-needed": "dim", "conflict": "bold red"}


def register(app: typer.Typer) -> None:
    """Add this area's commands to app (``preflight config`` joins the data area's preflight sub-app)."""
    app.add_typer(patch_app, name="patch")


QWEN35_CLASS_HELP = ("The MindFormers fork's Qwen3.5 pynative training class (repeat for its MoE class); "
                     "default: mindformers.qwen35_class / qwen35_moe_class of the site config.")


def _qwen35_classes(given: list[str]) -> tuple[str, ...]:
    """The classes the MindFormers loss-logging patch targets: given on the command line, else the site's."""
    if given:
        return tuple(given)
    from crossalign.site import load_site

    return load_site().mindformers.qwen35_classes


def _trees(megatron: Optional[Path], mindformers: Optional[Path]) -> list[tuple[str, Path]]:
    trees = [(name, path) for name, path in (("megatron", megatron), ("mindformers", mindformers)) if path]
    if not trees:
        from crossalign.site import load_site

        site = load_site()
        trees = [(name, Path(fw.path)) for name, fw in (("megatron", site.megatron), ("mindformers", site.mindformers))
                 if fw.path is not None]
    if not trees:
        err_console.print("[bold red]error:[/] give --megatron PATH and/or --mindformers PATH "
                          "(or set megatron.path / mindformers.path in the site config)")
        raise typer.Exit(2)
    return trees


def _print_reports(reports) -> None:
    from rich.table import Table

    table = Table("patch", "tree", "version", "status", "detail", title="framework patches")
    for report in reports:
        style = STATUS_STYLE[report.status]
        optional = " (optional)" if report.patch.optional else ""
        table.add_row(report.patch.name + optional, str(report.root), report.version_text,
                      f"[{style}]{report.status}[/]", report.detail)
    console.print(table)


@patch_app.command("check")
def check(
    megatron: Optional[Path] = typer.Option(None, "--megatron", help="A Megatron-LM checkout."),
    mindformers: Optional[Path] = typer.Option(None, "--mindformers", help="A MindFormers checkout."),
    qwen35_class: list[str] = typer.Option([], "--qwen35-class", help=QWEN35_CLASS_HELP),
) -> None:
    """Report each patch as applied, applicable, not-needed or conflict; exit 1 on a conflict."""
    from crossalign.patching import PatchError, check_patch, load_patches

    with user_errors(PatchError):
        classes = _qwen35_classes(qwen35_class)
        reports = [check_patch(p, root, classes) for framework, root in _trees(megatron, mindformers)
                   for p in load_patches(framework)]  # type: ignore[arg-type]
    _print_reports(reports)
    if any(r.status == "conflict" for r in reports):
        raise typer.Exit(1)


@patch_app.command("apply")
def apply(
    megatron: Optional[Path] = typer.Option(None, "--megatron", help="A Megatron-LM checkout."),
    mindformers: Optional[Path] = typer.Option(None, "--mindformers", help="A MindFormers checkout."),
    patch: list[str] = typer.Option([], "--patch", help="Apply only these patches (also the only way to apply "
                                    "an optional one, e.g. megatron-weights-only)."),
    qwen35_class: list[str] = typer.Option([], "--qwen35-class", help=QWEN35_CLASS_HELP),
) -> None:
    """Apply the needed patches; already applied is a no-op, a conflict is an error naming the file and edit."""
    from crossalign.patching import PatchError, apply_patch, load_patches

    with user_errors(PatchError):
        reports = []
        chosen = set(patch)
        for framework, root in _trees(megatron, mindformers):
            for p in load_patches(framework):  # type: ignore[arg-type]
                if (chosen and p.name not in chosen) or (not chosen and p.optional):
                    continue
                reports.append(apply_patch(p, root, _qwen35_classes(qwen35_class)))
        unknown = chosen - {r.patch.name for r in reports}
        if unknown:
            raise PatchError(f"no such patch for the given trees: {', '.join(sorted(unknown))}")
    _print_reports(reports)


@preflight_app.command("config")
def config(
    model: str = typer.Option(..., "--model", help="Model config name or YAML path."),
    megatron_args: Optional[Path] = typer.Option(None, "--megatron-args", help="Your own Megatron arguments "
                                                 "(one per line, or the pretrain_gpt.py command line) instead "
                                                 "of the generated ones."),
    mindformers_yaml: Optional[Path] = typer.Option(None, "--mindformers-yaml", help="Your own MindFormers "
                                                    "pynative YAML instead of the generated one."),
    overrides: list[str] = typer.Option([], "--set", help="override a config value: parallel.megatron.tensor=2"),
) -> None:
    """Read back every number-changing setting from both launch configurations; exit 1 naming each mismatch."""
    from rich.table import Table

    from crossalign.sides.launch import BackendSetupError
    from crossalign.preflight.config import preflight_config
    from crossalign.config import ConfigError, load_config
    from crossalign.sides.readings import PreflightInputError
    from crossalign.sides.megatron.args_reader import load_megatron_args_file
    from crossalign.sides.mindformers.yaml_reader import load_mindformers_yaml_file

    with user_errors(ConfigError, PreflightInputError, BackendSetupError):
        cfg = load_config(model, overrides)
        report = preflight_config(
            cfg,
            megatron_args=load_megatron_args_file(megatron_args) if megatron_args else None,
            mindformers_yaml=load_mindformers_yaml_file(mindformers_yaml) if mindformers_yaml else None,
        )
    table = Table("setting", "Megatron", "MindFormers", "", "note",
                  title=f"preflight config: {cfg.model.name}")
    for row in report.rows:
        mark = "[green]ok[/]" if row.ok else "[bold red]MISMATCH[/]"
        style = None if row.ok else "red"
        table.add_row(row.name, row.megatron, row.mindformers, mark, row.note, style=style)
    console.print(table)
    if not report.ok:
        err_console.print(f"[bold red]{len(report.mismatches)} mismatch(es):[/] {', '.join(report.mismatches)}",
                          soft_wrap=True)
        raise typer.Exit(1)
    console.print("[green]both sides will train with the same settings[/]")


STATUS_MARK = {"ok": "[green]ok[/]", "warning": "[yellow]warning[/]", "undecided": "[cyan]undecided[/]",
               "refused": "[bold red]REFUSED[/]"}


@preflight_app.command("gpu")
def gpu(
    model: str = typer.Option(..., "--model", help="Model config name or YAML path (its training.deterministic "
                              "decides which GatedDeltaNet kernels run)."),
    side: str = typer.Option("embedded", "--side", help="embedded: megatron-core's local modules (no "
                             "TransformerEngine); real: Megatron-LM with TransformerEngine."),
    python: Optional[str] = typer.Option(None, "--python", help="The interpreter that will train (default: the "
                                         "site's megatron.python for --side real, else this one)."),
    overrides: list[str] = typer.Option([], "--set", help="override a config value: training.deterministic=false"),
) -> None:
    """Hold this machine's torch, CUDA, Triton, fla, TransformerEngine, megatron-core, causal-conv1d and GPU
    against the known-bad combinations; exit 1 naming each refused one with its fix."""
    from rich.markup import escape

    from crossalign.config import ConfigError, load_config
    from crossalign.preflight.gpu_env import GpuEnvironmentError, check, read_environment
    from crossalign.site import SiteError, load_site

    if side not in ("embedded", "real"):
        err_console.print(f"[bold red]error:[/] --side {side!r} is not one of embedded, real", soft_wrap=True)
        raise typer.Exit(2)
    with user_errors(ConfigError, GpuEnvironmentError, SiteError):
        cfg = load_config(model, overrides)
        interpreter = python or (load_site().megatron.python if side == "real" else None)
        with console.status(f"importing torch, Triton, fla, megatron-core and TransformerEngine in "
                            f"{interpreter or 'this Python'}"):
            env = read_environment(deterministic=cfg.training.deterministic, side=side,  # type: ignore[arg-type]
                                   python=interpreter)
    findings = check(env)
    console.print(f"[bold]preflight gpu ({side} side):[/] {escape(env.describe())}", highlight=False)
    for finding in findings:  # one paragraph each: the sources and fixes are sentences, too long for a table
        console.print(f"{STATUS_MARK[finding.status]}  [bold]{escape(finding.name)}[/]: {escape(finding.detail)}",
                      highlight=False)
        if finding.status in ("refused", "warning"):
            console.print(f"    fix: {escape(finding.fix)}", highlight=False)
        console.print(f"    [dim]source: {escape(finding.source)}[/]", highlight=False)
    refused = [f.name for f in findings if f.status == "refused"]
    if refused:
        err_console.print(f"[bold red]{len(refused)} refused:[/] {'; '.join(refused)}", soft_wrap=True)
        raise typer.Exit(1)
    console.print("[green]no known-bad combination[/]" + (
        f" ({sum(f.status == 'undecided' for f in findings)} undecided on this machine)"
        if any(f.status == "undecided" for f in findings) else ""))
