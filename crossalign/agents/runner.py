"""Run a command as a local process and stream its output line by line.

Every line goes to a log file (the full record, however long the training) and to a callback
(which forwards it to the Prefect run logger or turns progress lines into progress updates).
Nothing is kept in memory beyond the current line, so a days-long training log costs nothing.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Callable, Sequence

LineCallback = Callable[[str], None]


def run_streaming(argv: Sequence[str], *, on_line: LineCallback, log_path: Path | None = None) -> int:
    """Run ``argv`` with stderr merged into stdout; returns the exit code (negative: killed by that signal).

    If the caller is interrupted, the child is killed rather than left running unobserved.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = None
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "a", buffering=1)
    try:
        with subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              bufsize=1, env=env, errors="replace") as proc:
            try:
                assert proc.stdout is not None
                for raw in proc.stdout:
                    line = raw.rstrip("\n")
                    if log is not None:
                        log.write(line + "\n")
                    on_line(line)
                return proc.wait()
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    finally:
        if log is not None:
            log.close()
