"""The processes of a running alignment as the tests watch them: the step that is writing its log, and the
training processes under it."""

from __future__ import annotations

import json
from pathlib import Path

import psutil

from crossalign.dag import step_spec

def pynative_writing_pid(run_dir: Path) -> int | None:
    """The pid of the pynative-train step while it is writing its log into its staging folder, else None."""
    partials = list(run_dir.glob(".05-pynative-train.partial-*"))
    attempt = run_dir / ".attempts" / "pynative-train.json"
    if partials and (partials[0] / "train.log").exists() and (partials[0] / "train.log").stat().st_size \
            and attempt.exists():
        return json.loads(attempt.read_text())["pid"]
    return None


def training_writing_pid(run_dir: Path, step: str) -> int | None:
    """The pid of ``step``'s running attempt (the process that runs the step: in distributed mode, its flow run's
    process) once the training writes its log into that attempt's staging folder, else None."""
    attempt_file = run_dir / ".attempts" / f"{step}.json"
    if not attempt_file.exists():
        return None
    attempt = json.loads(attempt_file.read_text())
    if attempt.get("status") != "running":
        return None
    staging = f".{step_spec(step).dirname}.partial-{attempt['host']}-{attempt['pid']}-*"
    if any((folder / "train.log").is_file() and (folder / "train.log").stat().st_size
           for folder in run_dir.glob(staging)):
        return int(attempt["pid"])
    return None


def training_processes(pid: int) -> list:
    """The process ``pid`` and every process it started (psutil.Process): a training of several ranks runs one
    process per rank beside the step's own (crossalign/sides/megatron/embedded/trainer.py, ``_train_ranks``)."""
    step = psutil.Process(pid)
    return [step, *step.children(recursive=True)]
