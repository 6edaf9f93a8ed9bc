"""What a finished run shows in Prefect: the verdict and report of step 6, and a table of the steps."""

from __future__ import annotations

import json
from typing import Any

from pathlib import Path

from crossalign.report.artifacts import publish_artifacts
from crossalign.report.units import duration_text, size_text
from crossalign.report.serve import store_url
from crossalign.site import load_site
from crossalign.store import Run
from crossalign.tasks.compare import SUMMARY


def run_url(run: Run, path: Path) -> str | None:
    """The address of a file of ``run`` on the site's report server, or None where the site names none."""
    return store_url(load_site().report_url, run.store.root, path)


def publish_compare(run: Run, logger) -> dict[str, Any]:
    """Read the verdict of step 6 and publish its report as Prefect artifacts (the parent's, once)."""
    out_dir = run.step_dir("compare")
    summary = json.loads((out_dir / SUMMARY).read_text())
    try:
        publish_artifacts(summary, out_dir, url_of=lambda path: run_url(run, path))
    except Exception as exc:  # a report that cannot be shown in the UI must not hide the verdict
        logger.warning(f"compare: artifacts not published: {exc}")
    return summary


def steps_table(run: Run) -> list[dict[str, Any]]:
    rows = []
    for state in run.states():
        outputs = (state.manifest or {}).get("outputs", [])
        rows.append({"step": state.spec.dirname, "pool": run.pool(state.spec.name), "state": state.status,
                     "host": state.host, "time": duration_text(state.seconds),
                     "outputs": len(outputs), "size": size_text(sum(o["size"] for o in outputs)) if outputs else ""})
    return rows
