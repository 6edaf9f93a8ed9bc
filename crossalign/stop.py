"""Stopping the two alignment trainings early, and keeping what they logged.

The orchestrator's live comparison (``crossalign.flows.live``) decides that a run cannot pass and
writes a stop request into the run's ``live/`` folder; every training step of the comparison
(megatron-train, pynative-train) looks at it before it starts and after each iteration, on
whatever machine it runs, and ends with :class:`TrainingStopped`. A file in the shared store is
the one signal that reaches a step wherever it runs (a local process, a worker on another
machine, a framework over SSH); the orchestrator still cancels or kills a step that does not
stop by itself. A stop request holds until the next flow run of the run starts (``clear_live``).

With fail-fast on, the orchestrator also holds each side after its step 1 (``hold.json``) until the
other side has logged its step 1 too: the first comparison, which decides most broken conversions,
then comes before the faster side has trained on, and costs the slower side nothing.

A training step that ends without committing keeps its log as ``live/<step>.log`` (the staging
folder it wrote into is removed), so that the report of a stopped run can show and link it.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from crossalign.dag import COMPARED
from crossalign.sides.protocol import EnvironmentRefused, StepCallback
from crossalign.store import Run, now_iso, read_json, write_json_atomic

LIVE_DIR = "live"
STOP_FILE = "stop.json"
HOLD_FILE = "hold.json"
REFUSAL_FILE = "environment.json"
HOLD_MAX_S = 1800.0  # a side never waits longer than this for the other side's step 1
HOLD_POLL_S = 0.2
STOPPABLE = tuple(spec.name for spec in COMPARED)  # the two sides of the comparison


class TrainingStopped(RuntimeError):
    """A training step ended on a stop request: the run's outcome was already decided."""


def live_dir(run: Run) -> Path:
    return run.path / LIVE_DIR


def stop_path(run: Run) -> Path:
    return live_dir(run) / STOP_FILE


def kept_log_path(run: Run, step: str) -> Path:
    """Where a training step that did not commit keeps its log."""
    return live_dir(run) / f"{step}.log"


def read_stop(run: Run) -> dict[str, Any] | None:
    path = stop_path(run)
    return read_json(path) if path.exists() else None


def request_stop(run: Run, reason: str, **details: Any) -> dict[str, Any]:
    """Ask both training steps to stop; returns the request as written."""
    live_dir(run).mkdir(exist_ok=True)
    request = {"reason": reason, "requested": now_iso(), "steps": list(STOPPABLE), **details}
    write_json_atomic(stop_path(run), request)
    return request


def update_stop(run: Run, **fields: Any) -> None:
    """Add the outcome of a stop (steps trained, time saved) to its request."""
    request = read_stop(run) or {}
    request.update(fields)
    write_json_atomic(stop_path(run), request)


def clear_live(run: Run) -> None:
    """Forget an earlier flow run's live comparison (its stop request, kept logs and report) before the
    training steps of a new flow run start; renamed out of the way first, so no reader sees half of it."""
    folder = live_dir(run)
    if folder.exists():
        trash = folder.with_name(f".{LIVE_DIR}.trash-{uuid.uuid4().hex[:8]}")
        os.replace(folder, trash)
        shutil.rmtree(trash, ignore_errors=True)


def check_stop(run: Run, step: str) -> None:
    """Raise TrainingStopped if the run asks ``step`` to stop."""
    request = read_stop(run)
    if request is not None and step in request.get("steps", ()):
        raise TrainingStopped(f"stopped early: {request['reason']} (requested {request['requested']} in "
                              f"{stop_path(run)}; the next flow run of this run clears it)")


def hold_path(run: Run) -> Path:
    return live_dir(run) / HOLD_FILE


def hold_after_first_step(run: Run) -> None:
    """Ask both trainings to wait after their step 1 until ``release`` (the other side logged its step 1)."""
    live_dir(run).mkdir(exist_ok=True)
    write_json_atomic(hold_path(run), {"requested": now_iso(), "until": "both sides logged step 1"})


def release(run: Run) -> None:
    hold_path(run).unlink(missing_ok=True)


def _wait_while_held(run: Run, step: str) -> None:
    if not hold_path(run).exists():
        return
    print(f"{step}: step 1 done; waiting for the other side's step 1 (fail-fast compares it first)", flush=True)
    deadline = time.monotonic() + HOLD_MAX_S
    while hold_path(run).exists() and time.monotonic() < deadline:
        check_stop(run, step)
        time.sleep(HOLD_POLL_S)
    check_stop(run, step)  # the orchestrator asks for the stop before it lifts the hold


def stopping(run: Run, step: str, on_step: StepCallback | None) -> StepCallback:
    """``on_step`` that honours a stop request (a trainer calls it after every iteration) and the hold
    after step 1."""
    def on_step_or_stop(done: int, total: int, metrics: dict[str, float]) -> None:
        if on_step is not None:
            on_step(done, total, metrics)
        check_stop(run, step)
        if done == 1:
            _wait_while_held(run, step)

    return on_step_or_stop


def keep_log(run: Run, step: str, log: Path) -> Path | None:
    """Copy what a step logged to ``live/<step>.log`` (through a temporary sibling); None if it logged nothing."""
    if not log.is_file():
        return None
    kept = kept_log_path(run, step)
    kept.parent.mkdir(exist_ok=True)
    tmp = kept.with_name(f".{kept.name}.{uuid.uuid4().hex[:8]}.tmp")
    shutil.copyfile(log, tmp)
    os.replace(tmp, kept)
    return kept


def stopped_report(run: Run) -> Path | None:
    """The report of a run whose trainings were stopped early (``live/report.html``), else None."""
    report = live_dir(run) / "report.html"
    return report if report.exists() and read_stop(run) is not None else None


def record_refusal(run: Run, step: str, error: EnvironmentRefused) -> dict[str, Any]:
    """Write why ``step`` refused its machine into the run's live folder and ask both trainings to stop."""
    live_dir(run).mkdir(exist_ok=True)
    record = {"step": step, "reason": error.reason, "details": error.details, "recorded": now_iso(), **error.facts}
    write_json_atomic(live_dir(run) / REFUSAL_FILE, record)
    request_stop(run, f"{step} refused its machine: {error.reason}", rule="environment")
    return record


def read_refusal(run: Run) -> dict[str, Any] | None:
    path = live_dir(run) / REFUSAL_FILE
    return read_json(path) if path.exists() else None
