"""The alignment flow: the six-step DAG, embedded (one machine) or distributed (one pool per step).

    1 base-train (npu) -> 2 cast-bf16 (cpu) -> 3 convert (cpu) -> 4 megatron-train (gpu)
                                   2 -> 5 pynative-train (npu);    4 + 5 -> 6 compare (cpu)

The flow itself decides nothing about the work: it prepares the run, checks the configs, then
submits each step once its inputs are done, skipping steps whose manifests are already valid.
A flow run keeps the run id its first attempt made (and named it after), so every later attempt of
it (Retry in the UI, an automatic retry, a flow-run process started again) resumes that run where it
stopped, as a new flow run with the same run id does; on a retry or a rerun the outputs of a step it
would skip are first checked against the sha256 in its manifest, so a damaged output is redone rather
than consumed. Infrastructure failures are retried with backoff, deterministic ones are not.

The run form's fields (and the command line's options) make one request (``crossalign.request``),
resolved once: the config is loaded with its overrides there and frozen into the run's run.json.
The ``rerun`` flow is the UI's form for ``crossalign rerun``: one run id, one step.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.futures import wait
from prefect.runtime import flow_run as current_flow_run
from prefect.settings import get_current_settings
from prefect.states import Completed, State

from crossalign.config import ConfigError, load_config
from crossalign.dag import STEPS, StepName, downstream
from crossalign.dump_settings import DumpLevel, DumpTask, rerun_dump
from crossalign.flows.events import StepEvent, emit
from crossalign.flows.launch import execute_deployment, execute_subprocess, step_timeout
from crossalign.flows.live import stop_error, stopped_outcome, watch_training
from crossalign.flows.outcome import failed
from crossalign.flows.refused import refused_outcome
from crossalign.flows.reporting import StepReporter
from crossalign.flows.retry import backoff_delays, retry_on_infrastructure
from crossalign.flows.summary import publish_compare, run_url, steps_table
from crossalign.preflight.config import preflight_config
from crossalign.preflight.data import compare_sample_order
from crossalign.request import Mode, ResolvedRequest, RunRequest, form_error, resolution
from crossalign.sides.megatron.side import MEGATRON
from crossalign.sides.mindformers.side import MINDFORMERS
from crossalign.site import load_site
from crossalign.stop import clear_live, read_refusal
from crossalign.store import RunStore, StoreError, is_new_run_id, new_run_id
from crossalign.tasks.errors import InfrastructureError, PreflightFailed, StepFailed
from crossalign.tasks.prepare import prepare_run
from crossalign.tasks.training import request_dumps

PREFLIGHT_BATCHES = 3  # global batches whose token digests must agree between the two sides


def name_flow_run(name: str) -> None:
    """Name the current flow run after the store's run id, which is what users look for in the UI."""
    flow_run_id = current_flow_run.get_id()
    if flow_run_id and current_flow_run.get_name() != name:
        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run_id, name=name)


def first_attempts_run_id() -> str | None:
    """On a later attempt of the current flow run (Retry in the UI, an automatic retry, a flow-run process started
    again), the run id its first attempt made and named it after; None on the first attempt, or when no attempt
    got as far as naming it. Read from the server: an attempt retried in the same process keeps the flow run as it
    was when the process started."""
    flow_run_id = current_flow_run.get_id()
    if not flow_run_id:
        return None
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(flow_run_id)
    return flow_run.name if flow_run.run_count > 1 and is_new_run_id(flow_run.name) else None


def _flow_run_ui_url() -> str | None:
    """The current flow run's page in the Prefect UI: PREFECT_UI_URL's, else the API's address without /api."""
    settings = get_current_settings()
    base = settings.ui_url or (settings.api.url or "").removesuffix("/").removesuffix("/api")
    flow_run_id = current_flow_run.get_id()
    return f"{base}/runs/flow-run/{flow_run_id}" if base and flow_run_id else None


