"""Launching a real framework: a run script kept with the outputs, line streaming, and log verdicts.

Both real backends (Megatron on GPU, MindFormers on NPU) work the same way: they write
``run_<framework>.sh`` into the step folder (environment, working directory, the exact
command: what ran, kept with the outputs), run it with output captured line by line into the
step's log, and then judge the log, because neither framework's exit status can be trusted
alone (Megatron exits 0 after a checkpoint it could not unpickle).

A runner is any callable ``runner(script, log_path, on_line) -> exit status``. The default,
:func:`run_script_locally`, runs ``bash script`` here; an SSH runner (the agents layer) can run
the same script on another host that mounts the same storage.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence
from crossalign.site import load_site

LineCallback = Callable[[str], None]
Runner = Callable[[Path, Path, LineCallback], int]


class BackendRunError(RuntimeError):
    """A real training run that did not do what was asked; the message names the log and the line."""


class BackendSetupError(ValueError):
    """A real backend that cannot be launched as configured (missing checkout, wrong version, ...)."""


@dataclass(frozen=True)
class RunScript:
    """What a run script holds: environment, working directory and one command."""

    command: Sequence[str]
    cwd: Path
    env: Mapping[str, str]
    title: str
    required_files: Sequence[str] = ()  # relative to cwd; the script stops with a clear message if one is missing
    checks: Sequence[Sequence[str]] = ()  # commands run in cwd before the command; one that fails stops the script
    staged_in: Path | None = None  # the step's staging folder the paths below name
    published_as: Path | None = None  # ... and the folder it becomes when the step commits
    path_prepend: Sequence[str] = ()  # folders put first on PATH (the framework's own python3, for its builds)

    def render(self) -> str:
        lines = ["#!/usr/bin/env bash", f"# {self.title}"]
        if self.staged_in is not None and self.published_as is not None and self.staged_in != self.published_as:
            run, step, store = self.published_as.parent.name, self.published_as.name, self.published_as.parent.parent
            lines += [f"# Written by crossalign for the staging folder {self.staged_in},",
                      f"# which became {self.published_as} when the step committed. To train again, redo the step:",
                      f"#   crossalign rerun {shlex.quote(run)} --step {shlex.quote(step)} --store {shlex.quote(str(store))}"]
        else:
            lines.append("# Written by crossalign; run it again by hand with: bash " + shlex.quote("<this file>"))
        lines.append("set -euo pipefail")
        lines += [f"export {key}={shlex.quote(str(value))}" for key, value in sorted(self.env.items())]
        if self.path_prepend:
            lines.append(f'export PATH={shlex.quote(":".join(map(str, self.path_prepend)))}:"$PATH"')
        lines.append(f"cd {shlex.quote(str(self.cwd))}")
        for name in self.required_files:
            where = re.sub(r'([\\"$`])', r"\\\1", f"{self.cwd}/{name}")
            lines.append(f'[ -e {shlex.quote(name)} ] || {{ echo "{where} not found on $(hostname)" >&2; exit 2; }}')
        for check in self.checks:
            lines.append(" ".join(map(shlex.quote, check)) + " || exit 2")
        lines.append("exec " + " \\\n    ".join(self._command_lines()))
        return "\n".join(lines) + "\n"

    def _command_lines(self) -> list[str]:
        """The command quoted, one ``--flag values...`` group per line."""
        groups: list[list[str]] = []
        for part in map(str, self.command):
            if not groups or part.startswith("--") or part.endswith(".py"):
                groups.append([])
            groups[-1].append(shlex.quote(part))
        return [" ".join(group) for group in groups]


def write_run_script(path: Path, script: RunScript) -> Path:
    """Write the script atomically (temporary sibling, then rename) and make it executable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(script.render())
    tmp.chmod(0o755)
    os.replace(tmp, path)
    return path


def run_script_locally(script: Path, log_path: Path, on_line: LineCallback) -> int:
    """Run ``bash script`` here, stdout and stderr merged, each line appended to the log as it comes."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w", encoding="utf-8") as log, subprocess.Popen(
        ["bash", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        encoding="utf-8",
        errors="replace",
        bufsize=1,
    ) as process:
        assert process.stdout is not None
        for line in process.stdout:
            log.write(line)
            log.flush()
            on_line(line.rstrip("\n"))
        return process.wait()


def first_line_with(log_path: Path, needles: Sequence[str]) -> tuple[int, str] | None:
    """The first (1-based line number, line) of the log that contains any of the needles."""
    with open(log_path, encoding="utf-8", errors="replace") as log:
        for number, line in enumerate(log, start=1):
            if any(needle in line for needle in needles):
                return number, line.rstrip("\n")
    return None


def failure_summary(log_path: Path, tail: int = 15) -> str:
    """The last lines of a failed run's log, for an error message."""
    if not log_path.exists():
        return f"{log_path}: no log was written"
    lines = log_path.read_text(encoding="utf-8", errors="replace").splitlines()
    return "\n".join(lines[-tail:])


def missing_steps(seen: set[int], expected: int) -> list[int]:
    """Steps 1..expected that no log line reported."""
    return [step for step in range(1, expected + 1) if step not in seen]



class FrameworkBackend:
    """What the real backends share: the site config (read on first use) and the runner of their run scripts.

    The runner runs a written run script and streams its output; the default runs it here,
    the Prefect layer passes an SSH runner for frameworks that live on another host.
    """

    def __init__(self, site=None, runner: Runner = run_script_locally):
        self._site = site
        self._runner = runner

    @property
    def site(self):
        if self._site is None:
            self._site = load_site()
        return self._site


def progress_callback(on_step, total: int,
                      parse_line: Callable[[str], tuple[int, int, dict[str, float]] | None]) -> LineCallback:
    """A line callback that reports every parsed step line to ``on_step(step, total, metrics)``."""

    def on_line(line: str) -> None:
        parsed = parse_line(line)
        if parsed and on_step is not None:
            step, _, metrics = parsed
            on_step(step, total, metrics)

    return on_line
