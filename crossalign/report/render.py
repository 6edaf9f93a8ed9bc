"""Write a comparison's outputs: summary.json, steps.csv, loss.png, report.html, report.md.

Everything is written into a temporary sibling of the output folder first and moved in only
when complete (summary.json last), so a reader never sees half a report.
"""

from __future__ import annotations

import base64
import contextlib
import html
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from crossalign.report.summary import Summary
from crossalign.report.metrics import GOLD_LIMIT, MEAN_LIMIT, STEP1_LIMIT

FILES = {"summary": "summary.json", "steps": "steps.csv", "plot": "loss.png",
         "html": "report.html", "markdown": "report.md"}
METRIC_COLUMNS = ("status", "steps_compared", "step1_rel_err", "mean_rel_err", "median_rel_err", "max_rel_err",
                  "pearson", "comove", "first_bad_step", "passed", "gold")
ZERO_FLOOR = 1e-9  # exact agreement drawn here on the log axis


def steps_table(summary: Summary, merged: pd.DataFrame) -> pd.DataFrame:
    """Per-step values of both sides, their relative errors and the applied lrs (steps either log holds)."""
    rows = merged[merged["logged_npu"] | merged["logged_gpu"]]
    cols = ["step"]
    for name in summary.series:
        cols += [f"{name}_npu", f"{name}_gpu", f"{name}_rel_err"]
    cols += [c for c in ("lr_applied_npu", "lr_applied_gpu") if c in rows.columns]
    return rows[cols]


def _fmt(value, percent: bool = False) -> str:
    if value is None or (isinstance(value, float) and not np.isfinite(value)):
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if percent:
        return f"{100 * value:.4g}%"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def metric_rows(summary: Summary) -> list[dict[str, str]]:
    """One row per series with the metrics formatted for people (percentages); shared by all renderings."""
    rows = []
    for name, m in summary.series.items():
        d = m.to_dict()
        rows.append({"series": name, **{c: _fmt(d[c], percent=c.endswith("rel_err")) for c in METRIC_COLUMNS}})
    return rows


def _decimate(x: np.ndarray, y: np.ndarray, buckets: int = 2000) -> tuple[np.ndarray, np.ndarray]:
    """At most 2*buckets points: the min and max of each bucket, so spikes stay visible in long runs."""
    if len(x) <= 2 * buckets:
        return x, y
    edges = np.linspace(0, len(x), buckets + 1).astype(int)
    lo = np.minimum.reduceat(y, edges[:-1])
    hi = np.maximum.reduceat(y, edges[:-1])
    xs = x[edges[:-1]]
    return np.repeat(xs, 2), np.column_stack([lo, hi]).ravel()