@task(name="prepare-run", task_run_name="prepare-run", cache_policy=NO_CACHE)
def prepare(resolved: ResolvedRequest) -> str:
    """Create or reopen the run, settle its dataset, and invalidate the steps asked to rerun (once per flow run).

    Without a config the run must exist and is reopened as it was.
    """
    logger = get_run_logger()
    run = prepare_run(resolved)
    logger.info(f"run {run.run_id} in {run.path} (dataset {run.dataset.prefix})")
    # the report links back to the flow run that carried the run out last
    run.update_info(prefect_flow_run={"id": str(current_flow_run.get_id() or ""), "url": _flow_run_ui_url()})
    rerun = resolved.request.rerun
    if rerun:
        token = str(current_flow_run.get_id() or "")
        if token not in run.info.get("rerun_by", []):
            for name in rerun:
                removed = run.invalidate(name)
                logger.info(f"rerun {name}: invalidated {', '.join(removed) or 'nothing (not done yet)'}")
            run.update_info(rerun_by=[*run.info.get("rerun_by", []), token])
    return run.run_id


@task(name="preflight", task_run_name="preflight", cache_policy=NO_CACHE)
def preflight(store: str, run_id: str) -> None:
    """Refuse a run whose two sides would not train the same thing, before any machine is busy."""
    logger = get_run_logger()
    run = RunStore(store).run(run_id)
    config = run.config
    report = preflight_config(config)
    if not report.ok:
        raise PreflightFailed("the generated launch settings differ: " + "; ".join(
            f"{row.name}: megatron {row.megatron} vs mindformers {row.mindformers}" for row in report.rows if not row.ok))
    logger.info(f"preflight: the generated Megatron and MindFormers settings agree ({len(report.rows)} checked)")
    training = config.training
    order = compare_sample_order(MEGATRON.sample_order(training), MINDFORMERS.sample_order(training),
                                 run.dataset.prefix, training.global_batch_size,
                                 batches=min(PREFLIGHT_BATCHES, training.train_iters))
    if not order.identical:
        raise PreflightFailed(f"sample order: {order.summary()}")
    logger.info(f"preflight: {order.summary()}")


@task(name="step", cache_policy=NO_CACHE, retry_condition_fn=retry_on_infrastructure)
def step_task(request: RunRequest, step: str, checksums: bool) -> dict[str, Any]:
    """One step of the (resolved) request's run: skipped if its manifest is valid, else carried out where the
    request's ``mode`` says.

    ``checksums`` (a retry or a rerun) also compares a finished step's outputs with their sha256;
    a damaged step is removed with everything downstream, so that its own flow run redoes it.
    """
    logger = get_run_logger()
    run = RunStore(request.store).run(request.run_id)
    timeout_s = request.step_timeout_s or step_timeout(run, step, load_site())
    damaged = run.damaged_outputs(step, checksums=checksums)  # read once: sha256 reads whole checkpoints
    if not damaged and run.is_done(step):
        manifest = run.manifest(step)
        logger.info(f"{step}: already done on {manifest['host']} ({manifest['seconds']:.1f} s); skipped")
        emit(StepEvent(step, "skipped", host=manifest["host"], seconds=manifest["seconds"]))
        return _brief(manifest)
    if damaged:
        removed = run.invalidate(step)
        logger.warning(f"{step}: outputs changed since the step was committed ({'; '.join(damaged)}); "
                       f"redoing {', '.join(removed)}")
    emit(StepEvent(step, "started"))
    reporter = StepReporter(step, run.run_id, logger)
    try:
        if request.mode == "embedded":
            manifest = execute_subprocess(run, step, reporter)
        else:
            manifest = execute_deployment(run, step, reporter, poll_interval=request.poll_interval_s,
                                          timeout_s=timeout_s)
    except (StepFailed, InfrastructureError) as exc:
        error = stop_error(run, step, exc)  # a training stopped early is not retried
        emit(StepEvent(step, "failed", message=str(error)))
        if error is not exc:
            raise error from exc
        raise
    emit(StepEvent(step, "done", host=manifest["host"], seconds=manifest["seconds"]))
    return _brief(manifest)


def _brief(manifest: dict[str, Any]) -> dict[str, Any]:
    return {key: manifest[key] for key in ("step", "host", "seconds", "finished")}


def _name_refused(run_id: str | None, config: str | None) -> None:
    """Name the flow run of a refused request as its run would have been named: its run id, else a new one from
    its config's model, when the config itself loads (the overrides may be what was refused)."""
    run_id, config = (run_id or "").strip(), (config or "").strip()
    if run_id:
        name_flow_run(run_id)
    elif config:
        try:
            name_flow_run(new_run_id(load_config(config).model.name))
        except ConfigError:
            pass


