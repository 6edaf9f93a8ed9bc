"""Live alignment in the parent flow run: compare steps 4 and 5 while they train, stop them once a pass is impossible.

The parent flow watches while megatron-train and pynative-train run side by side (embedded: two
local processes; distributed: flow runs on other machines, writing into the shared store). Every
look reads what both logs gained (``crossalign.report.live``); every few compared steps, and as
soon as both sides logged step 1, the parent's artifacts ``live-alignment`` (markdown: the
table, the decision, the loss plot) and ``live-alignment-table`` are updated in place (one
artifact each, its data replaced, as Prefect updates a progress artifact), the CLI's run
display gets the same table, and ``live/alignment.json`` and ``live/loss.png`` are rewritten.

Fail-fast: once the outcome is decided, or one side failed while the other still trains, both
trainings are asked to stop (``crossalign.stop``); one that has not stopped
``STOP_GRACE_S`` later is cancelled through Prefect (distributed) or terminated (embedded). The
run then ends ``fail`` with the reason, a report of what both sides logged (``live/report.html``)
and how many steps and card-hours were saved. The site's ``fail_fast: false`` or the run's
``fail_fast=False`` (``--no-fail-fast``) leaves both sides to finish and step 6 to judge.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from typing import Any

import numpy as np
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactUpdate
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
from prefect.context import FlowRunContext
from prefect.states import Cancelling

from crossalign.dag import COMPARED, step_spec
from crossalign.flows.events import StepEvent, emit
from crossalign.flows.outcome import failed
from crossalign.flows.summary import run_url
from crossalign.report.live import Decision, LiveComparison, Snapshot, titled
from crossalign.report.metrics import COMOVE_MIN_STEPS, MEAN_LIMIT, STEP1_LIMIT
from crossalign.report.render import plot_losses, write_outputs
from crossalign.stop import (STOPPABLE, hold_after_first_step, keep_log, kept_log_path, live_dir, read_stop,
                             release, request_stop, update_stop)
from crossalign.store import Run, write_json_atomic
from crossalign.tasks.errors import InfrastructureError, StepFailed

LIVE_KEY = "live-alignment"
LIVE_TABLE_KEY = "live-alignment-table"
PUBLISH_EVERY_STEPS = 5  # compared steps between two updates of the artifacts (and always after step 1)
STOP_GRACE_S = 10.0  # a training still running this long after the stop request is cancelled or terminated
KILL_GRACE_S = 5.0  # a terminated step process still alive this long after SIGTERM is killed
SNAPSHOT_FILE = "alignment.json"
PLOT_FILE = "loss.png"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.4g}%"


def live_markdown(snapshot: Snapshot, plot: str, fail_fast: bool) -> str:
    """The live artifact: where both sides are, the metrics so far, whether the outcome is decided, the plot."""
    rows = snapshot.rows()
    lines = [f"# Live alignment: {snapshot.headline()}", "",
             f"updated {time.strftime('%H:%M:%S', time.gmtime())} UTC; limits: step-1 rel err < {_pct(STEP1_LIMIT)}, "
             f"mean rel err < {_pct(MEAN_LIMIT)} over all {snapshot.total} steps, co-movement at least what a pass "
             f"needs with that many steps (told from {COMOVE_MIN_STEPS} steps on)", ""]
    if rows:
        header = list(rows[0])
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(str(row[c]) for c in header) + " |" for row in rows]
    decision = snapshot.decision
    if decision is None:
        lines += ["", "Outcome: open (nothing decided so far)."]
    else:
        then = "both trainings are stopped" if fail_fast else "fail-fast is off: both trainings go on"
        lines += ["", f"**Outcome decided at step {decision.step}: the run cannot pass.** {decision.reason}; {then}."]
    lines += ["", plot]
    return "\n".join(lines) + "\n"


class LivePublisher:
    """Shows snapshots: the parent's two artifacts (created once, then updated in place), the CLI, live/."""

    def __init__(self, run: Run, logger: Any, fail_fast: bool):
        self.run = run
        self.logger = logger
        self.fail_fast = fail_fast
        self.artifact_ids: dict[str, Any] = {}
        self.shown_at = 0  # compared steps at the last update

    def due(self, snapshot: Snapshot) -> bool:
        return snapshot.compared > 0 and (self.shown_at == 0 or snapshot.decision is not None
                                          or snapshot.compared - self.shown_at >= PUBLISH_EVERY_STEPS)

    def show(self, snapshot: Snapshot) -> None:
        self.shown_at = snapshot.compared
        folder = live_dir(self.run)
        folder.mkdir(exist_ok=True)
        plot_path = folder / PLOT_FILE
        try:
            plot_losses(titled(snapshot.summary, f"live, {snapshot.headline()}"), snapshot.merged, plot_path)
            url = run_url(self.run, plot_path)
            # the same address each time: the step makes the browser load the new plot rather than its copy
            plot = f"![losses and relative errors so far]({url}?step={snapshot.compared})" if url \
                else f"plot: `{plot_path}`"
        except Exception as exc:  # the display must never fail the run
            self.logger.warning(f"live alignment: plot not drawn: {type(exc).__name__}: {exc}")
            plot = f"plot not drawn: {type(exc).__name__}: {exc}"
        rows = snapshot.rows()
        write_json_atomic(folder / SNAPSHOT_FILE, {
            "headline": snapshot.headline(), "total": snapshot.total, "logged": snapshot.logged,
            "compared": snapshot.compared, "series": rows, "logs": snapshot.paths,
            "decision": None if snapshot.decision is None else vars(snapshot.decision)})
        emit(StepEvent("live", "alignment", done=snapshot.compared, total=snapshot.total,
                       metrics={"rows": rows, "decision": None if snapshot.decision is None
                                else snapshot.decision.reason},
                       message=snapshot.headline()))
        description = f"run {self.run.run_id}: {snapshot.headline()}"
        self._put(LIVE_KEY, live_markdown(snapshot, plot, self.fail_fast), description)
        self._put(LIVE_TABLE_KEY, rows, description)

    def _put(self, key: str, data: Any, description: str) -> None:
        """Create the artifact on the first call, then replace its data (the same artifact, not a new version)."""
        if FlowRunContext.get() is None:
            return
        try:
            if key not in self.artifact_ids:
                create = create_table_artifact if isinstance(data, list) else create_markdown_artifact
                self.artifact_ids[key] = create(data, key=key, description=description)
            else:
                payload = json.dumps(data) if isinstance(data, list) else data
                with get_client(sync_client=True) as client:
                    client.update_artifact(self.artifact_ids[key],
                                           ArtifactUpdate(data=payload, description=description))
        except Exception as exc:  # the display must never fail the run
            self.logger.warning(f"live alignment: artifact {key} not updated: {exc}")


