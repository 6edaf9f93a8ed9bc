"""A run whose training step refused its machine (``crossalign.stop.record_refusal``): verdict ``invalid``, with the reason in
the flow run's final state message, a Prefect artifact and a report (``live/report.html``), never ``fail``."""

from __future__ import annotations

from typing import Any

import pandas as pd
from prefect.artifacts import create_markdown_artifact
from prefect.context import FlowRunContext

from crossalign.dag import step_spec
from crossalign.flows.outcome import failed
from crossalign.flows.summary import run_url
from crossalign.report.metrics import LrCheck
from crossalign.report.render import write_outputs
from crossalign.report.summary import Summary
from crossalign.stop import STOPPABLE, kept_log_path, live_dir
from crossalign.store import Run

REFUSED_KEY = "alignment-refused"


def refused_summary(run: Run, refusal: dict[str, Any]) -> Summary:
    """The report's content: the refusal as its reason, what was measured as its notes, no series."""
    inputs = {}
    for step in STOPPABLE:
        kept = kept_log_path(run, step)
        side = step_spec(step).pool
        inputs[side] = {"path": str(kept) if kept.is_file() else f"none ({step} logged nothing)",
                        "format": "megatron" if side == "gpu" else "mindformers"}
    if "device" in refusal:
        inputs[step_spec(refusal["step"]).pool]["device"] = refusal["device"]
    return Summary(verdict="invalid", reasons=[refusal["reason"]], diagnosis=[],
                   notes=[f"{refusal['step']} refused its machine before its first step; what it found:",
                          *refusal.get("details", [])],
                   gold_standard=False, series={}, lr=LrCheck("not_logged"), inputs=inputs, criteria={},
                   coverage={"compared": 0, "expected": run.config.training.train_iters,
                             "basis": f"{refusal['step']} stopped before training"})


def refused_outcome(run: Run, refusal: dict[str, Any], logger: Any):
    """The run's final state (Failed, verdict invalid in its message), its report and its artifact."""
    folder = live_dir(run)
    report = None
    flow_run = run.info.get("prefect_flow_run") or {}
    try:
        nothing = pd.DataFrame({"step": pd.Series(dtype=int), "logged_npu": pd.Series(dtype=bool),
                                "logged_gpu": pd.Series(dtype=bool)})
        write_outputs(refused_summary(run, refusal), nothing, folder, plot=False,
                      run_link={"run_id": run.run_id, "url": flow_run.get("url")})
        report = run_url(run, folder / "report.html") or str(folder / "report.html")
    except Exception as exc:  # a report that cannot be written must not hide the verdict
        logger.warning(f"refused: report not written in {folder}: {type(exc).__name__}: {exc}")
    where = f"; report {report} " if report else " "  # a space after the URL (flows/alignment.py says why)
    message = f"run {run.run_id}: verdict invalid{where}({refusal['reason']})"
    logger.warning(message)
    if FlowRunContext.get() is not None:
        try:
            create_markdown_artifact("\n".join([
                f"# Run {run.run_id}: INVALID", "", f"**{refusal['reason']}**", "",
                f"{refusal['step']} refused its machine before its first step: the losses it would log could not "
                "tell whether the alignment holds. What it found:", "",
                *[f"- `{line}`" for line in refusal.get("details", [])], "",
                f"Report: {report or 'not written'}"]), key=REFUSED_KEY, description=refusal["reason"])
        except Exception as exc:  # the display must never fail the run
            logger.warning(f"refused: artifact not published: {exc}")
    return failed(message, {"run_id": run.run_id, "verdict": "invalid", "report": report,
                            "reasons": [refusal["reason"]], "stopped_early": refusal})