@flow(name="alignment")
def alignment(config: str | None = "qwen35_dense_tiny", run_id: str | None = None,
              overrides: list[str] | None = None, store: str | None = None, rerun: list[StepName] | None = None,
              mode: Mode = "distributed", dataset_prefix: str | None = None, tokenizer: str | None = None,
              retries: int = 2, retry_delay_s: float = 10.0, step_timeout_s: float | None = None,
              poll_interval_s: float = 0.5, from_hf: str | None = None, fail_fast: bool = True) -> State:
    """Run the six-step alignment of a model config; fails unless the verdict is "pass".

    The flow run is named after the run id; its final state message carries the verdict.

    Args:
        config: A shipped config (qwen35_dense, qwen35_dense_tiny, qwen35_moe, qwen35_moe_tiny) or
            the path of a config YAML on the orchestrator's machine. Empty: reopen the existing
            run_id as it was.
        run_id: The run in the store: resume it (finished steps are skipped). Empty: a new run
            named MODEL-YYYYMMDD-HHMMSS-XXXX (when it started, and four random hex digits), made
            once: a Retry of this flow run resumes it.
        overrides: Config changes, one KEY=VALUE per item, validated like the config file when
            the run starts (training.train_iters=10).
        store: The run store every agent mounts. Empty: the site config's store.
        rerun: Steps to redo, with everything downstream of them.
        mode: distributed: each step a flow run on its pool's workers; embedded: every step a
            local process with the CPU backends.
        dataset_prefix: A prepared Megatron dataset (prefix of .bin/.idx) instead of the shipped
            corpus; give the tokenizer with it.
        tokenizer: The tokenizer.json of dataset_prefix.
        retries: Attempts per step after an infrastructure failure (never after a bad input).
        retry_delay_s: Seconds before the first retry of a step, tripled for each further one.
        step_timeout_s: Give up on (and retry) a step whose flow run has run this many seconds.
            Empty: the site config's step_timeout_s, else an hour plus iteration_timeout_s
            for each iteration the step trains.
        poll_interval_s: Seconds between looks at a step's flow run.
        from_hf: A Hugging Face checkpoint folder (every agent's path) to start from: step 1
            imports it on the cpu pool instead of base training. Empty: base training.
        fail_fast: Stop both trainings (steps 4 and 5) as soon as what they logged cannot pass
            any more, and end the run fail (off here or in the site config: both always finish).
    """
    form = dict(locals())  # the form's fields are the request's own (tests/test_flow_units.py holds them equal)
    if not (run_id or "").strip():
        form["run_id"] = first_attempts_run_id()  # a retry resumes the run its first attempt started
    try:
        resolved = resolution(RunRequest(**form))
    except (ConfigError, StoreError) as exc:  # named as in the form
        _name_refused(form["run_id"], config)
        return failed(form_error(exc), cause=exc)
    name_flow_run(resolved.run_id)
    return align(resolved)


@flow(name="rerun", flow_run_name="{run_id}-rerun-{step}")
def rerun(run_id: str, step: StepName, store: str | None = None, mode: Mode | None = None, retries: int = 2,
          retry_delay_s: float = 10.0, step_timeout_s: float | None = None, poll_interval_s: float = 0.5,
          dump: bool = False, dump_step: int | None = None, dump_level: DumpLevel | None = None,
          dump_task: DumpTask | None = None) -> State:
    """Redo one step of a run and everything downstream of it; finished upstream steps are skipped.

    The steps run with the run's config; ``crossalign rerun RUN --step STEP`` runs this flow too.

    Args:
        run_id: The run in the store to redo part of.
        step: The step to redo; every step that reads from it is redone too.
        store: The run store every agent mounts. Empty: the site config's store.
        mode: distributed (each step a flow run on its pool's workers) or embedded (local processes).
            Empty: the way the run was started.
        retries: Attempts per step after an infrastructure failure (never after a bad input).
        retry_delay_s: Seconds before the first retry of a step, tripled for each further one.
        step_timeout_s: Give up on (and retry) a step whose flow run has run this many seconds.
            Empty: the site config's step_timeout_s, else an hour plus iteration_timeout_s
            for each iteration the step trains.
        poll_interval_s: Seconds between looks at a step's flow run.
        dump: The redone alignment trainings (megatron-train, pynative-train) take msprobe dumps with the site's
            diagnose.dump (default settings without one), changed by dump_step, dump_level and dump_task, into each
            step's msprobe_dump folder.
        dump_step: With dump: the iteration to dump, from 0. Empty: the site's diagnose.dump.step.
        dump_level: With dump: L0 (modules) or mix (modules and APIs). Empty: the site's.
        dump_task: With dump: statistics, md5 or tensor. Empty: the site's.
    """
    options = dict(locals())  # the form's fields are the request's own, but for step, mode and the dump's
    for name in ("step", "mode", "dump", "dump_step", "dump_level", "dump_task"):
        del options[name]
    site = load_site()
    try:
        root = RunStore(store or site.store)
        run = root.run(run_id)
        settings = rerun_dump(site.diagnose.dump, dump, {"step": dump_step, "level": dump_level, "task": dump_task},
                              option="dump", separator="_")
        request_dumps(run, downstream(step), settings)
    except (StoreError, ValueError) as exc:  # named as in the form
        return failed(str(exc).replace("--dump", "dump"), cause=exc)
    resolved = RunRequest(**{**options, "config": None, "store": str(root.root), "rerun": [step],
                             "mode": mode or run.info["parameters"].get("mode", "distributed")}).resolve()
    return align(resolved)