def _done(future) -> bool:
    return future.wrapped_future.done()


def _training(run: Run, futures: dict[str, Any]) -> list[str]:
    """The trainings that are still training: not ended, and not already committed (a step skipped as done
    leaves its future running for a moment, with nothing to stop)."""
    return [step for step in STOPPABLE if not _done(futures[step]) and not _committed(run, step)]


def _committed(run: Run, step: str) -> bool:
    manifest = run.manifest(step)
    return manifest is not None and manifest.get("status") == "done"


def _failed_side(futures: dict[str, Any]) -> Decision | None:
    """One training failed while the other still trains: nothing left to compare it with."""
    for step in STOPPABLE:
        if _done(futures[step]):
            futures[step].wait(0)
            state = futures[step].state
            if state.is_failed() or state.is_crashed():
                return Decision("failed", f"{step} failed ({state.message or state.name}): there is nothing to "
                                          "compare the other side with", 0)
    return None


def watch_training(run: Run, futures: dict[str, Any], *, mode: str, fail_fast: bool, poll_interval_s: float,
                   logger: Any) -> Decision | None:
    """Compare the two trainings until both ended, or until fail-fast stopped them (then the decision)."""
    comparison = LiveComparison(run)
    publisher = LivePublisher(run, logger, fail_fast)
    if fail_fast:
        hold_after_first_step(run)
    try:
        while True:
            finished = all(_done(futures[step]) for step in STOPPABLE)
            snapshot = comparison.update()
            current = comparison.snapshot
            decision = current.decision or _failed_side(futures)
            if decision is not None and fail_fast and _training(run, futures):
                request_stop(run, decision.reason, rule=decision.rule, decided_at_step=decision.step,
                             requested_at=time.time())  # first: every moment lets the trainings go on
                release(run)  # a held training sees the stop request first
                logger.warning(f"fail-fast: {decision.reason}; stopping {' and '.join(STOPPABLE)}")
                stop_training(run, futures, mode=mode, logger=logger)
                if current.compared:
                    publisher.show(current)
                return decision
            if current.compared or any(_done(futures[step]) for step in STOPPABLE):
                release(run)  # step 1 of both is in (or one side will log no more): let both go on
            if (snapshot is not None and publisher.due(snapshot)) or \
                    (finished and current.compared and publisher.shown_at != current.compared):
                publisher.show(current)
            if finished:
                return None
            time.sleep(poll_interval_s)
    finally:
        release(run)