def plot_losses(summary: Summary, merged: pd.DataFrame, path: Path) -> None:
    """Both curves per series (left) and the relative error on a log axis with the thresholds (right)."""
    # matplotlib: loaded only when a plot is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary.series)
    fig, axes = plt.subplots(len(names), 2, figsize=(13, 3.4 * len(names)), squeeze=False)
    steps = merged["step"].to_numpy()
    for row, name in enumerate(names):
        left, right = axes[row]
        for side, style in (("npu", "-"), ("gpu", "--")):
            values = merged[f"{name}_{side}"].to_numpy()
            keep = ~np.isnan(values)
            left.plot(*_decimate(steps[keep], values[keep]), style, linewidth=1, label=f"{side}")
        left.set_title(name)
        left.set_xlabel("step")
        left.legend(loc="upper right")
        rel = merged[f"{name}_rel_err"].to_numpy()
        keep = np.isfinite(rel)
        right.semilogy(*_decimate(steps[keep], np.maximum(rel[keep], ZERO_FLOOR)), linewidth=1, color="tab:purple",
                       label="|npu-gpu|/|gpu|")
        for limit, label, color in ((MEAN_LIMIT, "1% mean limit", "tab:red"),
                                    (STEP1_LIMIT, "0.5% step-1 limit", "tab:orange"),
                                    (GOLD_LIMIT, "0.005% gold", "tab:green")):
            right.axhline(limit, linestyle=":", color=color, linewidth=1, label=label)
        right.set_title(f"{name} relative error (0 drawn at {ZERO_FLOOR:g})")
        right.set_xlabel("step")
        right.legend(loc="upper right", fontsize="small")
    fig.suptitle(f"verdict: {summary.verdict}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _coverage(summary: Summary) -> str:
    c = summary.coverage
    return f"{c['compared']} of {c['expected']} expected steps compared ({c['basis']})"


def _list_md(items: list[str]) -> str:
    return "\n".join(f"- {item}" for item in items) if items else "- none"


def _ran(side: str, summary: Summary) -> str:
    """", trained by <implementation> on <device> (kernels: ...)" from what the run recorded about that side."""
    given = summary.inputs[side]
    text = f", trained by {given['implementation']}" if given.get("implementation") else ""
    if given.get("device"):
        name = given.get("device_name")
        text += f" on {given['device']}" + (f" ({name})" if name and name != given["device"] else "")
    if given.get("kernels"):
        text += " (kernels: " + ", ".join(f"{kind.replace('_', ' ')} {kernel}"
                                          for kind, kernel in given["kernels"].items()) + ")"
    return text


def render_markdown(summary: Summary, steps: pd.DataFrame, with_plot: bool, run_link: dict | None = None) -> str:
    rows = metric_rows(summary)
    header = list(rows[0]) if rows else ["series"]
    lines = [f"# crossalign comparison{_of_run(run_link)}: {summary.verdict.upper()}", "",
             *([f"[the run in Prefect]({run_link['url']})", ""] if run_link and run_link.get("url") else []),
             f"- npu log: `{summary.inputs['npu']['path']}` ({summary.inputs['npu']['format']}){_ran('npu', summary)}",
             f"- gpu log: `{summary.inputs['gpu']['path']}` ({summary.inputs['gpu']['format']}){_ran('gpu', summary)}",
             f"- gold standard (a pass with step-1 rel err < {GOLD_LIMIT * 100:g}%): {'yes' if summary.gold_standard else 'no'}",
             f"- coverage: {_coverage(summary)}",
             "", "## Reasons", _list_md(summary.reasons), "",
             "## Diagnosis", _list_md([d["message"] for d in summary.diagnosis]), "",
             "## Metrics", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r[c] for c in header) + " |" for r in rows]
    lr = summary.lr
    lines += ["", "## Learning rate", f"- {lr.status}: {lr.steps_compared} steps compared, "
              f"{lr.mismatched_steps} differ" + (f", first at step {lr.first_mismatch_step}" if lr.first_mismatch_step else "")]
    lines += ["", "## Notes", _list_md(summary.notes)]
    if with_plot:
        lines += ["", "## Curves", f"![losses and relative errors]({FILES['plot']})"]
    lines += ["", "## First steps", _frame_md(steps.head(10))]
    return "\n".join(lines) + "\n"


def _frame_md(frame: pd.DataFrame) -> str:
    header = "| " + " | ".join(frame.columns) + " |\n|" + "---|" * len(frame.columns)
    body = ["| " + " | ".join(_fmt(v.item() if hasattr(v, "item") else v,
                                   percent=str(c).endswith("rel_err")) for c, v in row.items()) + " |"
            for _, row in frame.iterrows()]
    return header + "\n" + "\n".join(body)


def _table_html(rows: list[dict[str, str]]) -> str:
    if not rows:
        return "<p>none</p>"
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in r.values()) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _frame_rows(frame: pd.DataFrame) -> list[dict[str, str]]:
    return [{c: _fmt(v.item() if hasattr(v, "item") else v, percent=str(c).endswith("rel_err"))
             for c, v in row.items()} for _, row in frame.iterrows()]


def _of_run(run_link: dict | None) -> str:
    return f" of run {run_link['run_id']}" if run_link else ""


