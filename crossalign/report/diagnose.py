"""Recognise the usual ways an alignment run goes wrong, from the numbers alone (SPEC section 9).

Each finding is a dict ``{"pattern", "series", "step", "message"}``; the message says what
the evidence supports, not every possibility. Patterns: ``missing_series``, ``nan``,
``invalid_run``, ``lr_mismatch``, ``step2_spike``, ``constant_offset``, ``step1_mismatch``,
``uncorrelated``, ``growing_divergence``, ``routing_drift``.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from crossalign.report.metrics import COMOVE_MIN, MEAN_LIMIT, STEP1_LIMIT, LrCheck, SeriesMetrics

SPIKE_FACTOR = 10.0    # step 2 stands out when its error is this many times the others'
SPIKE_FLOOR = 1e-4     # ... and at least 0.01%


def _finding(pattern: str, message: str, series: str | None = None, step: int | None = None) -> dict:
    return {"pattern": pattern, "series": series, "step": step, "message": message}


def _pct(x: float) -> str:
    return f"{100 * x:.4g}%"


def _series_errors(merged: pd.DataFrame, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Steps, npu, gpu and rel err of the steps both logs hold with finite values."""
    rel = merged[f"{name}_rel_err"].to_numpy()
    keep = merged["logged_npu"].to_numpy() & merged["logged_gpu"].to_numpy() & np.isfinite(rel)
    return (merged["step"].to_numpy()[keep], merged[f"{name}_npu"].to_numpy()[keep],
            merged[f"{name}_gpu"].to_numpy()[keep], rel[keep])


def _megatron_step2_evidence(name: str, frames: dict[str, pd.DataFrame], npu2: float, gpu2: float) -> str | None:
    """Does the other reading of Megatron's iteration-2 line (mean of 1 and 2, or not) explain the spike?"""
    for side, frame in frames.items():
        if frame.attrs.get("format") != "megatron":
            continue
        other = npu2 if side == "gpu" else gpu2
        ours = gpu2 if side == "gpu" else npu2
        corrected = next((c for c in frame.attrs.get("corrections", []) if c["step"] == 2 and c["first_step"] == 1), None)
        if corrected is not None and name in corrected["raw"]:
            alternative = corrected["raw"][name]
            if abs(alternative - other) * SPIKE_FACTOR < abs(ours - other):
                return (f"the {side} Megatron log looks written by a core without the iteration-2 mean (before "
                        f"0.16, or 0.20 on): its printed iteration-2 value {alternative:.6g} matches the other side "
                        f"({other:.6g}) while the mean-of-first-two correction for core "
                        f"{frame.attrs.get('core_version')} makes it {ours:.6g}; pass the --megatron-core-version "
                        "that wrote the log")
            return None
        first = frame.loc[frame["step"] == 1, name]
        if len(first) and np.isfinite(first.iloc[0]):
            alternative = 2 * ours - float(first.iloc[0])
            if abs(alternative - other) * SPIKE_FACTOR < abs(ours - other):
                return (f"Megatron cores 0.16-0.19 print the mean of iterations 1 and 2 on the iteration-2 line "
                        f"with --log-interval 1: 2*printed(2) - printed(1) = {alternative:.6g} matches the other "
                        f"side ({other:.6g}); the log was read as written by a core without that mean: pass "
                        "--megatron-core-version with the version that wrote it (0.16.0-0.19.x)")
    return None


