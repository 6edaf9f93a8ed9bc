"""One flow per step: the deployable units, each deployed on its own work pool (prefect.yaml).

A step flow runs on a worker of its pool, reads the run from the shared store, and carries the
step out in its own process (the report of step 6 is published by the parent, which shows it) (a real backend may still run its framework on an SSH host). It is
idempotent: a step whose manifest is valid is reported as done without redoing it, so a
duplicate or retried flow run is harmless. A failure is recorded in the store with whether another attempt could help; the
parent reads it to decide on a retry.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from crossalign.flows.launch import execute_here
from crossalign.flows.reporting import StepReporter
from crossalign.site import load_site
from crossalign.store import RunStore, step_spec
from crossalign.tasks.errors import InfrastructureError, StepFailed


def execute_step_flow(step: str, run_id: str, store: str | None, force: bool) -> dict[str, Any]:
    """The body of every step flow; ``force`` first invalidates the step and everything downstream."""
    logger = get_run_logger()
    site = load_site()
    run = RunStore(store or site.store).run(run_id)
    if force:
        removed = run.invalidate(step)
        logger.info(f"{step}: forced; invalidated {', '.join(removed) or 'nothing'}")
    if run.is_done(step):
        manifest = run.manifest(step)
        logger.info(f"{step}: already done on {manifest['host']}; nothing to do")
        return {"step": step, "status": "skipped", "host": manifest["host"]}
    spec = step_spec(step)
    title = "import of Hugging Face weights" if run.pool(step) != spec.pool else spec.title
    logger.info(f"{step} ({title}) of run {run_id} on the {run.pool(step)} pool, store {run.store.root}")
    try:
        manifest = execute_here(run, step, site, StepReporter(step, run_id, logger))
    except (StepFailed, InfrastructureError) as exc:
        attempt = run.attempt(step) or {}
        if attempt.get("status") != "failed":  # failed before the store could record it (e.g. an input not ready)
            run.record_failure(step, str(exc), retryable=isinstance(exc, InfrastructureError))
        raise
    logger.info(f"{step}: done in {manifest['seconds']:.1f} s, {len(manifest['outputs'])} outputs")
    return {"step": step, "status": "done", "host": manifest["host"], "seconds": manifest["seconds"]}


@flow(name="base-train")
def base_train_flow(run_id: str, store: str | None = None, force: bool = False) -> dict[str, Any]:
    """Step 1 (npu): base training from a random init; saves the MindFormers checkpoint.

    Args:
        run_id: The run in the store.
        store: The run store every agent mounts. Empty: the site config's store.
        force: Redo the step even if it is done, invalidating everything downstream of it.
    """
    return execute_step_flow("base-train", run_id, store, force)


@flow(name="cast-bf16")
def cast_bf16_flow(run_id: str, store: str | None = None, force: bool = False) -> dict[str, Any]:
    """Step 2 (cpu): cast the base checkpoint to bf16.

    Args:
        run_id: The run in the store.
        store: The run store every agent mounts. Empty: the site config's store.
        force: Redo the step even if it is done, invalidating everything downstream of it.
    """
    return execute_step_flow("cast-bf16", run_id, store, force)


@flow(name="convert")
def convert_flow(run_id: str, store: str | None = None, force: bool = False) -> dict[str, Any]:
    """Step 3 (cpu): convert the bf16 MindFormers checkpoint to Megatron.

    Args:
        run_id: The run in the store.
        store: The run store every agent mounts. Empty: the site config's store.
        force: Redo the step even if it is done, invalidating everything downstream of it.
    """
    return execute_step_flow("convert", run_id, store, force)


@flow(name="megatron-train")
def megatron_train_flow(run_id: str, store: str | None = None, force: bool = False) -> dict[str, Any]:
    """Step 4 (gpu): Megatron training from the converted checkpoint.

    Args:
        run_id: The run in the store.
        store: The run store every agent mounts. Empty: the site config's store.
        force: Redo the step even if it is done, invalidating everything downstream of it.
    """
    return execute_step_flow("megatron-train", run_id, store, force)


@flow(name="pynative-train")
def pynative_train_flow(run_id: str, store: str | None = None, force: bool = False) -> dict[str, Any]:
    """Step 5 (npu): MindFormers pynative training from the bf16 checkpoint.

    Args:
        run_id: The run in the store.
        store: The run store every agent mounts. Empty: the site config's store.
        force: Redo the step even if it is done, invalidating everything downstream of it.
    """
    return execute_step_flow("pynative-train", run_id, store, force)


@flow(name="compare")
def compare_flow(run_id: str, store: str | None = None, force: bool = False) -> dict[str, Any]:
    """Step 6 (cpu): compare the two training logs; the verdict is in the run's 06-compare/summary.json.

    Args:
        run_id: The run in the store.
        store: The run store every agent mounts. Empty: the site config's store.
        force: Redo the step even if it is done, invalidating everything downstream of it.
    """
    return execute_step_flow("compare", run_id, store, force)


STEP_FLOWS = {
    "base-train": base_train_flow,
    "cast-bf16": cast_bf16_flow,
    "convert": convert_flow,
    "megatron-train": megatron_train_flow,
    "pynative-train": pynative_train_flow,
    "compare": compare_flow,
}
