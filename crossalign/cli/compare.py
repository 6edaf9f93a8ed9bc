"""``crossalign compare``: judge an NPU log against a GPU log and write the report.

What a command runs is imported inside it, so that ``crossalign --help`` starts without torch, MindSpore or Prefect.
"""

from __future__ import annotations

from pathlib import Path

import typer

EXIT_CODES = {"pass": 0, "fail": 1, "invalid": 2}
TABLE_LEAVES_OUT = ("status", "median_rel_err", "gold")  # in report.html; the reasons say what a status means
SHORT_HEADERS = {"steps_compared": "steps", "step1_rel_err": "step 1", "mean_rel_err": "mean", "median_rel_err": "median",
                 "max_rel_err": "max", "comove": "co-move", "first_bad_step": "first bad", "passed": "pass"}


def _parse_steps(text: str) -> tuple[int, ...]:
    """``"2,5-7"`` -> ``(2, 5, 6, 7)``."""
    steps: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise typer.BadParameter(f"{part!r} is not a step or a range like 5-7", param_hint="--exclude-steps") from None
        steps.extend(range(first, last + 1))
    return tuple(steps)


def compare(
    npu_log: Path = typer.Option(..., "--npu-log", help="MindFormers log of the NPU run (pynative or graph mode)."),
    gpu_log: Path = typer.Option(..., "--gpu-log", help="Megatron log of the GPU run (the reference)."),
    out: Path = typer.Option(..., "--out", help="Folder for summary.json, steps.csv, loss.png, report.html, report.md."),
    model: str = typer.Option(
        None, "--model", help="Model config (name or YAML path) of the runs: gives the core version, train_iters as "
        "the expected steps, whether MTP and the MoE aux loss must be present, and the graph-mode MTP factor."),
    megatron_core_version: str = typer.Option(
        None, help="Core version that wrote the Megatron log (0.16-0.19 print a mean on the 2nd line after a start "
        "with --log-interval 1). Unknown: both readings are tested against the NPU log and the report says which fits."),
    log_interval: int = typer.Option(None, min=1, help="Megatron's --log-interval (default: inferred from the log)."),
    expect_steps: int = typer.Option(
        None, min=1, help="Steps the runs were to train (train_iters): fewer compared is 'invalid: incomplete'. "
        "Default: --model's train_iters, else the whole range of the longer log."),
    exclude_steps: str = typer.Option("", help="Steps left out of mean/median/max/pearson, e.g. '2' or '1-3,10'."),
    step_threshold: float = typer.Option(0.01, help="Relative error above which a step counts as bad (fraction)."),
    mtp_loss_scaling_factor: float = typer.Option(
        None, help="Only for graph-mode logs: their mtp_loss is already multiplied by this factor."),
    plot: bool = typer.Option(True, "--plot/--no-plot", help="Render loss.png (and embed it in report.html)."),
    allow_any_format: bool = typer.Option(
        False, "--allow-any-format", help="Accept a log of either framework on either side (a Megatron log from "
        "MindSpeed on Ascend, two Megatron runs). Without it the NPU log must be MindFormers' and the GPU log "
        "Megatron's, and a log in the other side's format is refused (sides swapped)."),
    load_verified: bool = typer.Option(
        False, "--load-verified", help="The GPU run's loaded tensors were checked against its checkpoint (a load "
        "digest): Megatron's non-strict load line ('load_return: None', printed by every TE model loading a "
        "checkpoint without _extra_state entries) is then a note, not a reason for 'invalid'."),
) -> None:
    """Compare the losses of the two runs: exit 0 pass, 1 fail, 2 bad input or invalid (incomplete, not comparable)."""
    from rich.table import Table

    from crossalign.cli.common import console, user_errors
    from crossalign.config import ConfigError, load_config
    from crossalign.sides.log_common import LogFormatError
    from crossalign.report.compare import CompareOptions, compare_logs, options_from_config
    from crossalign.report.render import ReportWriteError, check_out_dir, metric_rows
    from crossalign.report.sides import SideFormatError

    given = {"megatron_core_version": megatron_core_version, "log_interval": log_interval,
             "expect_steps": expect_steps, "exclude_steps": _parse_steps(exclude_steps),
             "step_threshold": step_threshold, "mtp_loss_scaling_factor": mtp_loss_scaling_factor, "plot": plot,
             "allow_any_format": allow_any_format,
             "load_verified": "checked by the user (--load-verified)" if load_verified else None}
    with user_errors(LogFormatError, ConfigError, SideFormatError, ReportWriteError):
        check_out_dir(out)
        options = options_from_config(load_config(model), **given) if model else CompareOptions(
            **{k: v for k, v in given.items() if v is not None})
        with console.status("parsing and comparing the logs"):
            summary = compare_logs(npu_log, gpu_log, out, options)

    rows = metric_rows(summary)
    table = Table(title="loss agreement (relative error = |npu - gpu| / |gpu|)")
    shown = [key for key in rows[0] if key not in TABLE_LEAVES_OUT]
    for key in shown:
        table.add_column(SHORT_HEADERS.get(key, key), no_wrap=True)
    for row in rows:
        table.add_row(*(row[key] for key in shown))
    console.print(table)
    color = {"pass": "green", "fail": "red", "invalid": "yellow"}[summary.verdict]
    console.print(f"[bold {color}]verdict: {summary.verdict.upper()}[/]"
                  + ("  (gold standard: step 1 < 0.005%)" if summary.gold_standard else "")
                  + f"  ({summary.coverage['compared']} of {summary.coverage['expected']} expected steps compared)")
    for reason in summary.reasons:
        console.print(f"  - {reason}", highlight=False)
    for finding in summary.diagnosis:
        console.print(f"[bold]diagnosis[/] ({finding['pattern']}): {finding['message']}", highlight=False)
    console.print(f"report: {Path(out) / 'report.html'}", highlight=False)
    raise typer.Exit(EXIT_CODES[summary.verdict])


def register(app: typer.Typer) -> None:
    """Add this area's commands to app."""
    app.command("compare")(compare)
