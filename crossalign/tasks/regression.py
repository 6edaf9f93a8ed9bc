"""Nightly history: one entry per model per night, and the rule that calls a night a regression.

A night regresses against the previous night of the same model when its verdict is worse
(pass -> fail/invalid, or no verdict at all), or when a loss's step-1 or mean relative error
grew by more than ``tolerance`` times and is above ``floor`` (errors near bf16 noise, around
1e-6, move by large factors for no reason and are not regressions).
"""

from __future__ import annotations

from datetime import date
from pathlib import Path
from typing import Any

from crossalign.store import read_json, write_json_atomic

VERDICT_RANK = {"pass": 0, "fail": 1, "invalid": 2, None: 3}
TRACKED = ("step1_rel_err", "mean_rel_err")
DEFAULT_TOLERANCE = 2.0
DEFAULT_FLOOR = 1e-4


def history_entry(model: str, run_id: str, night: date, summary: dict[str, Any] | None,
                  error: str | None = None) -> dict[str, Any]:
    """What the history keeps of one alignment run: verdict and the tracked errors of every compared series."""
    series = {}
    for name, metrics in (summary or {}).get("series", {}).items():
        if metrics.get("status") == "compared":
            series[name] = {key: metrics.get(key) for key in TRACKED}
    return {"date": night.isoformat(), "model": model, "run_id": run_id,
            "verdict": (summary or {}).get("verdict"), "series": series, "error": error}


def find_regressions(previous: dict[str, Any] | None, current: dict[str, Any], *,
                     tolerance: float = DEFAULT_TOLERANCE, floor: float = DEFAULT_FLOOR) -> list[str]:
    """Why ``current`` is worse than ``previous`` (same model); empty if it is not."""
    problems = []
    if current["verdict"] is None:
        problems.append(f"{current['model']}: no verdict ({current.get('error') or 'the run did not finish'})")
    if previous is None:
        return problems
    if current["verdict"] is not None and VERDICT_RANK[current["verdict"]] > VERDICT_RANK.get(previous["verdict"], 3):
        problems.append(f"{current['model']}: verdict {previous['verdict']} on {previous['date']} -> "
                        f"{current['verdict']}")
    for name, now in current["series"].items():
        before = previous["series"].get(name)
        if before is None:
            continue
        for key in TRACKED:
            old, new = before.get(key), now.get(key)
            if old is None or new is None or new <= floor:
                continue
            if new > tolerance * max(old, floor / tolerance):
                problems.append(f"{current['model']}: {name} {key} {100 * old:.4g}% on {previous['date']} -> "
                                f"{100 * new:.4g}% (more than {tolerance:g}x)")
    for name in previous["series"]:
        if name not in current["series"] and current["verdict"] is not None:
            problems.append(f"{current['model']}: {name} was compared on {previous['date']} and is not any more")
    return problems


def load_history(path: Path) -> list[dict[str, Any]]:
    return read_json(path) if path.exists() else []


def previous_entry(history: list[dict[str, Any]], model: str, before: str) -> dict[str, Any] | None:
    """The latest entry of ``model`` dated before ``before`` (an ISO date)."""
    earlier = [e for e in history if e["model"] == model and e["date"] < before]
    return max(earlier, key=lambda e: e["date"]) if earlier else None


def record(path: Path, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add tonight's entries, replacing any earlier entry of the same date and model (a re-run night)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = {(e["date"], e["model"]) for e in entries}
    history = [e for e in load_history(path) if (e["date"], e["model"]) not in keys] + entries
    history.sort(key=lambda e: (e["date"], e["model"]))
    write_json_atomic(path, history)
    return history


def history_rows(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flat rows for a table artifact: one per night and model, errors in percent."""
    rows = []
    for entry in history:
        row: dict[str, Any] = {"date": entry["date"], "model": entry["model"], "verdict": entry["verdict"] or "none"}
        for name, metrics in sorted(entry["series"].items()):
            for key in TRACKED:
                value = metrics.get(key)
                row[f"{name} {key} %"] = None if value is None else round(100 * value, 6)
        rows.append(row)
    return rows


def plot_trend(history: list[dict[str, Any]], path: Path) -> Path:
    """Mean relative error of each loss per night and model (log scale), written as a PNG."""
    # matplotlib: loaded only when a plot is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(9, 4.5))
    for model in sorted({e["model"] for e in history}):
        entries = [e for e in history if e["model"] == model]
        for name in sorted({n for e in entries for n in e["series"]}):
            points = [(e["date"], e["series"][name]["mean_rel_err"]) for e in entries
                      if name in e["series"] and e["series"][name].get("mean_rel_err")]
            if points:
                axis.plot([p[0] for p in points], [100 * p[1] for p in points], marker="o", label=f"{model} {name}")
    axis.set_yscale("log")
    axis.set_ylabel("mean relative error (%)")
    axis.set_title("nightly alignment: mean relative error per loss")
    axis.axhline(1.0, color="red", linestyle="--", linewidth=1, label="criterion 1%")
    axis.legend(fontsize=8)
    axis.grid(True, which="both", alpha=0.3)
    figure.autofmt_xdate()
    figure.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    figure.savefig(tmp, dpi=100)
    plt.close(figure)
    tmp.replace(path)
    return path
