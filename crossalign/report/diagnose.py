"""Recognise the usual ways an alignment run goes wrong, from the numbers alone (SPEC section 9).

Each finding is a dict ``{"pattern", "series", "step", "message"}``; the message says what
the evidence supports, not every possibility. Patterns: ``missing_series``, ``nan``,
``invalid_run``, ``lr_mismatch``, ``step2_spike``, ``constant_offset``, ``step1_mismatch``,
``uncorrelated``, ``growing_divergence``, ``routing_drift``.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from crossalign.report.metrics import (
    MEAN_LIMIT, SPIKE_FACTOR, STEP1_LIMIT, LrCheck, SeriesMetrics, isolated_step2_spike,
)

GRAD_NORM_TOLERANCE = 0.01  # step-1 grad norms this far apart (relative) are a different backward pass or clip
GRAD_NORM_PRINTED = 5e-4    # Megatron prints the grad norm with 3 decimals


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


def _step1_grad_norms(frames: dict[str, pd.DataFrame]) -> dict[str, float] | None:
    """Each side's printed grad norm of step 1, when both logs print one."""
    norms = {}
    for side, frame in frames.items():
        value = frame.loc[frame["step"] == 1, "grad_norm"] if "grad_norm" in frame else pd.Series(dtype=float)
        if value.empty or not np.isfinite(value.iloc[0]):
            return None
        norms[side] = float(value.iloc[0])
    return norms


def _step2_spike(metrics: SeriesMetrics, merged: pd.DataFrame, frames: dict[str, pd.DataFrame],
                 lr: LrCheck, precision: str | None) -> dict | None:
    """An isolated step-2 spike: Megatron's iteration-2 logging, an lr or step-1 gradient difference, a mismatch
    of the optimizer in fp32, or (none of these, and step 3 recovered) the benign bf16 transient of the source."""
    steps, npu, gpu, rel = _series_errors(merged, metrics.name)
    if not isolated_step2_spike(steps, rel):
        return None
    head = (f"{metrics.name}: a single spike at step 2 ({_pct(rel[1])}) while step 1 ({_pct(rel[0])}) "
            f"and the later steps (median {_pct(float(np.median(rel[2:])))}) agree: ")
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
    mismatch = ("an optimizer-state mismatch such as Adam bias correction (MindSpore's nn.AdamWeightDecay has none, "
                "Megatron's Adam has it), which makes the first update much larger on one side")
    norms = _step1_grad_norms(frames)
    if norms and abs(norms["npu"] - norms["gpu"]) > GRAD_NORM_TOLERANCE * max(norms.values()) + GRAD_NORM_PRINTED:
        return _finding("step2_spike", head + logging + (
            f"step 1's grad norm differs (npu {norms['npu']:.6g}, gpu {norms['gpu']:.6g}) while its loss agrees: the "
            "backward pass or the clipping differs (grad clip, loss scaling, which parameters the norm counts), so "
            "the first update differs; with the same gradient it would be ") + mismatch, metrics.name, 2)
    if rel[2] * SPIKE_FACTOR > rel[1]:
        return _finding("step2_spike", head + logging + (
            f"the applied lr agrees but step 3 is still {_pct(rel[2])} off: the difference persists past the first "
            "update, so it is not the benign bf16 transient: ") + mismatch, metrics.name, 2)
    if precision == "fp32":
        return _finding("step2_spike", head + logging + (
            "the applied lr and step 1's grad norm agree and both sides computed in fp32, where the first update "
            "has no bf16 rounding difference to amplify: step 1's update itself differs, ") + mismatch,
            metrics.name, 2)
    norm_words = (f"step 1's grad norm agrees ({norms['gpu']:.4g}; the source saw 2.7-2.96 against a clip of 1.0: "
                  "clipped, the gradient's direction, where bf16 differs, is what moves the weights)"
                  if norms else "the logs print no grad norm of step 1 to compare")
    assumed = "" if precision == "bf16" else " (the precision was not given: taken as bf16)"
    return _finding("step2_spike", head + logging + (
        f"the applied lr agrees, {norm_words}, and step 3 is aligned again: the benign transient of bf16 training "
        f"across hardware{assumed}. Adam's first bias-corrected update (m_hat = m / (1 - beta1) = 10 m) amplifies a "
        "tiny bf16 difference in step 1's backward pass into one perturbed update; step 2's forward shows it, step 3 "
        "has converged back (in the source the lm and MTP losses spiked together). It would not be benign if it persisted past "
        "step 2, appeared with fp32 on both sides, or came with a different lr or step-1 grad norm: then it is "
        + mismatch), metrics.name, 2)


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
    if metrics.comove is None or metrics.comove_undecided or metrics.comove >= metrics.comove_min:
        return None
    trend = "" if metrics.pearson is None else f" although the curves correlate (pearson {metrics.pearson:.3f}) through their shared trend"
    return _finding("uncorrelated", (
        f"{metrics.name}: the two runs do not move together step by step (co-movement {metrics.comove:.3f} < "
        f"{metrics.comove_min:.3f}: their difference moves {metrics.difference_spread:.2g} per step, each run on "
        f"its own {metrics.fluctuation:.2g}){trend}: they see different samples at the same step. "
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
             lr: LrCheck, unusable: dict[str, str], precision: str | None = None) -> list[dict]:
    """Every recognised pattern, most fundamental first; ``precision`` ("fp32", "bf16", None: unknown) is what
    both sides computed in."""
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
        checks = (_step2_spike(m, merged, frames, lr, precision), _offset_or_mismatch(m, merged), _uncorrelated(m), grow)
        for check in checks:
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

