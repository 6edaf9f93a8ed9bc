"""``crossalign run`` and ``crossalign rerun``: the alignment flow, watched step by step, ending with its verdict.

Both build the run request (``crossalign.request``) from their options and resolve it here, so that
bad input is refused before Prefect starts; the flow, called in this process, takes that resolution
instead of parsing the config again, and its final state carries what is printed: the run id, the
verdict and the report. Exit 0 pass, 1 fail, 2 invalid or bad input.

The run request, the run store (pydantic) and Prefect are imported inside the commands, so that
``crossalign --help`` stays fast.
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table

from crossalign.cli.common import console, err_console, user_errors
from crossalign.cli.live import alignment_line, alignment_table
from crossalign.cli.prefect_env import EXIT_INVALID, quiet_prefect, server_url
from crossalign.cli.runs import located_run, run_location, status_table, styled
from crossalign.flows.events import StepEvent, listening
from crossalign.report.units import duration_text

EXIT_PASS, EXIT_FAIL = 0, 1
EXIT_OF_VERDICT = {"pass": EXIT_PASS, "fail": EXIT_FAIL}  # any other verdict (invalid) exits EXIT_INVALID


def register(app: typer.Typer) -> None:
    """Add this area's commands to app."""
    app.command("run")(run)
    app.command("rerun")(rerun)


def _metrics_text(metrics: dict[str, Any]) -> str:
    shown = [(k, v) for k, v in metrics.items() if k in ("lm_loss", "mtp_1_loss", "aux_loss", "loss", "grad_norm")]
    return "  ".join(f"{k} {v:.4f}" for k, v in shown if isinstance(v, (int, float)))


class RunDisplay:
    """Per-step state, host, duration and training progress; every iteration's metrics as a line."""

    def __init__(self, run_id: str, steps):
        self.run_id = run_id
        self.rows = {s.name: {"spec": s, "state": "pending", "host": "", "seconds": None, "done": 0, "total": 0,
                              "metrics": {}, "started": None} for s in steps}
        self.alignment: StepEvent | None = None  # the latest live comparison of steps 4 and 5
        self.live: Live | None = None

    def handle(self, event: StepEvent) -> None:
        if event.kind == "alignment":
            self.alignment = event
            self._say(alignment_line(event))
        row = self.rows.get(event.step)
        if row is None:
            return
        if event.kind == "started":
            row.update(state="running", started=time.monotonic(), done=0, total=0)
            self._say(f"[cyan]{event.step}[/] started")
        elif event.kind == "skipped":
            row.update(state="skipped", host=event.host, seconds=event.seconds)
            self._say(f"[green]{event.step}[/] already done, skipped")
        elif event.kind == "progress":
            row.update(done=event.done, total=event.total, metrics=event.metrics)
            self._say(f"  {event.step} {event.done:>4}/{event.total}  {_metrics_text(event.metrics)}")
        elif event.kind == "done":
            row.update(state="done", host=event.host, seconds=event.seconds)
            self._say(f"[green]{event.step}[/] done in {duration_text(event.seconds)} on {event.host}")
        elif event.kind == "failed":
            row.update(state="failed")
            self._say(f"[red]{event.step} failed:[/] {event.message}")
        if self.live is not None:
            self.live.update(self.render())

    def _say(self, text: str) -> None:
        console.print(text, highlight=False)

    def render(self):
        table = Table(title=f"run {self.run_id}", title_justify="left")
        for column in ("#", "step", "pool", "state", "host", "time", "progress"):
            table.add_column(column)
        for row in self.rows.values():
            spec, state = row["spec"], row["state"]
            seconds = row["seconds"]
            if state == "running" and row["started"] is not None:
                seconds = time.monotonic() - row["started"]
            progress = ProgressBar(total=row["total"], completed=row["done"], width=24) if row["total"] else ""
            table.add_row(str(spec.index), spec.name, spec.pool, styled(state), row["host"], duration_text(seconds),
                          progress)
        return table if self.alignment is None else Group(table, alignment_table(self.alignment))

    def __enter__(self) -> "RunDisplay":
        if console.is_terminal:
            self.live = Live(self.render(), console=console, refresh_per_second=4, get_renderable=self.render,
                             transient=True)
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)
            self.live = None