def stop_training(run: Run, futures: dict[str, Any], *, mode: str, logger: Any) -> None:
    """After the stop request: cancel or terminate the trainings still running after the grace period."""
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and not all(_done(futures[step]) for step in STOPPABLE):
        time.sleep(0.2)
    going = [step for step in STOPPABLE if not _done(futures[step])]
    if not going:
        update_stop(run, stopped_in_s=round(time.time() - (read_stop(run) or {})["requested_at"], 2))
        return
    reason = (read_stop(run) or {}).get("reason", "")
    if mode == "distributed":
        logger.warning(f"fail-fast: {', '.join(going)} still running {STOP_GRACE_S:.0f} s after the stop "
                       "request: cancelling their flow runs")
        cancel_flow_runs(run, going, reason)
    else:
        logger.warning(f"fail-fast: {', '.join(going)} still running {STOP_GRACE_S:.0f} s after the stop "
                       "request: terminating their processes")
        terminate_processes(run, going)


def cancel_flow_runs(run: Run, steps: list[str], reason: str) -> None:
    """Cancel the step's flow runs that have not ended; their workers then kill the processes (and the jobs)."""
    with get_client(sync_client=True) as client:
        for step in steps:
            name = f"{run.run_id}-{step}"  # the names execute_deployment gives a step's attempts
            for flow_run in client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=name))):
                if (flow_run.name == name or flow_run.name.startswith(name + "-")) and flow_run.state is not None \
                        and not flow_run.state.is_final():
                    client.set_flow_run_state(flow_run.id, Cancelling(message=f"stopped early: {reason}"),
                                              force=True)


def terminate_processes(run: Run, steps: list[str]) -> None:
    """SIGTERM the running attempts of ``steps`` on this machine, SIGKILL those still alive after KILL_GRACE_S."""
    pids = []
    for step in steps:
        attempt = run.attempt(step) or {}
        if attempt.get("status") == "running" and attempt.get("host") == socket.gethostname():
            pids.append(int(attempt["pid"]))
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + KILL_GRACE_S
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if _signal(pid, 0)]
        time.sleep(0.1)
    for pid in pids:
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, signum: int) -> bool:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return False
    return True


def stop_error(run: Run, step: str, error: Exception) -> Exception:
    """A training stopped on a stop request (by itself, cancelled or killed) is not retried."""
    if step in STOPPABLE and isinstance(error, InfrastructureError) and read_stop(run) is not None:
        return StepFailed(step, f"stopped early: {read_stop(run)['reason']} ({error})")
    return error


def _keep_abandoned_log(run: Run, step: str) -> None:
    """A step process killed before it could keep its log left it in its staging folder: keep it from there."""
    if kept_log_path(run, step).exists() or run.manifest(step) is not None:
        return
    attempt = run.attempt(step) or {}
    staging = sorted(run.path.glob(f".{step_spec(step).dirname}.partial-{attempt.get('host')}-{attempt.get('pid')}-*"))
    if staging:
        keep_log(run, step, staging[-1] / "train.log")