def render_html(summary: Summary, steps: pd.DataFrame, png: bytes | None, run_link: dict | None = None) -> str:
    """The report page; ``run_link`` ({run_id, url}: the run of the store and its flow run in the Prefect UI)
    names the run in the heading and links back to the flow run."""
    color = {"pass": "#1a7f37", "fail": "#cf222e", "invalid": "#9a6700"}[summary.verdict]
    items = lambda xs: "<ul>" + "".join(f"<li>{html.escape(x)}</li>" for x in xs) + "</ul>" if xs else "<p>none</p>"  # noqa: E731
    worst = steps.nlargest(10, "lm_loss_rel_err") if "lm_loss_rel_err" in steps else steps.head(0)
    lr = summary.lr
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>crossalign comparison"
        f"{html.escape(_of_run(run_link))}</title><style>",
        "body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;margin:1em 0}",
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#f3f3f3}",
        f".verdict{{color:{color};font-size:2em;font-weight:bold}}code{{background:#f3f3f3}}",
        "</style></head><body>",
        *([f"<h1>run {html.escape(run_link['run_id'])}</h1>"] if run_link else []),
        *([f"<p><a href='{html.escape(run_link['url'])}'>the run in Prefect</a></p>"]
          if run_link and run_link.get("url") else []),
        f"<p class='verdict'>{summary.verdict.upper()}</p>",
        f"<p>npu log <code>{html.escape(summary.inputs['npu']['path'])}</code> "
        f"({html.escape(summary.inputs['npu']['format'])}){html.escape(_ran('npu', summary))}, "
        f"gpu log <code>{html.escape(summary.inputs['gpu']['path'])}"
        f"</code> ({html.escape(summary.inputs['gpu']['format'])}){html.escape(_ran('gpu', summary))}; gold standard (a pass with step-1 rel err &lt; "
        f"{GOLD_LIMIT * 100:g}%): {'yes' if summary.gold_standard else 'no'}; coverage: "
        f"{html.escape(_coverage(summary))}</p>",
        "<h2>Reasons</h2>", items(summary.reasons),
        "<h2>Diagnosis</h2>", items([d["message"] for d in summary.diagnosis]),
        "<h2>Metrics</h2>", _table_html(metric_rows(summary)),
        "<h2>Learning rate</h2>",
        f"<p>{html.escape(lr.status)}: {lr.steps_compared} steps compared, {lr.mismatched_steps} differ"
        + (f", first at step {lr.first_mismatch_step}" if lr.first_mismatch_step else "") + "</p>",
    ]
    if png is not None:
        parts += ["<h2>Curves</h2>",
                  f"<img alt='losses and relative errors' style='max-width:100%' "
                  f"src='data:image/png;base64,{base64.b64encode(png).decode('ascii')}'>"]
    parts += ["<h2>Notes</h2>", items(summary.notes),
              "<h2>First steps</h2>", _table_html(_frame_rows(steps.head(10))),
              "<h2>Worst lm_loss steps</h2>", _table_html(_frame_rows(worst)),
              "</body></html>"]
    return "\n".join(parts)


class ReportWriteError(OSError):
    """The report folder cannot be written (an existing file, a read-only mount, a full disk); names the path."""


def check_out_dir(out_dir: Path) -> None:
    """Refuse a report folder that is an existing file, before any work is done for it."""
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise ReportWriteError(f"{out_dir}: is an existing file, not a folder: the report needs a folder "
                               "(new, or one holding an earlier report)")


def write_outputs(summary: Summary, merged: pd.DataFrame, out_dir: Path, plot: bool = True,
                  run_link: dict | None = None) -> None:
    """Write the five files into out_dir atomically (temporary sibling, then moved in); on failure nothing
    is left behind (the temporary sibling and any parent folders made for it are removed) and a
    ``ReportWriteError`` names the path and the cause."""
    out_dir = Path(out_dir)
    check_out_dir(out_dir)
    made = [p for p in out_dir.parents if not p.exists()]
    try:
        _write_outputs(summary, merged, out_dir, plot, run_link)
    except OSError as exc:
        for folder in made:  # innermost first; only the empty folders this call made
            with contextlib.suppress(OSError):
                folder.rmdir()
        where = f" ({exc.filename})" if exc.filename else ""
        raise ReportWriteError(f"{out_dir}: cannot write the report: {exc.strerror or exc}{where}; "
                               "nothing was written") from exc


def _write_outputs(summary: Summary, merged: pd.DataFrame, out_dir: Path, plot: bool,
                   run_link: dict | None) -> None:
    started = time.perf_counter()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the report folder is not
    try:
        steps = steps_table(summary, merged)
        steps.to_csv(tmp / FILES["steps"], index=False)
        png = None
        if plot:
            plot_losses(summary, merged, tmp / FILES["plot"])
            png = (tmp / FILES["plot"]).read_bytes()
        (tmp / FILES["html"]).write_text(render_html(summary, steps, png, run_link), encoding="utf-8")
        (tmp / FILES["markdown"]).write_text(render_markdown(summary, steps, plot, run_link), encoding="utf-8")
        summary.files = {k: v for k, v in FILES.items() if (tmp / v).exists() or k == "summary"}
        summary.timings["render_s"] = round(time.perf_counter() - started, 4)
        (tmp / FILES["summary"]).write_text(json.dumps(summary.to_dict(), indent=2, allow_nan=False) + "\n",
                                            encoding="utf-8")
        if not out_dir.exists():
            os.replace(tmp, out_dir)
            return
        for name in [*(v for v in FILES.values() if v != FILES["summary"]), FILES["summary"]]:
            if (tmp / name).exists():
                os.replace(tmp / name, out_dir / name)
            elif (out_dir / name).exists():
                (out_dir / name).unlink()  # a stale plot from an earlier run with plotting on
        tmp.rmdir()
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