def align(resolved: ResolvedRequest) -> State:
    """The DAG of a resolved request in the current flow run (alignment, rerun): Completed with a passing verdict,
    Failed with any other (an expected outcome, told in the state message, not an exception); raises when a step
    failed. The state's data is the outcome: run_id, verdict, report (and report_dir, summary)."""
    logger = get_run_logger()
    request = resolved.request
    root = str(resolved.store.root)
    run_id = prepare(resolved)
    preflight(root, run_id)
    clear_live(RunStore(root).run(run_id))  # an earlier flow run's stop request must not stop this one

    # on a retry or a rerun, outputs may have been damaged since they were committed
    checksums = bool(request.rerun) or (current_flow_run.run_count or 1) > 1
    launcher = step_task.with_options(retries=request.retries,
                                      retry_delay_seconds=backoff_delays(request.retry_delay_s, request.retries))
    futures: dict[str, Any] = {}
    for spec in STEPS:
        # the task's own name too: Prefect names a task run that waits for its inputs after its task
        futures[spec.name] = launcher.with_options(name=spec.name, task_run_name=spec.name).submit(
            request, spec.name, checksums, wait_for=[futures[name] for name in spec.inputs])
    stopped = watch_training(RunStore(root).run(run_id), futures, mode=request.mode,
                             poll_interval_s=request.poll_interval_s,
                             fail_fast=request.fail_fast and load_site().fail_fast, logger=logger)
    wait(list(futures.values()))

    run = RunStore(root).run(run_id)
    create_table_artifact(steps_table(run), key="alignment-steps", description=f"run {run_id} in {run.path}")
    refusal = read_refusal(run)
    if refusal is not None:  # a training step refused its machine: invalid, whatever else ended how
        return refused_outcome(run, refusal, logger)
    if stopped is not None and stopped.rule != "failed":  # a failed side is told by its own error below
        return stopped_outcome(run, stopped, logger)
    for spec in STEPS:
        state = futures[spec.name].state
        if state.is_failed() or state.is_crashed():
            futures[spec.name].result()  # re-raises the step's own error
    for spec in STEPS:
        if not run.is_done(spec.name):
            raise StepFailed(spec.name, f"did not run: {futures[spec.name].state.message or 'an input failed'}")

    summary = publish_compare(run, logger)
    verdict = summary.get("verdict")
    report = run.step_dir("compare") / "report.html"
    where = run_url(run, report) or str(report)
    # the URL is followed by a space: Prefect's log view links a URL up to whitespace, ")" or a quote, and
    # its engine line quotes the message (Completed('...')), so a URL at the end would link with the quote
    reasons = summary.get("reasons") or []
    judged = [name for name in summary.get("series", {}) if name == "lm_loss" or name.startswith("mtp_")]
    said = [str(reason) for reason in reasons] if verdict != "pass" and reasons else [f"judged {', '.join(judged)}"]
    message = f"run {run_id}: verdict {verdict}; report {where} ({'; '.join(said)})"
    logger.info(message)
    outcome = {"run_id": run_id, "verdict": verdict, "report_dir": str(run.step_dir("compare")), "report": where,
               "summary": summary}
    if verdict != "pass":
        return failed(message, outcome)
    return Completed(message=message, data=outcome)