def finish(state, resolved) -> int:
    """Print the outcome the flow's final state carries and choose the exit code: 0 pass, 1 fail, 2 invalid or bad
    input. The verdict, report and run id are the flow's own; the store shows the steps."""
    # Prefect is loaded by now (the flow ran); the rest is imported with it
    from crossalign.config import ConfigError
    from crossalign.dag import UnknownStep
    from crossalign.flows.outcome import outcome_of
    from crossalign.store import StoreError
    from crossalign.tasks.errors import PreflightFailed

    outcome, error = outcome_of(state)
    run_id = (outcome or {}).get("run_id") or resolved.run_id
    if isinstance(error, (ConfigError, StoreError, UnknownStep, PreflightFailed)):
        err_console.print(f"[bold red]run {run_id}: invalid input:[/] {error}", highlight=False, soft_wrap=True)
        return EXIT_INVALID
    store = resolved.store
    run = store.run(run_id) if store.exists(run_id) else None
    if run is not None:
        console.print(status_table(run))
    verdict = (outcome or {}).get("verdict")
    if verdict is not None:
        style = "green" if verdict == "pass" else "red"
        console.print(f"verdict: [bold {style}]{verdict}[/]    report: {outcome.get('report')}", highlight=False)
        if outcome.get("stopped_early"):  # fail-fast ended the run: say why and what it saved
            console.print(state.message or "", highlight=False, soft_wrap=True)
        return EXIT_OF_VERDICT.get(verdict, EXIT_INVALID)
    message = f"{type(error).__name__}: {error}" if error is not None else (state.message or state.name)
    err_console.print(f"[bold red]run {run_id} failed:[/] {message}", highlight=False, soft_wrap=True)
    if run is not None:
        parameters = run.info["parameters"]
        command = ["crossalign", "run", parameters["config"], "--run-id", run_id, "--store", str(store.root)]
        for override in parameters.get("overrides", []):
            command += ["--set", override]
        if parameters.get("mode") == "distributed":
            command.append("--distributed")
        err_console.print(f"resume with: {shlex.join(command)}", highlight=False, soft_wrap=True)
    return EXIT_FAIL


def run_flow(resolved, verbose: bool, rerun_form: dict[str, Any] | None = None) -> int:
    """Run the alignment flow of a resolved request in this process, or with ``rerun_form`` the rerun flow (named
    RUN-rerun-STEP, as from its form in the UI), showing its steps; returns the exit code."""
    request = resolved.request
    server_url(required=request.mode == "distributed")
    quiet_prefect(verbose)
    from crossalign.dag import STEPS, step_for  # imported when run, with Prefect: keeps crossalign --help fast
    from crossalign.flows.alignment import alignment, rerun
    from crossalign.request import handing_over

    store, run_id = resolved.store, resolved.run_id
    start = resolved.start or (store.run(run_id).start if store.exists(run_id) else {})
    console.print(f"run [bold]{run_id}[/] ({request.mode}) in {store.root}", highlight=False)
    steps = [step_for(spec.name, start) for spec in STEPS]  # as this run carries them out (pools)
    with RunDisplay(run_id, steps) as display, listening(display.handle), handing_over(resolved):
        if rerun_form is None:
            state = alignment(**request.form(), return_state=True)
        else:
            state = rerun(**rerun_form, return_state=True)
    return finish(state, resolved)


def run(
    config: str = typer.Argument(..., help="a shipped config name (qwen35_dense_tiny) or a YAML file"),
    store: Optional[Path] = typer.Option(None, "--store", help="the run store (default: the site's store, ./runs)"),
    run_id: Optional[str] = typer.Option(None, "--run-id", help="resume this run, by its id or its folder (runs/ID); "
                                         "finished steps are skipped"),
    overrides: list[str] = typer.Option([], "--set", help="override a config value: training.train_iters=10"),
    distributed: bool = typer.Option(False, "--distributed",
                                     help="dispatch the steps to the npu/cpu/gpu pools' workers"),
    retries: int = typer.Option(2, help="attempts after an infrastructure failure (never after a bad input)"),
    retry_delay: float = typer.Option(10.0, help="seconds before the first retry (tripled each time)"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="show Prefect's own log lines"),
    from_hf: Optional[Path] = typer.Option(None, "--from-hf", help="start from this Hugging Face checkpoint: "
                                           "step 1 imports it (cpu) instead of base training"),
    fail_fast: bool = typer.Option(True, "--fail-fast/--no-fail-fast", help="stop both trainings as soon as "
                                   "what they logged cannot pass any more (the site's fail_fast: false too)"),
) -> None:
    """Run the six-step alignment; prints the verdict. Exit 0 pass, 1 fail, 2 invalid or bad input."""
    from crossalign.config import ConfigError  # imported when run: keeps crossalign --help fast
    from crossalign.request import RunRequest
    from crossalign.site import SiteError
    from crossalign.store import StoreError

    with user_errors(ConfigError, SiteError, StoreError):
        if run_id is not None and "/" in run_id:  # the run's folder: runs/ID
            store, run_id = run_location(run_id, store)
        resolved = RunRequest(config=config, run_id=run_id, overrides=overrides,
                              store=None if store is None else str(store),
                              mode="distributed" if distributed else "embedded", retries=retries,
                              retry_delay_s=retry_delay, from_hf=None if from_hf is None else str(from_hf.absolute()),
                              fail_fast=fail_fast).resolve()
        resolved.check_store()
    raise typer.Exit(run_flow(resolved, verbose))


