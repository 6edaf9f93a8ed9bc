"""The alignment flow: the six-step DAG, embedded (one machine) or distributed (one pool per step).

    1 base-train (npu) -> 2 cast-bf16 (cpu) -> 3 convert (cpu) -> 4 megatron-train (gpu)
                                   2 -> 5 pynative-train (npu);    4 + 5 -> 6 compare (cpu)

The flow itself decides nothing about the work: it prepares the run, checks the configs, then
submits each step once its inputs are done, skipping steps whose manifests are already valid.
A retried flow run (UI Retry) or a new run with the same run id therefore resumes where it
stopped. Infrastructure failures are retried with backoff, deterministic ones are not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import wait
from prefect.runtime import flow_run as current_flow_run

from crossalign.backends.base import DatasetFiles
from crossalign.backends.preflight import preflight_config
from crossalign.config import ConfigError
from crossalign.data.order import side_settings
from crossalign.data.preflight import compare_sample_order
from crossalign.flows.events import StepEvent, emit
from crossalign.flows.launch import execute_deployment, execute_subprocess
from crossalign.flows.reporting import StepReporter
from crossalign.flows.retry import backoff_delays, retry_on_infrastructure
from crossalign.flows.summary import publish_compare, steps_table
from crossalign.site import load_site
from crossalign.store import STEPS, RunStore, step_spec
from crossalign.tasks.errors import InfrastructureError, PreflightFailed, StepFailed, VerdictFailed
from crossalign.tasks.prepare import prepare_run, resolve_config

Mode = Literal["distributed", "embedded"]
PREFLIGHT_BATCHES = 3  # global batches whose token digests must agree between the two sides


@task(name="prepare-run", task_run_name="prepare-run", cache_policy=NO_CACHE)
def prepare(store: str, config: str | None, run_id: str, overrides: list[str], dataset: DatasetFiles | None,
            rerun: list[str], mode: str) -> str:
    """Create or reopen the run, settle its dataset, and invalidate the steps asked to rerun (once per flow run).

    Without ``config`` the run must exist and is reopened as it was.
    """
    logger = get_run_logger()
    if config is None:
        run = RunStore(store).run(run_id)
    else:
        run = prepare_run(RunStore(store), config, run_id=run_id, overrides=overrides, dataset=dataset, mode=mode)
    logger.info(f"run {run.run_id} in {run.path} (dataset {run.dataset.prefix})")
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
    order = compare_sample_order(side_settings("megatron", training), side_settings("mindformers", training),
                                 run.dataset.prefix, training.global_batch_size,
                                 batches=min(PREFLIGHT_BATCHES, training.train_iters))
    if not order.identical:
        raise PreflightFailed(f"sample order: {order.summary()}")
    logger.info(f"preflight: {order.summary()}")


@task(name="step", cache_policy=NO_CACHE, retry_condition_fn=retry_on_infrastructure)
def step_task(store: str, run_id: str, step: str, mode: Mode, poll_interval_s: float,
              timeout_s: float | None) -> dict[str, Any]:
    """One step: skipped if its manifest is valid, else carried out where ``mode`` says."""
    logger = get_run_logger()
    run = RunStore(store).run(run_id)
    if run.is_done(step):
        manifest = run.manifest(step)
        logger.info(f"{step}: already done on {manifest['host']} ({manifest['seconds']:.1f} s); skipped")
        emit(StepEvent(step, "skipped", host=manifest["host"], seconds=manifest["seconds"]))
        return _brief(manifest)
    emit(StepEvent(step, "started"))
    reporter = StepReporter(step, run_id, logger)
    try:
        if mode == "embedded":
            manifest = execute_subprocess(run, step, reporter)
        else:
            manifest = execute_deployment(run, step, reporter, poll_interval=poll_interval_s, timeout_s=timeout_s)
    except (StepFailed, InfrastructureError) as exc:
        emit(StepEvent(step, "failed", message=str(exc)))
        raise
    emit(StepEvent(step, "done", host=manifest["host"], seconds=manifest["seconds"]))
    return _brief(manifest)


def _brief(manifest: dict[str, Any]) -> dict[str, Any]:
    return {key: manifest[key] for key in ("step", "host", "seconds", "finished")}


@flow(name="alignment")
def alignment(config: str | None = "qwen35_dense_tiny", run_id: str | None = None, overrides: list[str] | None = None,
              store: str | None = None, rerun: list[str] | None = None, mode: Mode = "distributed",
              dataset_prefix: str | None = None, tokenizer: str | None = None, retries: int = 2,
              retry_delay_s: float = 10.0, step_timeout_s: float | None = None,
              poll_interval_s: float = 0.5) -> dict[str, Any]:
    """Run the six-step alignment of ``config`` and return its summary; fails unless the verdict is "pass".

    ``config`` is a shipped config name or a YAML path (None: reopen the existing ``run_id``);
    ``rerun`` names steps to redo with everything downstream; ``overrides`` are ``KEY=VALUE``
    config changes (``training.train_iters=10``); ``mode`` "embedded" runs every step as a local
    process with the CPU backends, "distributed" as flow runs of the step deployments.
    """
    from prefect.artifacts import create_table_artifact

    logger = get_run_logger()
    for name in rerun or []:
        step_spec(name)
    if (dataset_prefix is None) != (tokenizer is None):
        raise ConfigError("dataset_prefix and tokenizer go together: give both or neither")
    dataset = None if dataset_prefix is None else DatasetFiles(Path(dataset_prefix), Path(tokenizer))
    root = str(RunStore(store or load_site().store).root)
    if run_id is None:
        if config is None:
            raise ConfigError("give a config, or the run_id of an existing run to reopen")
        run_id = f"{resolve_config(config, overrides or [])[0].model.name}-{str(current_flow_run.get_id())[:8]}"
    run_id = prepare(root, config, run_id, list(overrides or []), dataset, list(rerun or []), mode)
    preflight(root, run_id)

    launcher = step_task.with_options(retries=retries, retry_delay_seconds=backoff_delays(retry_delay_s, retries))
    futures: dict[str, Any] = {}
    for spec in STEPS:
        futures[spec.name] = launcher.with_options(task_run_name=spec.name).submit(
            root, run_id, spec.name, mode, poll_interval_s, step_timeout_s,
            wait_for=[futures[name] for name in spec.inputs])
    wait(list(futures.values()))

    run = RunStore(root).run(run_id)
    create_table_artifact(steps_table(run), key="alignment-steps", description=f"run {run_id} in {run.path}")
    for spec in STEPS:
        state = futures[spec.name].state
        if state.is_failed() or state.is_crashed():
            futures[spec.name].result()  # re-raises the step's own error
    for spec in STEPS:
        if not run.is_done(spec.name):
            raise StepFailed(spec.name, f"did not run: {futures[spec.name].state.message or 'an input failed'}")

    summary = publish_compare(run, logger)
    verdict = summary.get("verdict")
    logger.info(f"run {run_id}: verdict {verdict}; report in {run.step_dir('compare')}")
    if verdict != "pass":
        raise VerdictFailed(str(verdict), f"run {run_id}: verdict {verdict} (see {run.step_dir('compare')})")
    return {"run_id": run_id, "verdict": verdict, "report_dir": str(run.step_dir("compare")), "summary": summary}
