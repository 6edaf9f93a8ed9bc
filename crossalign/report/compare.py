"""Step 6 of the DAG: compare the NPU (MindFormers) and GPU (Megatron) logs and give a verdict.

``compare_logs`` parses both logs, measures how each loss series agrees (``metrics``), names the
recognised failure patterns (``diagnose``) and writes summary.json, steps.csv, loss.png,
report.html and report.md (``render``). The schema of summary.json is in SUMMARY_SCHEMA.md.

Verdict: "invalid" when a log shows the run cannot prove anything (a failed Megatron checkpoint
load); otherwise "pass" when every required series (lm loss and each MTP loss) has a step-1
relative error below 0.5%, a mean relative error below 1% and no NaN; otherwise "fail".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from crossalign.logs import parse_log
from crossalign.logs.common import step_ranges
from crossalign.report.diagnose import diagnose
from crossalign.report.metrics import (
    GOLD_LIMIT, MEAN_LIMIT, STEP1_LIMIT, LrCheck, SeriesMetrics, aligned_frame, lr_check, series_metrics,
)

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class CompareOptions:
    """How to read the logs and judge them."""

    megatron_core_version: str = "0.16.1"          # decides the iteration-2 mean correction
    exclude_steps: tuple[int, ...] = ()             # left out of mean/median/max/pearson
    step_threshold: float = MEAN_LIMIT              # a step above it is a "bad" step (first_bad_step)
    mtp_loss_scaling_factor: float | None = None    # only for graph-mode logs, whose mtp_loss is scaled
    plot: bool = True


@dataclass
class Summary:
    """Everything the report says; ``to_dict()`` is the content of summary.json."""

    verdict: str
    reasons: list[str]
    diagnosis: list[dict]
    notes: list[str]
    gold_standard: bool
    series: dict[str, SeriesMetrics]
    lr: LrCheck
    inputs: dict[str, dict]
    criteria: dict
    files: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "verdict": self.verdict,
            "reasons": self.reasons,
            "diagnosis": self.diagnosis,
            "notes": self.notes,
            "gold_standard": self.gold_standard,
            "criteria": self.criteria,
            "series": {name: m.to_dict() for name, m in self.series.items()},
            "lr": self.lr.to_dict(),
            "inputs": self.inputs,
            "files": self.files,
            "timings": self.timings,
        }


def _series_names(frames: dict[str, pd.DataFrame], unusable: dict[str, str]) -> list[str]:
    mtp = sorted({c for f in frames.values() for c in f.attrs["logged"] if c.startswith("mtp_")} | set(unusable),
                 key=lambda c: int(c.split("_")[1]))
    names = ["lm_loss", *mtp]
    if all("aux_loss" in f.attrs["logged"] for f in frames.values()):
        names.append("aux_loss")
    return names


def _input_info(frame: pd.DataFrame) -> dict:
    a = frame.attrs
    return {
        "path": a["path"], "format": a["format"], "steps": int(len(frame)),
        "first_step": int(frame["step"].iloc[0]), "last_step": int(frame["step"].iloc[-1]),
        "logged": a["logged"], "lr_step_offset": a["lr_step_offset"],
        "loss_is_total": bool(a.get("loss_is_total", False)), "core_version": a.get("core_version"),
        "restart_steps": a["restart_steps"], "duplicate_steps": a["duplicate_steps"],
        "corrections": a["corrections"], "invalid": a["invalid"], "notes": a["notes"],
    }


def _reason(m: SeriesMetrics) -> str:
    if m.status.startswith("missing_on_"):
        other = "gpu" if m.status.endswith("npu") else "npu"
        return f"{m.name}: logged by {other} only, so it cannot be compared"
    if m.status == "no_common_steps":
        return f"{m.name}: the two logs share no step"
    nan = [f"NaN/inf on {side} from step {step}" for side, step in m.first_nan_step.items() if step is not None]
    parts = [f"step-{m.step1} rel err {_pct(m.step1_rel_err)} {'<' if _below(m.step1_rel_err, STEP1_LIMIT) else '>='} "
             f"{_pct(STEP1_LIMIT)}",
             f"mean rel err {_pct(m.mean_rel_err)} {'<' if _below(m.mean_rel_err, MEAN_LIMIT) else '>='} {_pct(MEAN_LIMIT)}",
             *nan]
    return f"{m.name}: " + ", ".join(parts)


def _below(x: float | None, limit: float) -> bool:
    return x is not None and x < limit


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.4g}%"


def build_summary(npu: pd.DataFrame, gpu: pd.DataFrame,
                  options: CompareOptions | None = None) -> tuple[Summary, pd.DataFrame]:
    """Judge two parsed logs; returns the summary and the per-step frame (steps.csv)."""
    options = options or CompareOptions()
    frames = {"npu": npu, "gpu": gpu}
    unusable = {k: f"{side}: {why}" for side, f in frames.items() for k, why in f.attrs.get("unusable", {}).items()}
    names = _series_names(frames, unusable)
    merged = aligned_frame(npu, gpu, names)
    excluded = set(options.exclude_steps)
    series = {
        name: series_metrics(name, name != "aux_loss", merged,
                             {side: name in f.attrs["logged"] for side, f in frames.items()},
                             excluded, options.step_threshold)
        for name in names
    }
    lr = lr_check(merged)
    findings = diagnose(series, merged, frames, lr, unusable)

    invalid = [f"{side}: {reason}" for side, f in frames.items() for reason in f.attrs["invalid"]]
    required = [m for m in series.values() if m.required]
    if invalid:
        verdict, reasons = "invalid", invalid
    else:
        verdict = "pass" if required and all(m.passed for m in required) else "fail"
        reasons = [_reason(m) for m in required if (m.passed is False) == (verdict == "fail")]

    notes = ["relative error = |npu - gpu| / |gpu| per step (the gpu/Megatron side is the reference)"]
    for side, f in frames.items():
        notes += [f"{side}: {note}" for note in f.attrs["notes"]]
    only = {side: set(f["step"]) - set(frames["gpu" if side == "npu" else "npu"]["step"]) for side, f in frames.items()}
    for side, steps in only.items():
        if steps:
            notes.append(f"steps only the {side} log holds (not compared): {_short_ranges(steps)}")
    if excluded:
        notes.append(f"excluded from mean/median/max/pearson: steps {step_ranges(excluded)}")
    for m in required:
        if m.step1 not in (None, 1):
            notes.append(f"{m.name}: the first common step is {m.step1}, used as 'step 1'")
    if "aux_loss" not in series:
        logged_aux = [side for side, f in frames.items() if "aux_loss" in f.attrs["logged"]]
        if logged_aux:
            notes.append(f"aux_loss is logged by {logged_aux[0]} only: not compared")

    compared = [m for m in required if m.status == "compared"]
    summary = Summary(
        verdict=verdict, reasons=reasons, diagnosis=findings, notes=notes,
        gold_standard=bool(compared) and len(compared) == len(required) and all(m.gold for m in compared),
        series=series, lr=lr, inputs={side: _input_info(f) for side, f in frames.items()},
        criteria={"step1_rel_err_max": STEP1_LIMIT, "mean_rel_err_max": MEAN_LIMIT,
                  "gold_step1_rel_err_max": GOLD_LIMIT, "step_threshold": options.step_threshold,
                  "reference": "gpu", "excluded_steps": sorted(excluded),
                  "megatron_core_version": options.megatron_core_version},
    )
    return summary, merged


def _short_ranges(steps: set[int]) -> str:
    text = step_ranges(steps)
    return text if len(text) <= 120 else text[:117] + "..."


def parse_both(npu_log: Path, gpu_log: Path, options: CompareOptions) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Parse the two logs (each format detected from its content)."""
    kwargs = {"core_version": options.megatron_core_version,
              "mtp_loss_scaling_factor": options.mtp_loss_scaling_factor}
    return parse_log(Path(npu_log), **kwargs), parse_log(Path(gpu_log), **kwargs)


def compare_logs(npu_log: Path, gpu_log: Path, out_dir: Path, options: CompareOptions | None = None) -> Summary:
    """Parse, judge and write the report into ``out_dir``; raises LogFormatError on an unreadable log."""
    from crossalign.report.render import write_outputs

    options = options or CompareOptions()
    started = time.perf_counter()
    npu, gpu = parse_both(npu_log, gpu_log, options)
    parsed = time.perf_counter()
    summary, merged = build_summary(npu, gpu, options)
    judged = time.perf_counter()
    summary.timings = {"parse_s": round(parsed - started, 4), "compare_s": round(judged - parsed, 4)}
    write_outputs(summary, merged, Path(out_dir), plot=options.plot)
    return summary


__all__ = ["CompareOptions", "Summary", "build_summary", "compare_logs", "parse_both"]