def _step2_spike(metrics: SeriesMetrics, merged: pd.DataFrame, frames: dict[str, pd.DataFrame],
                 lr: LrCheck) -> dict | None:
    steps, npu, gpu, rel = _series_errors(merged, metrics.name)
    if len(steps) < 2 or steps[0] != 1 or steps[1] != 2:
        return None
    rest = rel[2:] if len(rel) > 2 else rel[:1]
    others = max(rel[0], float(np.median(rest)))
    if rel[1] < SPIKE_FLOOR or rel[1] < SPIKE_FACTOR * others or np.median(rest) > MEAN_LIMIT:
        return None
    head = (f"{metrics.name}: a single spike at step 2 ({_pct(rel[1])}) while step 1 ({_pct(rel[0])}) "
            f"and the later steps (median {_pct(float(np.median(rest)))}) agree: ")
    evidence = _megatron_step2_evidence(metrics.name, frames, float(npu[1]), float(gpu[1]))
    if evidence:
        return _finding("step2_spike", head + evidence, metrics.name, 2)
    lr_steps = merged.loc[merged["step"] <= 2, ["step", "lr_applied_npu", "lr_applied_gpu"]].dropna()
    differing = lr_steps[~np.isclose(lr_steps["lr_applied_npu"], lr_steps["lr_applied_gpu"], rtol=1e-5, atol=0)]
    if len(differing) or (lr.first_mismatch_step is not None and lr.first_mismatch_step <= 2):
        return _finding("step2_spike", head + "the lr applied at the start differs (warmup steps or warmup init "
                        "not the same on both sides), so step 1's update differs; align lr_warmup_iters / "
                        "warmup_steps and the warmup init", metrics.name, 2)
    corrected = any(f.attrs.get("corrections") or f.attrs.get("iteration2") for f in frames.values())
    logging = ("the Megatron mean-of-first-two logging was already undone, so it is not the cause; "
               if corrected else "")
    return _finding("step2_spike", head + logging + "the applied lr agrees, so step 1's update itself differs: "
                    "an optimizer-state mismatch such as Adam bias correction (MindSpore's nn.AdamWeightDecay "
                    "has none, Megatron's Adam has it), which makes the first update much larger on one side",
                    metrics.name, 2)


def _offset_or_mismatch(metrics: SeriesMetrics, merged: pd.DataFrame) -> dict | None:
    if metrics.step1_rel_err is None or metrics.step1_rel_err < STEP1_LIMIT:
        return None
    steps, npu, gpu, _ = _series_errors(merged, metrics.name)
    signed = (npu - gpu) / np.abs(gpu)
    mean, spread = float(signed.mean()), float(signed.std())
    if len(signed) >= 3 and spread < 0.5 * abs(mean):
        return _finding("constant_offset", (
            f"{metrics.name}: off by {_pct(mean)} (npu vs gpu) from step 1 on, and the offset stays (spread "
            f"{_pct(spread)}): the two sides start from different weights or settings, a conversion fault "
            "(e.g. shared-expert fc1 not de-interleaved, about 5% at step 1) or a config difference "
            "(norm_topk_prob, shared-expert gate, layer layout), not the training dynamics"), metrics.name, int(steps[0]))
    return _finding("step1_mismatch", (
        f"{metrics.name}: step {metrics.step1} already differs by {_pct(metrics.step1_rel_err)}: the forward pass "
        "differs before any update (weights, conversion, config or the first batch)"), metrics.name, metrics.step1)


def _uncorrelated(metrics: SeriesMetrics) -> dict | None:
    if metrics.comove is None or metrics.comove >= COMOVE_MIN:
        return None
    trend = "" if metrics.pearson is None else f" although the curves correlate (pearson {metrics.pearson:.3f}) through their shared trend"
    return _finding("uncorrelated", (
        f"{metrics.name}: the two runs do not move together step by step (co-movement of the detrended per-step "
        f"changes {metrics.comove:.3f} < {COMOVE_MIN:g}){trend}: they see different samples at the same step. "
        "Likely cause: the sample order (seed 1234 on both, split 1,0,0, blend form, cyclic vs single loader); "
        "run `crossalign preflight data --model CONFIG --megatron-args ... --mindformers-yaml ...` to find the "
        "setting"), metrics.name)


