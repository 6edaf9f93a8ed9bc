"""The three ways a step gets carried out, all ending with the step's manifest in the run store.

- ``execute_here``: in the process of the flow (a worker of the step's pool);
- ``execute_subprocess``: embedded mode, ``python -m crossalign.tasks`` as a local process (the
  two frameworks never share a process, and steps 4 and 5 run side by side);
- ``execute_deployment``: distributed mode, a flow run of the step's deployment on its pool.

Each raises ``StepFailed`` for failures that would repeat and ``InfrastructureError`` for those
that another attempt may fix, which is what the retry policy looks at.
"""

from __future__ import annotations

import shlex
import time
from contextlib import contextmanager
from typing import Any, Iterator

import httpx
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
from prefect.deployments import run_deployment
from prefect.exceptions import PrefectHTTPStatusError
from prefect.states import Cancelling

from crossalign.agents.runner import run_streaming
from crossalign.dag import HF_IMPORT, STEPS, StepSpec
from crossalign.flows.reporting import StepReporter
from crossalign.site import SiteConfig
from crossalign.store import Run
from crossalign.tasks import run_step
from crossalign.tasks.command import step_argv
from crossalign.tasks.errors import InfrastructureError, StepFailed, exit_code_error

LATE_WARNING_S = 60.0
STEP_FLOW = "step"  # the one flow that carries out any step, deployed once per step
STEP_FLOW_ENTRYPOINT = "crossalign.flows.steps:step_flow"
CONVERT_PART = "convert-part/convert-part"  # a part of a torch_dist conversion, on the cpu pool (prefect.yaml)


def step_log_path(run: Run, step: str):
    return run.path / "logs" / f"{step}.log"


def _failure_detail(run: Run, step: str) -> str:
    attempt = run.attempt(step) or {}
    return attempt.get("error", "") if attempt.get("status") == "failed" else ""


def classify(step: str, exc: BaseException) -> Exception:
    """The orchestration error for an exception raised while carrying out ``step``."""
    if isinstance(exc, (StepFailed, InfrastructureError)):
        return exc
    if isinstance(exc, (OSError, ConnectionError, TimeoutError)):
        return InfrastructureError(step, f"{type(exc).__name__}: {exc}")
    return StepFailed(step, f"{type(exc).__name__}: {exc}")


def execute_here(run: Run, step: str, site: SiteConfig, reporter: StepReporter) -> dict[str, Any]:
    """Carry out ``step`` in this process (a real backend may still run its framework over SSH)."""
    try:
        return run_step(run, step, site, on_step=reporter.on_step)
    except Exception as exc:
        error = classify(step, exc)
        if error is exc:
            raise
        raise error from exc


def execute_subprocess(run: Run, step: str, reporter: StepReporter) -> dict[str, Any]:
    """Carry out ``step`` as a local ``python -m crossalign.tasks --embedded`` process, streaming its output."""
    argv = step_argv(str(run.store.root), run.run_id, step, embedded=True)
    reporter.logger.info(f"{step}: {shlex.join(argv)}")
    code = run_streaming(argv, on_line=reporter.on_line, log_path=step_log_path(run, step))
    if code != 0:
        raise exit_code_error(step, code, _failure_detail(run, step))
    manifest = run.manifest(step)
    if manifest is None:
        raise StepFailed(step, "the step process exited 0 but committed no manifest")
    return manifest


def step_timeout(run: Run, step: str, site: SiteConfig) -> float:
    """The default limit on a step's flow run: the site's, or derived from the iterations the run's spec of the
    step trains (``StepSpec.trains``)."""
    return site.step_timeout(step, run.spec(step).iterations(run.config.training))


def deployment_name(spec: StepSpec) -> str:
    """``<flow>/<deployment>`` of the deployment in prefect.yaml that carries ``spec`` out on its pool."""
    return f"{STEP_FLOW}/{spec.deployment}"


def missing_step_deployments(deployments: list[dict[str, Any]]) -> list[str]:
    """The step deployments the step table needs that a prefect.yaml's ``deployments`` lack: one of the step flow
    per way of carrying a step out, named as the table says, on its pool, with its step as parameter."""
    found = {(entry.get("name"), (entry.get("work_pool") or {}).get("name"), (entry.get("parameters") or {}).get("step"))
             for entry in deployments if entry.get("entrypoint") == STEP_FLOW_ENTRYPOINT}
    return [f"{deployment_name(spec)} on the {spec.pool} pool with parameters {{step: {spec.name}}}"
            for spec in (*STEPS, HF_IMPORT) if (spec.deployment, spec.pool, spec.name) not in found]


