"""Step 6 (cpu): compare the lm and mtp losses of steps 4 and 5 and write the verdict, plots and report."""

from __future__ import annotations

from typing import Any

from crossalign.dag import StepSpec
from crossalign.report.compare import DAG_LOG_INTERVAL, TRAINED_ON, compare_logs, options_from_config
from crossalign.sides.protocol import StepCallback
from crossalign.site import SiteConfig
from crossalign.store import Run, write_json_atomic
from crossalign.tasks.command import step_command

SUMMARY = "summary.json"


def compare(run: Run, spec: StepSpec, site: SiteConfig, on_step: StepCallback | None = None) -> dict[str, Any]:
    """Commit the comparison whatever its verdict: a failed verdict is a finished result, not a failed step.

    The run's config says what the logs must show: the core version, train_iters steps, MTP and the
    MoE aux loss when the model has them, and the graph-mode MTP factor. The step's inputs are the
    two trainings, one per pool: the npu one is the MindFormers side, the gpu one the Megatron side.
    """
    trainings = {run.spec(name).pool: name for name in spec.inputs}
    manifests = {pool: run.manifest(name) or {} for pool, name in trainings.items()}
    logs = {pool: run.step_dir(name) / manifests[pool].get("details", {}).get("log", "train.log")
            for pool, name in trainings.items()}
    npu, gpu = manifests["npu"], manifests["gpu"]
    with run.commit(spec.name, command=step_command(run, spec.name)) as out:
        verified = gpu.get("details", {}).get("loaded_tensors_verified")
        options = options_from_config(
            run.config, log_interval=DAG_LOG_INTERVAL,
            load_verified=f"the {trainings['gpu']} step's load digest held all {verified} loaded tensors against its "
                          "checkpoint" if verified else None)
        implementations = {pool: manifest["details"]["implementation"]
                           for pool, manifest in (("npu", npu), ("gpu", gpu))
                           if manifest.get("details", {}).get("implementation")}
        trained_on = {pool: {key: manifest["details"][key] for key in TRAINED_ON if key in manifest["details"]}
                      for pool, manifest in (("npu", npu), ("gpu", gpu)) if manifest.get("details")}
        flow_run = run.info.get("prefect_flow_run") or {}
        summary = compare_logs(logs["npu"], logs["gpu"], out.dir, options, implementations=implementations,
                               trained_on=trained_on, run_link={"run_id": run.run_id, "url": flow_run.get("url")})
        data = summary.to_dict()
        if not (out.dir / SUMMARY).exists():
            write_json_atomic(out.dir / SUMMARY, data)
        out.details.update(verdict=summary.verdict, summary=SUMMARY)
    return run.manifest(spec.name)