def _growing(metrics: SeriesMetrics, merged: pd.DataFrame) -> dict | None:
    if metrics.step1_rel_err is None or metrics.step1_rel_err >= STEP1_LIMIT:
        return None
    steps, _, _, rel = _series_errors(merged, metrics.name)
    if len(rel) < 8:
        return None
    quarter = max(2, len(rel) // 4)
    early, late = float(rel[:quarter].mean()), float(rel[-quarter:].mean())
    ranks = np.argsort(np.argsort(rel))
    trend = float(np.corrcoef(np.arange(len(rel)), ranks)[0, 1]) if np.std(ranks) else 0.0
    if late < max(3 * early, STEP1_LIMIT / 5) or trend < 0.5:
        return None
    over = steps[rel > MEAN_LIMIT]
    where = f"; above {_pct(MEAN_LIMIT)} from step {int(over[0])}" if len(over) else ""
    return _finding("growing_divergence", (
        f"{metrics.name}: step 1 agrees ({_pct(metrics.step1_rel_err)}) but the error grows with the steps, from "
        f"{_pct(early)} early to {_pct(late)} late{where}: the forward pass matches and the updates differ "
        "(optimizer settings: Adam betas/eps/bias correction, weight decay on 1-D params, grad clipping; "
        "the lr schedule; or precision of the accumulation)"), metrics.name,
        int(over[0]) if len(over) else None)


def diagnose(series: dict[str, SeriesMetrics], merged: pd.DataFrame, frames: dict[str, pd.DataFrame],
             lr: LrCheck, unusable: dict[str, str]) -> list[dict]:
    """Every recognised pattern, most fundamental first."""
    findings = []
    for side, frame in frames.items():
        for reason in frame.attrs.get("invalid", []):
            findings.append(_finding("invalid_run", f"{side}: {reason}: the losses cannot prove anything"))
    for m in series.values():
        if m.status.startswith("missing_on_"):
            absent = m.status.removeprefix("missing_on_")
            present = "gpu" if absent == "npu" else "npu"
            hint = unusable.get(m.name) or (
                "MTP is off or not logged on that side (MindFormers logs MTP only if the model exposes "
                "get_mtp_loss; Megatron may have MTP disabled or MTP+GDN blocked)" if m.name.startswith("mtp_")
                else "that side does not log it")
            findings.append(_finding("missing_series", f"{m.name} is logged by {present} only: {hint}", m.name))
    for m in series.values():
        for side, step in m.first_nan_step.items():
            if step is not None:
                findings.append(_finding("nan", f"{m.name} is NaN/inf on the {side} side from step {step}", m.name, step))
    if lr.first_mismatch_step is not None:
        findings.append(_finding("lr_mismatch", (
            f"the applied lr differs at {lr.mismatched_steps} of {lr.steps_compared} steps, first at step "
            f"{lr.first_mismatch_step} (npu {lr.npu_lr:.6e}, gpu {lr.gpu_lr:.6e}): the lr schedules differ "
            "(warmup steps, warmup init, decay style or max lr)"), step=lr.first_mismatch_step))
    compared = [m for m in series.values() if m.status == "compared"]
    growing = {m.name: _growing(m, merged) for m in compared}
    judged_grow = any(growing[m.name] for m in compared if m.required)
    for m in compared:
        grow = growing[m.name]
        if grow and m.name == "aux_loss" and not judged_grow:
            grow = _routing_drift(grow)
        for check in (_step2_spike(m, merged, frames, lr), _offset_or_mismatch(m, merged), _uncorrelated(m), grow):
            if check:
                findings.append(check)
    return findings


def _routing_drift(grow: dict) -> dict:
    """A growing aux-loss error while the judged losses hold: top-k routing decisions near a tie flip."""
    evidence = grow["message"].split(": the forward pass matches", 1)[0]
    return _finding("routing_drift", (
        f"{evidence}, while the judged losses keep agreeing: the load-balancing loss counts discrete top-k "
        "routing decisions, and tokens whose expert scores nearly tie switch experts once the two sides' "
        "weights differ in the last bits. This is expected drift, not a setting error; it needs a look "
        "only if lm loss starts to grow apart too"), grow["series"], grow["step"])

