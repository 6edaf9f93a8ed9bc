"""Step 6 of the DAG: compare the NPU (MindFormers) and GPU (Megatron) logs and give a verdict.

``compare_logs`` parses both logs, measures how each loss series agrees (``metrics``), names the
recognised failure patterns (``diagnose``) and writes summary.json, steps.csv, loss.png,
report.html and report.md (``render``). The schema of summary.json is in SUMMARY_SCHEMA.md.

Verdict: "invalid" when the logs cannot prove anything: the same log on both sides, a failed Megatron
checkpoint load, a series that cannot be compared (logged by one side only, expected by the run's config
and missing, graph-mode MTP without its factor), fewer steps compared than expected ("incomplete: N of M
steps"), or too few steps to judge. Otherwise "pass" when every required series (lm loss and each MTP
loss) has a step-1 relative error below 0.5%, a mean relative error below 1%, no NaN, and step-to-step changes that
co-move with the other side's; otherwise "fail": the numbers disagree. "Gold standard" is said only of
a pass whose step 1 is within 0.005% on every required series.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from crossalign.logs import parse_log
from crossalign.sides.log_common import step_ranges
from crossalign.report.diagnose import diagnose
from crossalign.report.metrics import (
    ARITHMETIC_NOISE, COMOVE_MIN_STEPS, COMOVE_Z, GOLD_LIMIT, MEAN_LIMIT, MIN_STEPS, STEP1_LIMIT,
    SeriesMetrics, aligned_frame, lr_check, series_metrics,
)
from crossalign.report.render import write_outputs
from crossalign.report.sides import check_formats, name_different_models, same_log
from crossalign.report.summary import Summary

# crossalign's Megatron backends always launch with --log-interval 1 (crossalign/sides/megatron/backend.py,
# the embedded trainer likewise), so inside the DAG the interval is known.
DAG_LOG_INTERVAL = 1


@dataclass(frozen=True)
class CompareOptions:
    """How to read the logs and judge them; None means unknown (then it is inferred or tested, and said)."""

    megatron_core_version: str | None = None        # decides the iteration-2 reading; None: both are tested
    log_interval: int | None = None                 # Megatron's --log-interval; None: inferred from the log
    expect_steps: int | None = None                 # train_iters: steps 1..N must be compared; None: the longer log's range
    mtp_expected: bool | None = None                # the model has MTP: both logs must print it
    aux_expected: bool | None = None                # the model is MoE: both logs must print the aux loss
    exclude_steps: tuple[int, ...] = ()             # left out of mean/median/max/pearson/comove
    step_threshold: float = MEAN_LIMIT              # a step above it is a "bad" step (first_bad_step)
    mtp_loss_scaling_factor: float | None = None    # graph-mode and r2.0.0 pynative logs print the MTP loss scaled
    mindformers_version: str | None = None          # decides whether a pynative mtp_1_loss is scaled; None: as printed
    allow_any_format: bool = False                  # a log of either framework on either side (else refused)
    precision: str | None = None                    # "fp32" or "bf16" (both sides' arithmetic); None: taken as bf16
    load_verified: str | None = None                # how the gpu run's loaded tensors were verified, if they were
    plot: bool = True


def options_from_config(config, **overrides) -> CompareOptions:
    """What a run's config says about its logs (an ``AlignmentConfig``): the core version, train_iters,
    whether MTP and the MoE aux loss must be present, the graph-mode MTP factor (one MTP layer:
    MindFormers prints mtp_loss scaled by factor / mtp_num_layers) and the precision the real frameworks
    train in (``training.bf16``; the embedded trainers name theirs, see ``compare_logs``)."""
    model, training = config.model, config.training
    values = {
        "megatron_core_version": training.megatron_core_version,
        "mindformers_version": training.mindformers_version,
        "precision": "bf16" if training.bf16 else "fp32",
        "expect_steps": training.train_iters,
        "mtp_expected": model.mtp_num_layers > 0,
        "aux_expected": model.is_moe,
        "mtp_loss_scaling_factor": model.mtp_loss_scaling_factor / model.mtp_num_layers
        if model.mtp_num_layers == 1 else None,
    }
    values.update({k: v for k, v in overrides.items() if v is not None})
    return CompareOptions(**values)


def _series_names(frames: dict[str, pd.DataFrame], unusable: dict[str, str]) -> list[str]:
    """lm and MTP losses (judged), then the aux loss and the extra losses both logs print under the same
    name (reported: ``z_loss``, ``indexer_loss``)."""
    mtp = sorted({c for f in frames.values() for c in f.attrs["logged"] if c.startswith("mtp_")} | set(unusable),
                 key=lambda c: int(c.split("_")[1]))
    names = ["lm_loss", *mtp]
    if all("aux_loss" in f.attrs["logged"] for f in frames.values()):
        names.append("aux_loss")
    npu_extras, gpu_extras = (f.attrs.get("extra_losses", []) for f in frames.values())
    names += [name for name in npu_extras if name in gpu_extras and all(name in f.attrs["logged"] for f in frames.values())]
    return names


def _judged(name: str) -> bool:
    """The series the verdict rests on: the lm loss and every MTP loss."""
    return name == "lm_loss" or name.startswith("mtp_")


def _input_info(frame: pd.DataFrame) -> dict:
    a = frame.attrs
    return {
        "path": a["path"], "format": a["format"], "steps": int(len(frame)),
        "first_step": int(frame["step"].iloc[0]), "last_step": int(frame["step"].iloc[-1]),
        "logged": a["logged"], "lr_step_offset": a["lr_step_offset"],
        "loss_is_total": bool(a.get("loss_is_total", False)), "core_version": a.get("core_version"),
        "restart_steps": a["restart_steps"], "duplicate_steps": a["duplicate_steps"],
        "corrections": a["corrections"], "invalid": a["invalid"], "notes": a["notes"],
        "log_interval": a.get("log_interval"), "extra_losses": a.get("extra_losses", []),
        "unreadable": a.get("unreadable", []),
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
             _comove_words(m), *nan]
    return f"{m.name}: " + ", ".join(parts)


def _comove_words(m: SeriesMetrics) -> str:
    if m.comove_undecided:
        return f"co-movement cannot be told ({m.comove_undecided})"
    if m.comove is None:
        return "co-movement n/a"
    return (f"co-movement {m.comove:.3f} {'>=' if m.comove >= m.comove_min else '<'} {m.comove_min:.3f} (the runs' "
            f"difference moves {m.difference_spread:.2g} per step, each run {m.fluctuation:.2g})")


def _below(x: float | None, limit: float) -> bool:
    return x is not None and x < limit


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.4g}%"


def _resolve_iteration2(frames: dict[str, pd.DataFrame], notes: list[str]) -> list[dict]:
    """Megatron core version unknown: test both readings of the second line after each process start
    (as printed, or the mean with the line before taken out) against the other log's value at that
    step, use the one that fits, and say which and by how much. Never silent: every test is returned."""
    tests = []
    for side, frame in frames.items():
        other = frames["npu" if side == "gpu" else "gpu"]
        for found in frame.attrs.get("iteration2", []):
            step = found["step"]
            theirs = other.loc[other["step"] == step, "lm_loss"]
            printed, undone = found["as_printed"].get("lm_loss"), found["mean_undone"].get("lm_loss")
            test = {"side": side, "step": step, "first_step": found["first_step"], "as_printed": printed,
                    "mean_undone": undone, "other": None, "err_as_printed": None, "err_mean_undone": None,
                    "reading": "as_printed"}
            if printed is None or theirs.empty or not np.isfinite(theirs.iloc[0]):
                notes.append(f"{side}: Megatron core version unknown and the other log has no lm loss at step {step}: "
                             "its line there is read as printed (pass --megatron-core-version to decide)")
                tests.append(test)
                continue
            value = float(theirs.iloc[0])
            test.update(other=value, err_as_printed=abs(printed - value) / abs(value),
                        err_mean_undone=abs(undone - value) / abs(value))
            if test["err_mean_undone"] < test["err_as_printed"]:
                test["reading"] = "mean_undone"
                row = frame.index[frame["step"] == step]
                for name, corrected in found["mean_undone"].items():
                    frame.loc[row, name] = corrected
            used = test["reading"]
            unused = "as_printed" if used == "mean_undone" else "mean_undone"
            words = {"as_printed": "as printed", "mean_undone": f"with the mean of steps {found['first_step']} and "
                     f"{step} taken out"}
            writer = {"as_printed": "a core without the iteration-2 mean", "mean_undone": "a core 0.16-0.19"}
            notes.append(
                f"{side}: Megatron core version unknown, so step {step} was tested both ways against the other log "
                f"({value:.6g}) and is read {words[used]} ({test[used]:.6g}, {_pct(test['err_' + used])} off; "
                f"{words[unused]} it would be {_pct(test['err_' + unused])} off), as {writer[used]} writes it "
                "(pass --megatron-core-version to decide it instead)")
            tests.append(test)
        if frame.attrs.get("iteration2"):
            # the parser's note says the line was left as printed for this test to decide: the note above says how
            frame.attrs["notes"] = [note for note in frame.attrs["notes"]
                                    if not note.startswith("Megatron core version not given")]
    return tests


def _log_interval(frames: dict[str, pd.DataFrame], options: CompareOptions) -> int:
    if options.log_interval:
        return options.log_interval
    return max([int(f.attrs.get("log_interval") or 1) for f in frames.values()])


def _settle_non_strict_loads(frames: dict[str, pd.DataFrame], options: CompareOptions, notes: list[str]) -> None:
    """Megatron's non-strict loads make a log invalid, unless the run's loaded tensors were verified: then they
    are a note (a TE model given a checkpoint without ``_extra_state`` entries always loads non-strictly)."""
    for side, frame in frames.items():
        lines = frame.attrs.get("non_strict_load", [])
        if lines and options.load_verified:
            notes.append(f"{side}: {'; '.join(lines)}; every weight was loaded all the same: {options.load_verified}")
        elif lines:
            frame.attrs["invalid"] = [*frame.attrs["invalid"], *lines]


def _coverage(frames: dict[str, pd.DataFrame], merged: pd.DataFrame, options: CompareOptions) -> dict:
    """Which steps had to be compared and which were: steps 1..expect_steps, or by default the range
    of the longer log, on the Megatron logging grid (step 1 and every log_interval-th step)."""
    interval = _log_interval(frames, options)
    longer = max(frames.values(), key=len)
    if options.expect_steps:
        low, high, basis = 1, options.expect_steps, f"expected {options.expect_steps} steps (train_iters)"
    else:
        low, high = int(longer["step"].iloc[0]), int(longer["step"].iloc[-1])
        basis = f"the range of the longer log ({longer.attrs['path']}: steps {low}-{high})"
    grid = np.arange(low, high + 1)
    grid = grid[(grid == low) | (grid % interval == 0)]
    both = merged.loc[merged["logged_npu"] & merged["logged_gpu"], "step"].to_numpy()
    missing = np.setdiff1d(grid, both)
    return {"expected": int(len(grid)), "compared": int(len(grid) - len(missing)), "basis": basis,
            "log_interval": interval, "missing": step_ranges(missing.tolist())[:200]}


def _not_comparable(series: dict[str, SeriesMetrics], frames: dict[str, pd.DataFrame], unusable: dict[str, str],
                    options: CompareOptions) -> list[str]:
    """Reasons a required or expected series cannot be compared (not a disagreement of numbers)."""
    reasons = []
    for m in series.values():
        if m.status.startswith("missing_on_") and (m.required or options.aux_expected):
            why = unusable.get(m.name)
            reasons.append(_reason(m) + (f" ({why})" if why else ""))
        elif m.status == "no_common_steps" and m.required:
            reasons.append(_reason(m))
    if options.mtp_expected and not any(name.startswith("mtp_") for name in series):
        reasons.append("the model has MTP (config mtp_num_layers > 0) but neither log printed an MTP loss")
    if options.aux_expected and "aux_loss" not in series:
        absent = [side for side, f in frames.items() if "aux_loss" not in f.attrs["logged"]]
        reasons.append(f"the model is MoE but the aux loss (load_balancing_loss) is missing on {' and '.join(absent)}")
    return reasons


def build_summary(npu: pd.DataFrame, gpu: pd.DataFrame,
                  options: CompareOptions | None = None) -> tuple[Summary, pd.DataFrame]:
    """Judge two parsed logs; returns the summary and the per-step frame (steps.csv)."""
    options = options or CompareOptions()
    frames = {"npu": npu.copy(), "gpu": gpu.copy()}
    notes = ["relative error = |npu - gpu| / |gpu| per step (the gpu/Megatron side is the reference)"]
    iteration2 = _resolve_iteration2(frames, notes)
    _settle_non_strict_loads(frames, options, notes)
    npu, gpu = frames["npu"], frames["gpu"]
    unusable = {k: f"{side}: {why}" for side, f in frames.items() for k, why in f.attrs.get("unusable", {}).items()}
    names = _series_names(frames, unusable)
    if options.aux_expected and "aux_loss" not in names and any("aux_loss" in f.attrs["logged"] for f in frames.values()):
        names.append("aux_loss")
    merged = aligned_frame(npu, gpu, names)
    excluded = set(options.exclude_steps)
    precision = options.precision or "bf16"
    series = {
        name: series_metrics(name, _judged(name), merged,
                             {side: name in f.attrs["logged"] for side, f in frames.items()},
                             excluded, options.step_threshold, precision)
        for name in names
    }
    lr = lr_check(merged)
    findings = diagnose(series, merged, frames, lr, unusable, options.precision)
    findings = name_different_models(series, frames, lr, findings)
    coverage = _coverage(frames, merged, options)

    invalid = [reason for reason in [same_log(npu, gpu)] if reason]
    invalid += [f"{side}: {reason}" for side, f in frames.items() for reason in f.attrs["invalid"]]
    invalid += _not_comparable(series, frames, unusable, options)
    if coverage["compared"] < coverage["expected"]:
        invalid.append(f"incomplete: {coverage['compared']} of {coverage['expected']} steps compared "
                       f"({coverage['basis']}; not in both logs: {coverage['missing']})")
    required = [m for m in series.values() if m.required and m.status == "compared"]
    thin = [m for m in required if m.steps_compared < MIN_STEPS]
    if thin:
        invalid.append(f"too few steps to judge: {', '.join(f'{m.name} {m.steps_compared}' for m in thin)} compared, "
                       f"at least {MIN_STEPS} are needed")
    failed = [m for m in required if m.passed is False]
    undecided = [m for m in required if m.passed is None]
    if invalid:
        verdict, reasons = "invalid", invalid
    elif failed or not required:
        verdict, reasons = "fail", [_reason(m) for m in failed]
    elif undecided:
        verdict = "invalid"
        reasons = [f"{m.name}: step 1 and the mean agree, but whether the two runs saw the same batches cannot be "
                   f"told: {m.comove_undecided}" for m in undecided]
    else:
        verdict, reasons = "pass", [_reason(m) for m in required]

    for side, f in frames.items():
        notes += [f"{side}: {note}" for note in f.attrs["notes"]]
    only = {side: set(f["step"]) - set(frames["gpu" if side == "npu" else "npu"]["step"]) for side, f in frames.items()}
    for side, steps in only.items():
        if steps:
            notes.append(f"steps only the {side} log holds (not compared): {_short_ranges(steps)}")
    if excluded:
        notes.append(f"excluded from mean/median/max/pearson/co-movement: steps {step_ranges(excluded)}")
    for m in required:
        if m.step1 not in (None, 1):
            notes.append(f"{m.name}: the first common step is {m.step1}, used as 'step 1'")
    for name in dict.fromkeys(["aux_loss", *(x for f in frames.values() for x in f.attrs.get("extra_losses", []))]):
        logged = [side for side, f in frames.items() if name in f.attrs["logged"]]
        if name not in series and logged:
            notes.append(f"{name} is logged by {logged[0]} only: not compared")

    summary = Summary(
        verdict=verdict, reasons=reasons, diagnosis=findings, notes=notes,
        gold_standard=verdict == "pass" and all(m.gold for m in required),
        series=series, lr=lr, inputs={side: _input_info(f) for side, f in frames.items()},
        coverage=coverage, megatron_iteration2=iteration2,
        criteria={"step1_rel_err_max": STEP1_LIMIT, "mean_rel_err_max": MEAN_LIMIT,
                  "gold_step1_rel_err_max": GOLD_LIMIT, "comove_z": COMOVE_Z,
                  "min_steps": MIN_STEPS, "comove_min_steps": COMOVE_MIN_STEPS, "precision": precision,
                  "arithmetic_noise": ARITHMETIC_NOISE[precision], "step_threshold": options.step_threshold,
                  "reference": "gpu", "excluded_steps": sorted(excluded),
                  "megatron_core_version": options.megatron_core_version, "expect_steps": options.expect_steps,
                  "mtp_expected": options.mtp_expected, "aux_expected": options.aux_expected},
    )
    return summary, merged


def _short_ranges(steps: set[int]) -> str:
    text = step_ranges(steps)
    return text if len(text) <= 120 else text[:117] + "..."


def parse_both(npu_log: Path, gpu_log: Path, options: CompareOptions) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Parse the two logs (each format detected from its content)."""
    kwargs = {"core_version": options.megatron_core_version, "log_interval": options.log_interval,
              "mtp_loss_scaling_factor": options.mtp_loss_scaling_factor,
              "mindformers_version": options.mindformers_version}
    return parse_log(Path(npu_log), **kwargs), parse_log(Path(gpu_log), **kwargs)


