"""``crossalign runs`` and ``crossalign status``: the runs in the store, and one run's steps.

Both read the run store only (no Prefect); the run store and its pydantic config are imported inside
the commands, so that ``crossalign --help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from crossalign.cli.common import console, user_errors
from crossalign.report.units import duration_text, size_text

STATE_STYLES = {"done": "green", "skipped": "green", "stale": "yellow", "running": "cyan", "started": "cyan",
                "interrupted": "red", "failed": "red", "pending": "dim"}


def register(app: typer.Typer) -> None:
    """Add this area's commands to app."""
    app.command("runs")(runs)
    app.command("status")(status)


def styled(state: str) -> str:
    style = STATE_STYLES.get(state)
    return f"[{style}]{state}[/]" if style else state


def store_root(store: Optional[Path]) -> Path:
    """``--store``, else the site config's store."""
    from crossalign.site import load_site  # imported when run: keeps crossalign --help fast

    return Path(store) if store is not None else load_site().store


def run_location(run: str, store: Optional[Path]) -> tuple[Path, str]:
    """(store, run id) of the run a command names by its id, in ``--store`` (else the site's store), or by its folder
    (a path: ``runs/ID``), whose parent is its store."""
    from crossalign.store import StoreError  # imported when run: keeps crossalign --help fast

    if "/" not in run:
        return store_root(store), run
    folder = Path(run).expanduser().resolve()
    if store is not None and Path(store).expanduser().resolve() != folder.parent:
        raise StoreError(f"{run} is a run of the store {folder.parent}, not of --store {store}")
    return folder.parent, folder.name


def located_run(run: str, store: Optional[Path]):
    """The run (``crossalign.store.Run``) a command names by its id or its folder (:func:`run_location`); raises
    StoreError naming the store when there is none."""
    from crossalign.store import RunStore  # imported when run: keeps crossalign --help fast

    root, run_id = run_location(run, store)
    return RunStore(root).run(run_id)


def status_table(run) -> Table:
    """Each step of ``run``: its pool in this run, state, host, duration and outputs (or why it failed)."""
    table = Table(title=f"run {run.run_id}  ({run.path})", title_justify="left")
    for column in ("#", "step", "pool", "state", "host", "duration", "outputs"):
        table.add_column(column)
    for state in run.states():
        outputs = (state.manifest or {}).get("outputs", [])
        shown = f"{len(outputs)} file{'' if len(outputs) == 1 else 's'}, {size_text(sum(o['size'] for o in outputs))}" \
            if outputs else ""
        if state.status == "failed":
            shown = (state.attempt or {}).get("error", "")[:80]
        table.add_row(str(state.spec.index), state.spec.name, run.pool(state.spec.name), styled(state.status),
                      state.host, duration_text(state.seconds), shown)
    return table


def stored_verdict(run) -> tuple[str | None, str | None]:
    """The verdict a finished run's compare step committed and where its report is (on the report server, else the
    file); a run fail-fast stopped before step 6 failed, with the report of what both sides logged."""
    from crossalign.report.serve import store_url  # imported when run: keeps crossalign --help fast
    from crossalign.site import load_site
    from crossalign.stop import stopped_report

    report_url = load_site().report_url
    if not run.is_done("compare"):
        stopped = stopped_report(run)
        if stopped is None:
            return None, None
        return "fail", store_url(report_url, run.store.root, stopped) or str(stopped)
    folder = run.step_dir("compare")
    details = run.manifest("compare")["details"]
    reports = sorted(folder.rglob("report.html")) or sorted(folder.rglob("report.md")) \
        or [folder / details.get("summary", "summary.json")]
    return details.get("verdict"), store_url(report_url, run.store.root, reports[0]) or str(reports[0])


RUNS_COLUMNS = ("run", "model", "created", "steps done", "state", "verdict")


def runs(store: Optional[Path] = typer.Option(None, "--store", help="the run store")) -> None:
    """List the runs in the store: a table in a terminal, else one tab-separated line per run under a header line."""
    from crossalign.site import SiteError  # imported when run: keeps crossalign --help fast
    from crossalign.store import RunStore, StoreError

    with user_errors(SiteError, StoreError):
        root = RunStore(store_root(store))
        rows = []
        for run in root.runs():
            states = run.states()
            done = sum(s.status == "done" for s in states)
            worst = next((s.status for s in states if s.status in ("failed", "interrupted", "running")), None)
            verdict, _ = stored_verdict(run)
            rows.append((run.run_id, run.info["config"]["model"]["name"],
                         run.info.get("created", "")[:16].replace("T", " "), f"{done}/{len(states)}",
                         worst or ("done" if done == len(states) else "partial"), verdict or ""))
    if not console.is_terminal:  # for a pipe or a file: lines that cut, grep and awk read
        print("\t".join(RUNS_COLUMNS))
        for row in rows:
            print("\t".join(row))
        return
    if not rows:
        console.print(f"no runs in {root.root}", highlight=False)
        return
    table = Table(title=f"runs in {root.root}", title_justify="left")
    # the id is what users copy into the next command: the other columns wrap, it never does
    table.add_column(RUNS_COLUMNS[0], no_wrap=True, min_width=max(len(row[0]) for row in rows))
    for column in RUNS_COLUMNS[1:]:
        table.add_column(column)
    for row in rows:
        table.add_row(*row[:4], styled(row[4]), row[5])
    console.print(table)


def status(run_id: str = typer.Argument(..., help="the run: its id, or its folder (runs/ID)"),
           store: Optional[Path] = typer.Option(None, "--store", help="the run store")) -> None:
    """Per-step state, host, duration and outputs of one run."""
    from crossalign.site import SiteError  # imported when run: keeps crossalign --help fast
    from crossalign.store import StoreError

    with user_errors(SiteError, StoreError):
        run = located_run(run_id, store)
        console.print(status_table(run))
        verdict, report = stored_verdict(run)
    if verdict is not None:
        console.print(f"verdict: {verdict}    report: {report}", highlight=False)
