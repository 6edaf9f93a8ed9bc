"""The command line that (re)does one step of a run: recorded in manifests and run by launchers."""

from __future__ import annotations

import shlex
import sys

from crossalign.store import Run


def step_argv(store: str, run_id: str, step: str, *, python: str | None = None, embedded: bool = False,
              site_file: str | None = None) -> list[str]:
    argv = [python or sys.executable, "-m", "crossalign.tasks", "--store", store, "--run", run_id, "--step", step]
    if embedded:
        argv.append("--embedded")
    if site_file:
        argv += ["--site", site_file]
    return argv


def step_command(run: Run, step: str) -> str:
    return shlex.join(step_argv(str(run.store.root), run.run_id, step))