def execute_deployment(run: Run, step: str, reporter: StepReporter, *, poll_interval: float = 0.5,
                       timeout_s: float | None = None) -> dict[str, Any]:
    """Carry out ``step`` as a flow run of its deployment and wait for it.

    Attempt n of a step uses the idempotency key ``<run_id>:<step>`` (n = 1) or ``<run_id>:<step>:<n>``.
    Walking the keys in order re-attaches to an attempt that is still going (a retried parent
    never duplicates a child) and starts the next attempt after one that ended without
    completing the step.
    """
    spec = run.spec(step)
    name = deployment_name(spec)
    parameters = {"step": spec.name, "run_id": run.run_id, "store": str(run.store.root)}
    attempt = 1
    with _api_trouble_is_infrastructure(step), get_client(sync_client=True) as client:
        while True:
            key = f"{run.run_id}:{step}" if attempt == 1 else f"{run.run_id}:{step}:{attempt}"
            flow_run_name = f"{run.run_id}-{step}" + (f"-{attempt}" if attempt > 1 else "")
            # an attempt that ended is read, not asked for again: run_deployment would add a task run to the
            # parent's graph for it that nothing ever finishes
            child = _ended_attempt(client, flow_run_name, key) or run_deployment(
                name, parameters=parameters, idempotency_key=key, timeout=0, flow_run_name=flow_run_name)
            if child.state is not None and child.state.is_final():
                if child.state.is_completed() and run.is_done(step):
                    reporter.logger.info(f"{step}: attempt {attempt} ({child.name}) already completed it")
                    return run.manifest(step)
                attempt += 1  # an earlier attempt that failed, or whose output was invalidated since
                continue
            reporter.logger.info(f"{step}: waiting for flow run {child.name} of {name} (key {key})")
            _name_tracking_task_run(client, child, f"{step} on {spec.pool}")
            state = _wait_final(client, child, spec, reporter, poll_interval, timeout_s)
            if state.is_completed():
                if not run.is_done(step):
                    raise StepFailed(step, f"flow run {child.name} completed but the step's manifest is "
                                           f"missing or stale in {run.path}")
                manifest = run.manifest(step)
                _name_tracking_task_run(client, child, f"{step} on {spec.pool}, host {manifest['host']}")
                return manifest
            detail = _failure_detail(run, step) or (state.message or "")
            where = f"flow run {child.name} of {name} ended {state.name}"
            attempt_record = run.attempt(step) or {}
            if state.is_crashed() or attempt_record.get("retryable"):
                raise InfrastructureError(step, f"{where}: {detail}")
            raise StepFailed(step, f"{where}: {detail}")


def execute_convert_parts(run: Run, parts: int, reporter: StepReporter, *, token: str,
                          poll_interval: float = 0.5) -> None:
    """Run the ``parts`` parts of the run's torch_dist conversion as flow runs of the convert-part deployment, all
    at once on the cpu pool's workers, and wait for them; ``token`` (the convert step's own flow run) keys them,
    so a retried step starts them again. Raises like a step when a part fails."""
    spec = run.spec("convert")
    with _api_trouble_is_infrastructure(spec.name), get_client(sync_client=True) as client:
        children = [run_deployment(CONVERT_PART, parameters={"run_id": run.run_id, "part": part, "parts": parts,
                                                             "store": str(run.store.root)},
                                   idempotency_key=f"{token}:part-{part}-of-{parts}", timeout=0,
                                   flow_run_name=f"{run.run_id}-convert-part-{part}-of-{parts}")
                    for part in range(parts)]
        reporter.logger.info(f"convert: {parts} parts started on the cpu pool: "
                             f"{', '.join(child.name for child in children)}")
        for child in children:
            state = _wait_final(client, child, spec, reporter, poll_interval, None)
            if not state.is_completed():
                where = f"flow run {child.name} of {CONVERT_PART} ended {state.name}: {state.message or ''}"
                raise (InfrastructureError if state.is_crashed() else StepFailed)(spec.name, where)


def _ended_attempt(client, flow_run_name: str, key: str):
    """The flow run of an attempt (its name and idempotency key) if it exists and has ended, else None."""
    named = FlowRunFilter(name=FlowRunFilterName(any_=[flow_run_name]))
    for flow_run in client.read_flow_runs(flow_run_filter=named):
        if flow_run.idempotency_key == key and flow_run.state is not None and flow_run.state.is_final():
            return flow_run
    return None


def _name_tracking_task_run(client, child, name: str) -> None:
    """Name the task run by which the parent's graph and Task Runs tab show a step's flow run (Prefect gives
    it a random name): the step, its pool and, once done, the machine it ran on."""
    if child.parent_task_run_id is not None:
        client.set_task_run_name(child.parent_task_run_id, name)


@contextmanager
def _api_trouble_is_infrastructure(step: str) -> Iterator[None]:
    """An unreachable or overloaded Prefect API (connection errors, 5xx) is worth another attempt."""
    try:
        yield
    except PrefectHTTPStatusError as exc:
        if exc.response.status_code >= 500:
            raise InfrastructureError(step, f"Prefect API: {exc.response.status_code} {exc.response.reason_phrase} "
                                            f"for {exc.request.url}") from exc
        raise
    except httpx.TransportError as exc:
        raise InfrastructureError(step, f"Prefect API unreachable: {exc}") from exc


def _wait_final(client, child, spec: StepSpec, reporter: StepReporter, poll_interval: float,
                timeout_s: float | None):
    """The child's final state. ``timeout_s`` counts from when it started running (a child waiting for a worker
    has not started); past it the child is cancelled (its worker ends the process) and the step may be retried."""
    step = spec.name
    started = time.monotonic()
    running_since = None
    warned_late = False
    while True:
        flow_run = client.read_flow_run(child.id)
        state = flow_run.state
        if state is not None and state.is_final():
            return state
        waited = time.monotonic() - started
        if running_since is None and state is not None and state.is_running():
            running_since = time.monotonic()
        if timeout_s is not None and running_since is not None and time.monotonic() - running_since > timeout_s:
            message = f"still running after the step's limit of {timeout_s:.0f} s"
            client.set_flow_run_state(child.id, Cancelling(message=message), force=True)
            raise InfrastructureError(step, f"flow run {child.name} {message}; cancelled")
        if not warned_late and state is not None and state.is_scheduled() and waited > LATE_WARNING_S:
            warned_late = True
            reporter.logger.warning(f"{step}: flow run {child.name} has waited {waited:.0f} s for a worker: "
                                    f"is `crossalign agent start --pool {spec.pool}` running?")
        time.sleep(poll_interval)
