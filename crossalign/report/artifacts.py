"""Show a comparison in the Prefect UI: the report as markdown, the metrics as a table, a link to the HTML,
and the loss plot as an image when the report server publishes the store (the site's ``report_url``).

Called by the compare step of the flow; outside a flow or task run it does nothing, so the
same step function runs unchanged from the CLI.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

REPORT_KEY = "compare-report"
METRICS_KEY = "compare-metrics"
LINK_KEY = "compare-report-link"
PLOT_KEY = "compare-loss-plot"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.4g}%"


def metrics_table(summary: Mapping) -> list[dict[str, object]]:
    """One row per series of a summary.json dict, errors as percentages."""
    rows = []
    for name, m in summary["series"].items():
        rows.append({
            "series": name, "status": m["status"], "steps": m["steps_compared"],
            "step1_rel_err": _pct(m["step1_rel_err"]), "mean_rel_err": _pct(m["mean_rel_err"]),
            "median_rel_err": _pct(m["median_rel_err"]), "max_rel_err": _pct(m["max_rel_err"]),
            "pearson": "n/a" if m["pearson"] is None else round(m["pearson"], 6),
            "comove": "n/a" if m.get("comove") is None else round(m["comove"], 6),
            "first_bad_step": m["first_bad_step"], "passed": m["passed"],
        })
    return rows


def _no_url(path: Path) -> str | None:
    return None


def publish_artifacts(summary, out_dir: Path, url_of: Callable[[Path], str | None] = _no_url) -> None:
    """Create the artifacts for a ``Summary`` (or its ``to_dict()``) whose report is in ``out_dir``.

    ``url_of`` gives a file's address on the report server; without one the link names the file
    (which a browser will not open from a web page) and the plot is named, not shown.
    """
    # Prefect loads in seconds: imported only where its API is called
    from prefect.context import FlowRunContext, TaskRunContext

    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        return
    # Prefect loads in seconds: imported only where its API is called
    from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

    data = summary if isinstance(summary, Mapping) else summary.to_dict()
    out_dir = Path(out_dir).resolve()
    report = out_dir / "report.md"
    markdown = report.read_text(encoding="utf-8") if report.exists() else f"# verdict: {data['verdict']}\n"
    plot_url, report_url = url_of(out_dir / "loss.png"), url_of(out_dir / "report.html")
    # the UI cannot load a relative image: its address on the report server, else the file's name
    markdown = markdown.replace("![losses and relative errors](loss.png)",
                                f"![losses and relative errors]({plot_url})" if plot_url
                                else f"plot: `{out_dir / 'loss.png'}`")
    description = f"verdict: {data['verdict']}"
    create_markdown_artifact(markdown=markdown, key=REPORT_KEY, description=description)
    create_table_artifact(table=metrics_table(data), key=METRICS_KEY, description=description)
    create_link_artifact(link=report_url or (out_dir / "report.html").as_uri(), link_text="report.html",
                         key=LINK_KEY, description=description)
    if plot_url and (out_dir / "loss.png").exists():
        # Prefect loads in seconds: imported only where its API is called
        from prefect.artifacts import create_image_artifact

        create_image_artifact(image_url=plot_url, key=PLOT_KEY, description=f"{description}: losses and errors")