TRAINED_ON = ("device", "device_name", "kernels")  # what a training step's manifest says about where it trained


def compare_logs(npu_log: Path, gpu_log: Path, out_dir: Path, options: CompareOptions | None = None, *,
                 implementations: dict[str, str] | None = None, trained_on: dict[str, dict] | None = None,
                 run_link: dict | None = None) -> Summary:
    """Parse, judge and write the report into ``out_dir``; raises LogFormatError on an unreadable log.

    ``implementations`` (side -> what trained it, from the training steps' manifests) is named in the report,
    and decides the precision when both name theirs (the embedded trainers do: "fp32", "bf16 on ...").
    ``trained_on`` (side -> the training step's ``device``, ``device_name`` and ``kernels``, from its manifest)
    says where and with which GatedDeltaNet kernels that side trained.
    ``run_link`` ({run_id, url}) names the DAG run in the report's heading and links its flow run in Prefect.
    """
    options = options or CompareOptions()
    named = list((implementations or {}).values())
    if len(named) == 2 and all("fp32" in text or "bf16" in text for text in named):
        options = replace(options, precision="bf16" if any("bf16" in text for text in named) else "fp32")
    started = time.perf_counter()
    npu, gpu = parse_both(npu_log, gpu_log, options)
    check_formats(npu, gpu, options.allow_any_format)
    parsed = time.perf_counter()
    summary, merged = build_summary(npu, gpu, options)
    for side, implementation in (implementations or {}).items():
        summary.inputs[side]["implementation"] = implementation
    for side, where in (trained_on or {}).items():
        summary.inputs[side].update({key: where[key] for key in TRAINED_ON if where.get(key)})
    judged = time.perf_counter()
    summary.timings = {"parse_s": round(parsed - started, 4), "compare_s": round(judged - parsed, 4)}
    write_outputs(summary, merged, Path(out_dir), plot=options.plot, run_link=run_link)
    return summary


__all__ = ["CompareOptions", "DAG_LOG_INTERVAL", "Summary", "TRAINED_ON", "build_summary", "compare_logs",
           "options_from_config", "parse_both"]
