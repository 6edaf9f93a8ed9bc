"""The command line that (re)does one step of a run: recorded in manifests and run by launchers."""

from __future__ import annotations

import shlex
import sys

from crossalign.store import Run


def step_argv(store: str, run_id: str, step: str, *, embedded: bool = False) -> list[str]:
    argv = [sys.executable, "-m", "crossalign.tasks", "--store", store, "--run", run_id, "--step", step]
    if embedded:
        argv.append("--embedded")
    return argv


def step_command(run: Run, step: str) -> str:
    return shlex.join(step_argv(str(run.store.root), run.run_id, step))
