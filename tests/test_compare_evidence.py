"""A verdict that needs evidence: pairs that share only the trend, truncated logs, series that cannot be
compared, an unknown Megatron core version, the run's config as the expectation. The pairs are written
by a seeded generator below, as MindFormers pynative and Megatron logs, and judged from those files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from crossalign.cli import app
from crossalign.config import load_config
from crossalign.logs.synthetic import megatron_lines, mindformers_lines, write_log
from crossalign.report import evidence
from crossalign.report.compare import CompareOptions, compare_logs, options_from_config

STEPS = 120


def trend(rng: np.random.Generator, steps: int = STEPS) -> np.ndarray:
    """A decaying loss curve, the part every run of the model shares."""
    k = np.arange(steps)
    return 11.9 - rng.uniform(1.5, 2.5) * (1 - np.exp(-k / rng.uniform(15, 60)))


def independent_pair(seed: int, steps: int = STEPS) -> tuple[np.ndarray, np.ndarray]:
    """Two runs fed different samples: the shared trend, each its own step-to-step fluctuations, sized so
    the mean relative error lands in 0.3-0.6%; the same step 1 (same weights, same first batch)."""
    rng = np.random.default_rng(seed)
    base = trend(rng, steps)
    target = rng.uniform(0.0035, 0.0052)
    sigma = target * np.sqrt(np.pi) / 2  # E|x - y| = 2 sigma / sqrt(pi) for independent N(0, sigma^2)
    gpu = base * (1 + rng.normal(0, sigma, steps))
    npu = base * (1 + rng.normal(0, sigma, steps))
    npu[0] = gpu[0]
    return npu, gpu


def aligned_pair(seed: int, steps: int = STEPS) -> tuple[np.ndarray, np.ndarray]:
    """Two runs fed the same batches: the same fluctuations, 0.05% of framework noise between them."""
    rng = np.random.default_rng(seed)
    gpu = trend(rng, steps) * (1 + rng.normal(0, 0.01, steps))
    return gpu * (1 + rng.normal(0, 5e-4, steps)), gpu


def judge(tmp_path: Path, npu, gpu, *, npu_mtp=None, gpu_mtp=None, gpu_core="0.16.1", npu_aux=None, gpu_aux=None,
          **options):
    npu_log = write_log(tmp_path / "npu.log", mindformers_lines(
        list(npu), mtp=[list(npu_mtp)] if npu_mtp is not None else (), aux=npu_aux))
    gpu_log = write_log(tmp_path / "gpu.log", megatron_lines(
        list(gpu), mtp=[list(gpu_mtp)] if gpu_mtp is not None else (), aux=gpu_aux, core_version=gpu_core))
    options.setdefault("plot", False)
    return compare_logs(npu_log, gpu_log, tmp_path / "out", CompareOptions(**options))


def test_independent_fluctuations_under_a_shared_trend_never_pass(tmp_path):
    verdicts = []
    for seed in range(10):
        npu, gpu = independent_pair(seed)
        summary = judge(tmp_path / str(seed), npu, gpu, megatron_core_version="0.16.1")
        lm = summary.series["lm_loss"]
        assert 0.003 <= lm.mean_rel_err <= 0.006 and lm.step1_rel_err < 1e-6
        assert lm.pearson > 0.95, "the raw correlation is high through the trend alone"
        assert lm.comove < 0.5
        verdicts.append(summary.verdict)
        assert any(d["pattern"] == "uncorrelated" and "sample order" in d["message"]
                   and "crossalign preflight data" in d["message"] for d in summary.diagnosis)
    assert verdicts == ["fail"] * 10


FAMILY_SAMPLE = 4  # pairs per member and kind in the suite; benchmarks/verdict_family.py runs the full count


def test_generator_family_never_false_passes_nor_false_fails():
    """A seeded sample of the generator family (crossalign.report.evidence: warmup then fall, steep falls with
    time constants 2-50 steps, plateaus, slow drift, shared spikes, the benign step-2 transient, quiet runs;
    fluctuations 0.1%-5% per step, 10-1000 steps, log intervals 1-10, fp32 or bf16 noise on one or both sides),
    written as MindFormers pynative and Megatron 0.16.1 logs and judged: runs fed different samples never
    pass, aligned runs never fail; too little evidence is invalid.

    Measured by ``benchmarks/verdict_family.py --pairs 290`` (2,030 different and 2,030 aligned pairs, seeds
    0-289 of each member): false pass 0 of 2,030 (923 fail, 1,107 invalid), false fail 0 of 2,030 (896 pass,
    1,134 invalid). Per member, of 290 pairs each (different: fail / invalid; aligned: pass / invalid):
    steep_fall 157/133, 154/136; warmup_then_fall 145/145, 146/144; plateau 145/145, 148/142; slow_drift
    143/147, 155/135; shared_spikes 154/136, 134/156; step2_transient 171/119, 150/140; quiet 8/282, 9/281.
    Invalid: fewer than 20 lines (short runs, long log intervals), fluctuations at the print resolution,
    or bf16 noise as large as the runs' own fluctuation.
    """
    verdicts = {kind: [] for kind in evidence.KINDS}
    for member in evidence.FAMILY:
        for kind in evidence.KINDS:
            for pair in evidence.pairs(member, kind, FAMILY_SAMPLE, first_seed=10_000):
                summary = evidence.judge(pair)
                verdicts[kind].append(summary.verdict)
                if summary.verdict == "invalid":
                    assert summary.reasons, pair
                assert summary.verdict != ("pass" if kind == "different" else "fail"), (member.name, pair.seed)
    assert verdicts["different"].count("fail") >= len(verdicts["different"]) // 4
    assert verdicts["aligned"].count("pass") >= len(verdicts["aligned"]) // 3


def test_a_steep_shared_fall_does_not_make_different_samples_co_move(tmp_path):
    """The held-out case: 120 steps, a fall with a time constant of a few steps, 0.4% fluctuations of each side's
    own, the same step 1: the mean error stays under 1%, only co-movement can tell, and it fails."""
    for seed in range(5):
        rng = np.random.default_rng(seed)
        base = 11.9 - 2.0 * (1 - np.exp(-np.arange(STEPS) / rng.uniform(2, 5)))
        gpu = base * (1 + rng.normal(0, 0.004, STEPS))
        npu = base * (1 + rng.normal(0, 0.004, STEPS))
        npu[0] = gpu[0]
        summary = judge(tmp_path / str(seed), npu, gpu, megatron_core_version="0.16.1")
        lm = summary.series["lm_loss"]
        assert lm.mean_rel_err < 0.01 and lm.comove < 0.3 < lm.comove_min
        assert summary.verdict == "fail" and "uncorrelated" in [d["pattern"] for d in summary.diagnosis]


def test_aligned_pair_passes_and_an_offset_fails(tmp_path):
    npu, gpu = aligned_pair(1)
    aligned = judge(tmp_path / "a", npu, gpu, megatron_core_version="0.16.1")
    assert aligned.verdict == "pass" and aligned.series["lm_loss"].comove > 0.95
    assert aligned.coverage == {"expected": STEPS, "compared": STEPS, "log_interval": 1, "missing": "",
                                "basis": aligned.coverage["basis"]}
    assert not aligned.gold_standard  # 0.05% noise at step 1 is a pass, not a bitwise-level conversion
    offset = judge(tmp_path / "o", gpu * 1.02, gpu, megatron_core_version="0.16.1")
    assert offset.verdict == "fail" and not offset.gold_standard


def test_gold_standard_only_when_the_run_passes(tmp_path):
    npu, gpu = aligned_pair(2)
    npu = gpu * (1 + 1e-6 * np.cos(np.arange(STEPS)))
    npu[60:] *= 1.03  # step 1 is bitwise-level, the rest of the run is not
    summary = judge(tmp_path, npu, gpu, megatron_core_version="0.16.1")
    assert summary.series["lm_loss"].gold and summary.verdict == "fail" and not summary.gold_standard


def test_a_truncated_log_is_incomplete_not_a_pass(tmp_path):
    npu, gpu = aligned_pair(3)
    summary = judge(tmp_path / "d", npu, gpu[:3], megatron_core_version="0.16.1")
    assert summary.verdict == "invalid"
    assert any(r.startswith("incomplete: 3 of 120 steps compared") and "4-120" in r for r in summary.reasons)
    expected = judge(tmp_path / "e", npu[:100], gpu[:100], megatron_core_version="0.16.1", expect_steps=120)
    assert expected.verdict == "invalid" and expected.coverage["compared"] == 100
    assert any("incomplete: 100 of 120" in r and "train_iters" in r for r in expected.reasons)


def test_too_few_steps_to_judge_is_invalid(tmp_path):
    npu, gpu = aligned_pair(4, steps=3)
    summary = judge(tmp_path, npu, gpu, megatron_core_version="0.16.1")
    assert summary.verdict == "invalid" and any("too few steps to judge" in r for r in summary.reasons)


def test_series_that_cannot_be_compared_are_invalid_with_the_reason(tmp_path):
    npu, gpu = aligned_pair(5, steps=20)
    no_mtp = judge(tmp_path / "m", npu, gpu, megatron_core_version="0.16.1", mtp_expected=True)
    assert no_mtp.verdict == "invalid" and any("neither log printed an MTP loss" in r for r in no_mtp.reasons)
    aux = list(1.0 + 0.01 * np.sin(np.arange(20)))
    no_aux = judge(tmp_path / "a", npu, gpu, gpu_aux=aux, megatron_core_version="0.16.1", aux_expected=True)
    assert no_aux.verdict == "invalid" and any("aux_loss: logged by gpu only" in r for r in no_aux.reasons)
    graph = write_log(tmp_path / "graph.log", mindformers_lines(list(npu), mtp=[list(npu + 0.4)], mode="graph",
                                                                 mtp_loss_scaling_factor=0.3))
    gpu_log = write_log(tmp_path / "gpu.log", megatron_lines(list(gpu), mtp=[list(gpu + 0.4)]))
    unscaled = compare_logs(graph, gpu_log, tmp_path / "g", CompareOptions(plot=False, megatron_core_version="0.16.1"))
    assert unscaled.verdict == "invalid" and any("mtp_loss_scaling_factor" in r for r in unscaled.reasons)


@pytest.mark.parametrize("writer, reading", [("0.16.1", "mean_undone"), ("0.15.0", "as_printed"),
                                             ("0.20.0", "as_printed")])
def test_unknown_core_version_tests_both_iteration2_readings(tmp_path, writer, reading):
    npu, gpu = aligned_pair(6, steps=30)
    summary = judge(tmp_path, npu, gpu, gpu_core=writer)
    [test] = summary.megatron_iteration2
    assert test["step"] == 2 and test["reading"] == reading
    assert test[f"err_{reading}"] < 0.01 * test["err_" + ({"mean_undone", "as_printed"} - {reading}).pop()]
    assert summary.verdict == "pass" and summary.series["lm_loss"].step1_rel_err < 0.005
    assert any("core version unknown" in n and "%" in n for n in summary.notes)
    step2 = [n for n in summary.notes if "step 2 " in n or "step(s) 2 " in n]
    assert len(step2) == 1 and "tested both ways" in step2[0], "one sentence says how step 2 was read"


def test_known_core_version_bounds_the_correction(tmp_path):
    npu, gpu = aligned_pair(7, steps=30)
    fixed = judge(tmp_path / "f", npu, gpu, gpu_core="0.20.0", megatron_core_version="0.20.0")
    assert fixed.megatron_iteration2 == [] and fixed.inputs["gpu"]["corrections"] == []
    assert fixed.verdict == "pass"
    buggy = judge(tmp_path / "b", npu, gpu, gpu_core="0.19.0", megatron_core_version="0.19.0")
    assert [c["step"] for c in buggy.inputs["gpu"]["corrections"]] == [2] and buggy.verdict == "pass"


def test_the_run_config_sets_the_expectations(tmp_path):
    config = load_config("qwen35_moe_tiny")
    options = options_from_config(config, log_interval=1)
    assert options.megatron_core_version == config.training.megatron_core_version
    assert options.expect_steps == config.training.train_iters
    assert options.mtp_expected is (config.model.mtp_num_layers > 0) and options.aux_expected is True
    assert options.log_interval == 1 and options_from_config(config, expect_steps=7).expect_steps == 7


def test_cli_model_and_expect_steps(tmp_path):
    config = load_config("qwen35_dense_tiny")
    n = config.training.train_iters
    npu, gpu = aligned_pair(8, steps=n + 5)
    npu_log = write_log(tmp_path / "npu.log", mindformers_lines(list(npu[:n]), mtp=[list(npu[:n] + 0.4)]))
    gpu_log = write_log(tmp_path / "gpu.log", megatron_lines(list(gpu[:n - 1]), mtp=[list(gpu[:n - 1] + 0.4)]))
    result = CliRunner().invoke(app, ["compare", "--npu-log", str(npu_log), "--gpu-log", str(gpu_log), "--out",
                                      str(tmp_path / "out"), "--model", "qwen35_dense_tiny", "--no-plot"])
    assert result.exit_code == 2, result.output
    assert f"incomplete: {n - 1} of {n} steps" in result.output
    data = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert data["criteria"]["expect_steps"] == n and data["coverage"]["expected"] == n
    result = CliRunner().invoke(app, ["compare", "--npu-log", str(npu_log), "--gpu-log", str(gpu_log), "--out",
                                      str(tmp_path / "out2"), "--model", "qwen35_dense_tiny", "--expect-steps",
                                      str(n - 1), "--no-plot"])
    assert result.exit_code == 0, result.output
    assert f"{n - 1} of {n - 1} expected steps compared" in result.output


def test_extra_losses_both_logs_print_are_reported_not_judged(tmp_path):
    """A loss other than lm, MTP and aux (here the indexer loss) is compared by name when both print it."""
    npu, gpu = aligned_pair(9, steps=30)
    indexer = 0.5 + 0.01 * np.sin(np.arange(30))
    npu_lines = [line.replace(", lr:", f", indexer_loss: {indexer[i] * 1.2:10.6f}, lr:")
                 for i, line in enumerate(mindformers_lines(list(npu)))]
    gpu_lines = [line.replace(" | loss scale:", f" | indexer loss: {indexer[i]:.6E} | loss scale:")
                 for i, line in enumerate(megatron_lines(list(gpu)))]
    summary = compare_logs(write_log(tmp_path / "npu.log", npu_lines), write_log(tmp_path / "gpu.log", gpu_lines),
                           tmp_path / "out", CompareOptions(plot=False, megatron_core_version="0.16.1"))
    extra = summary.series["indexer_loss"]
    assert not extra.required and extra.step1_rel_err == pytest.approx(0.2, rel=1e-4)
    assert summary.verdict == "pass"  # reported, not judged