def rerun(
    run_id: str = typer.Argument(..., help="the run to redo part of: its id, or its folder (runs/ID)"),
    step: str = typer.Option(..., "--step", help="the step to redo; everything downstream is redone too"),
    store: Optional[Path] = typer.Option(None, "--store", help="the run store (default: the site's store)"),
    distributed: Optional[bool] = typer.Option(None, "--distributed/--embedded",
                                               help="dispatch the steps to the pools' workers, or run them "
                                               "here (default: as the run was started)"),
    retries: int = typer.Option(2, help="attempts after an infrastructure failure"),
    retry_delay: float = typer.Option(10.0, help="seconds before the first retry"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="show Prefect's own log lines"),
    dump: bool = typer.Option(False, "--dump", help="the redone alignment trainings (megatron-train, "
                              "pynative-train) take msprobe dumps: the site's diagnose.dump, changed by --dump-*"),
    dump_step: Optional[int] = typer.Option(None, help="with --dump: the iteration to dump, from 0"),
    dump_level: Optional[str] = typer.Option(None, help="with --dump: L0 (modules) or mix (modules and APIs)"),
    dump_task: Optional[str] = typer.Option(None, help="with --dump: statistics, md5 or tensor"),
) -> None:
    """Invalidate STEP and everything downstream of it, then run the flow again (finished upstream steps are skipped).

    With --dump, the alignment trainings it redoes dump their tensors with msprobe (step{N}/rank{R}/ in each
    step's msprobe_dump/) for ``crossalign diagnose``; without it, they take only the site's diagnose.dump.
    """
    from crossalign.config import ConfigError  # imported when run: keeps crossalign --help fast
    from crossalign.dag import UnknownStep, downstream
    from crossalign.request import RunRequest
    from crossalign.site import SiteError
    from crossalign.store import StoreError
    from crossalign.tasks.training import dumping_steps

    with user_errors(ConfigError, SiteError, StoreError, UnknownStep, ValueError):
        affected = downstream(step)
        run = located_run(run_id, store)
        settings = rerun_dump_settings(dump, dump_step, dump_level, dump_task)
        dumped = dumping_steps(affected, settings)
        if distributed is None:
            distributed = run.info["parameters"].get("mode") == "distributed"
        mode = "distributed" if distributed else "embedded"
        resolved = RunRequest(config=None, run_id=run.run_id, store=str(run.store.root), rerun=[affected[0]],
                              mode=mode, retries=retries, retry_delay_s=retry_delay).resolve()
    console.print(f"redoing {', '.join(affected)}", highlight=False)
    if settings is not None:
        console.print(f"{' and '.join(dumped)} will dump iteration {settings.step} with msprobe ({settings.level}, "
                      f"{settings.task}) into msprobe_dump/", highlight=False)
    # the rerun flow, as the UI's rerun form runs it: it records the dump request in run.json
    form = {"run_id": run.run_id, "step": affected[0], "store": str(run.store.root), "mode": mode, "retries": retries,
            "retry_delay_s": retry_delay, "dump": dump, "dump_step": dump_step, "dump_level": dump_level,
            "dump_task": dump_task}
    raise typer.Exit(run_flow(resolved, verbose, rerun_form=form))


def rerun_dump_settings(dump: bool, step: Optional[int], level: Optional[str], task: Optional[str]):
    """The dump ``rerun --dump`` asks for: the site's diagnose.dump (default settings without one), with the
    --dump-* options; None without --dump (a --dump-* option alone is refused)."""
    from crossalign.dump_settings import rerun_dump  # imported when run: keeps crossalign --help fast
    from crossalign.site import load_site

    return rerun_dump(load_site().diagnose.dump, dump, {"step": step, "level": level, "task": task})
