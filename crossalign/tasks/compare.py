"""Step 6 (cpu): compare the lm and mtp losses of steps 4 and 5 and write the verdict, plots and report."""

from __future__ import annotations

from typing import Any

from crossalign.site import SiteConfig
from crossalign.store import Run, write_json_atomic
from crossalign.tasks.command import step_command

STEP = "compare"
SUMMARY = "summary.json"


def compare(run: Run, site: SiteConfig | None = None) -> dict[str, Any]:
    """Commit the comparison whatever its verdict: a failed verdict is a finished result, not a failed step.

    The run's config says what the logs must show: the core version, train_iters steps, MTP and the
    MoE aux loss when the model has them, and the graph-mode MTP factor.
    """
    from crossalign.report.compare import DAG_LOG_INTERVAL, compare_logs, options_from_config

    npu = run.manifest("pynative-train") or {}
    gpu = run.manifest("megatron-train") or {}
    npu_log = run.step_dir("pynative-train") / npu.get("details", {}).get("log", "train.log")
    gpu_log = run.step_dir("megatron-train") / gpu.get("details", {}).get("log", "train.log")
    with run.commit(STEP, command=step_command(run, STEP)) as out:
        verified = gpu.get("details", {}).get("loaded_tensors_verified")
        options = options_from_config(
            run.config, log_interval=DAG_LOG_INTERVAL,
            load_verified=f"the megatron-train step's load digest held all {verified} loaded tensors against its "
                          "checkpoint" if verified else None)
        implementations = {side: manifest["details"]["implementation"]
                           for side, manifest in (("npu", npu), ("gpu", gpu))
                           if manifest.get("details", {}).get("implementation")}
        flow_run = run.info.get("prefect_flow_run") or {}
        summary = compare_logs(npu_log, gpu_log, out.dir, options, implementations=implementations,
                               run_link={"run_id": run.run_id, "url": flow_run.get("url")})
        data = summary.to_dict()
        if not (out.dir / SUMMARY).exists():
            write_json_atomic(out.dir / SUMMARY, data)
        out.details.update(verdict=summary.verdict, summary=SUMMARY)
    return run.manifest(STEP)