def _saved(run: Run, step: str, frame, total: int, stopped_at: float) -> dict[str, Any]:
    """Steps trained and saved; card-hours: elapsed x cards so far, and the median logged step time x cards for
    the steps not trained."""
    attempt = run.attempt(step) or {}
    seconds = attempt.get("seconds")
    if seconds is None and "started_at" in attempt:
        seconds = max(stopped_at - attempt["started_at"], 0.0)
    cards = getattr(run.config.parallel, step_spec(step).side).world_size
    trained = 0 if frame is None or frame.empty else int(frame["step"].max())
    times = np.array([]) if frame is None or "step_time_ms" not in frame else frame["step_time_ms"].dropna().to_numpy()
    step_s = float(np.median(times)) / 1000 if len(times) else None
    saved_steps = total - trained
    return {"trained_steps": trained, "total_steps": total, "saved_steps": saved_steps,
            "seconds": None if seconds is None else round(seconds, 1), "cards": cards,
            "step_seconds": None if step_s is None else round(step_s, 4),
            "card_hours_used": None if seconds is None else round(seconds * cards / 3600, 6),
            "card_hours_saved": None if step_s is None else round(step_s * saved_steps * cards / 3600, 6)}


def stopped_outcome(run: Run, decision: Decision, logger: Any):
    """Once both trainings ended: the report of what they logged, the savings, and the run's final state
    (Failed with the verdict in its message, as a failed verdict of step 6 ends it)."""
    stopped_at = time.time()
    for step in STOPPABLE:
        _keep_abandoned_log(run, step)
    comparison = LiveComparison(run)
    snapshot = comparison.update() or comparison.snapshot
    total = snapshot.total
    saved = {spec.name: _saved(run, spec.name, snapshot.frames.get(spec.pool), total, stopped_at) for spec in COMPARED}
    steps_saved = sum(s["saved_steps"] for s in saved.values())
    hours = [s["card_hours_saved"] for s in saved.values() if s["card_hours_saved"] is not None]
    trained = ", ".join(f"{step} after {s['trained_steps']} of {total} steps"
                        + (f" ({s['seconds']:.0f} s on {s['cards']} card{'s' if s['cards'] > 1 else ''})"
                           if s["seconds"] is not None else "") for step, s in saved.items())
    savings = (f"{steps_saved} of {2 * total} training steps saved"
               + (f", about {sum(hours):.3g} card-hours" if hours else ""))
    request = read_stop(run) or {}
    stopped_in = request.get("stopped_in_s", round(stopped_at - request.get("requested_at", stopped_at), 2))
    update_stop(run, stopped=saved, steps_saved=steps_saved, stopped_in_s=stopped_in,
                card_hours_saved=round(sum(hours), 6) if hours else None)
    where, report = "", None
    if snapshot.summary is not None:
        summary = snapshot.summary
        summary.verdict = "fail"
        summary.reasons = [f"stopped early at step {decision.step} of {total}: {decision.reason}"]
        summary.notes += [f"stopped: {trained}", f"saved: {savings}",
                          f"logs kept in {live_dir(run)}: {', '.join(kept_log_path(run, s).name for s in STOPPABLE)}"]
        folder = live_dir(run)
        flow_run = run.info.get("prefect_flow_run") or {}
        try:
            write_outputs(summary, snapshot.merged, folder, run_link={"run_id": run.run_id, "url": flow_run.get("url")})
            report = run_url(run, folder / "report.html") or str(folder / "report.html")
            where = f"; report {report}"  # followed by a space, as the DAG's final message (flows/alignment.py)
        except Exception as exc:  # a report that cannot be written must not hide the verdict
            logger.warning(f"fail-fast: report not written in {folder}: {type(exc).__name__}: {exc}")
    message = (f"run {run.run_id}: verdict fail, stopped early at step {decision.step} of {total}: {decision.reason}"
               f"{where} (stopped {trained}, {stopped_in:.1f} s after the stop request; {savings})")
    logger.warning(message)
    return failed(message, {"run_id": run.run_id, "verdict": "fail", "report": report,
                            "stopped_early": read_stop(run)})
