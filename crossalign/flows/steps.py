"""The step flow: the deployable unit, deployed once per step on the pool of its hardware (prefect.yaml).

A step's flow run runs on a worker of its pool, reads the run from the shared store, and carries the
step out in its own process as the run's spec of it says (``crossalign.dag``; a real backend may
still run its framework on an SSH host). The report of step 6 is published by the parent, which
shows it. A step flow is idempotent: a step whose manifest is valid is reported as done without
redoing it, so a duplicate or retried flow run is harmless. A failure is recorded in the store with
whether another attempt could help; the parent reads it to decide on a retry.

A torch_dist convert step spread over the cpu pool (site ``convert_parts``) starts its parts as
``convert-part`` flow runs, which the pool's workers run at the same time, waits for them, and then
writes the index (``crossalign.tasks.convert``).
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run as current_flow_run

from crossalign.dag import StepName
from crossalign.flows.launch import STEP_FLOW, execute_convert_parts, execute_here
from crossalign.flows.reporting import StepReporter
from crossalign.site import load_site
from crossalign.store import RunStore
from crossalign.tasks.errors import InfrastructureError, StepFailed


@flow(name=STEP_FLOW)
def step_flow(step: StepName, run_id: str, store: str | None = None, force: bool = False) -> dict[str, Any]:
    """Carry out one step of a run (each deployment of this flow names its step and runs on that step's pool).

    Args:
        step: The step: base-train (or, for a run started from Hugging Face weights, their import),
            cast-bf16, convert, megatron-train, pynative-train or compare.
        run_id: The run in the store.
        store: The run store every agent mounts. Empty: the site config's store.
        force: Redo the step even if it is done, invalidating everything downstream of it.
    """
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
    spec = run.spec(step)
    logger.info(f"{step} ({spec.title}) of run {run_id} on the {spec.pool} pool, store {run.store.root}")
    try:
        reporter = StepReporter(step, run_id, logger)
        if step == "convert" and site.convert_parts > 1 and run.config.training.megatron_ckpt_format == "torch_dist":
            execute_convert_parts(run, site.convert_parts, reporter, token=str(current_flow_run.get_id()))
        manifest = execute_here(run, step, site, reporter)
    except (StepFailed, InfrastructureError) as exc:
        attempt = run.attempt(step) or {}
        if attempt.get("status") != "failed":  # failed before the store could record it (e.g. an input not ready)
            run.record_failure(step, str(exc), retryable=isinstance(exc, InfrastructureError))
        raise
    logger.info(f"{step}: done in {manifest['seconds']:.1f} s, {len(manifest['outputs'])} outputs")
    return {"step": step, "status": "done", "host": manifest["host"], "seconds": manifest["seconds"]}


@flow(name="convert-part", flow_run_name="{run_id}-convert-part-{part}-of-{parts}")
def convert_part_flow(run_id: str, part: int, parts: int, store: str | None = None) -> dict[str, Any]:
    """Write one part (a range of layers) of a run's torch_dist conversion into the run's parts folder, for the
    convert step to finish (its flow run starts the parts, each on any worker of the cpu pool).

    Args:
        run_id: The run in the store.
        part: This part, from 0.
        parts: How many parts the conversion is spread over.
        store: The run store every agent mounts. Empty: the site config's store.
    """
    from crossalign.tasks.convert import convert_part

    logger = get_run_logger()
    run = RunStore(store or load_site().store).run(run_id)
    reporter = StepReporter("convert", run_id, logger)
    done = convert_part(run, run.spec("convert"), part, parts, on_step=reporter.on_step)
    logger.info(f"convert part {part} of {parts}: {done['bytes_out'] / 1e9:.2f} GB in {done['seconds']:.1f} s "
                f"into {', '.join(done['files'])}")
    return done
