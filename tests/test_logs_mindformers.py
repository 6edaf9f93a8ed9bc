"""MindFormers log parsing: pynative and graph mode, logger prefixes, ranks, N/A stages, restarts."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from crossalign.sides.log_common import LogFormatError
from crossalign.logs import detect_format, parse_log
from crossalign.sides.mindformers.log_parser import parse_mindformers_log
from crossalign.sides.mindformers.log_lines import MINDFORMERS_PYNATIVE_SOURCE, mindformers_prefix, pynative_line
from crossalign.logs.synthetic import mindformers_lines, write_log

FIXTURES = Path(__file__).parent / "fixtures" / "logs"
LM = [11.91, 11.85, 11.80, 11.76, 11.70, 11.65, 11.61, 11.55, 11.50, 11.46]
MTP = [12.4 - 0.04 * k for k in range(10)]
AUX = [1.02 - 0.001 * k for k in range(10)]
WARMUP = [1e-5 * min(k, 4) / 4 for k in range(10)]


def test_pynative_with_logger_prefix_and_noise():
    df = parse_mindformers_log(FIXTURES / "mindformers_pynative.log")
    assert df.attrs["format"] == "mindformers-pynative"
    assert df["step"].tolist() == list(range(1, 11))
    np.testing.assert_allclose(df["lm_loss"], LM, atol=1e-6)
    np.testing.assert_allclose(df["mtp_1_loss"], MTP, atol=1e-6)
    np.testing.assert_allclose(df["aux_loss"], AUX, atol=1e-6)
    np.testing.assert_allclose(df["lr"].iloc[:-1], WARMUP[1:], rtol=1e-6)  # pynative prints the next step's lr
    assert df.attrs["lr_step_offset"] == 1
    assert df["step_time_ms"].iloc[0] == 1500


def test_graph_mode_uses_lm_loss_not_the_total_and_unscales_mtp():
    df = parse_mindformers_log(FIXTURES / "mindformers_graph.log", mtp_loss_scaling_factor=0.3)
    assert df.attrs["format"] == "mindformers-graph"
    np.testing.assert_allclose(df["lm_loss"], LM, atol=1e-6)
    np.testing.assert_allclose(df["mtp_1_loss"], MTP, atol=1e-5)
    np.testing.assert_allclose(df["lr"], WARMUP, rtol=1e-6)  # graph mode prints the applied lr
    assert df.attrs["lr_step_offset"] == 0
    assert df["grad_norm"].iloc[0] == pytest.approx(3.0)


def test_graph_mtp_without_factor_is_flagged_not_guessed():
    df = parse_mindformers_log(FIXTURES / "mindformers_graph.log")
    assert "mtp_1_loss" not in df.columns
    assert "mtp_loss_scaling_factor" in df.attrs["unusable"]["mtp_1_loss"]


def test_graph_dense_total_only_is_said(tmp_path):
    path = write_log(tmp_path / "g.log", mindformers_lines(LM, mode="graph"))
    df = parse_mindformers_log(path)
    np.testing.assert_allclose(df["lm_loss"], LM, atol=1e-6)
    assert df.attrs["loss_is_total"] is True
    assert any("only the total" in n for n in df.attrs["notes"])


def test_graph_non_sink_and_epochs_give_global_steps(tmp_path):
    lines = [
        "{ Epoch:[  1/  2], step:[    1/    2], loss:[11.000000/11.000000], per_step_time: 10ms, lr: [1e-05], "
        "overflow cond: False, loss_scale: 1.0, global_norm: [2.5]",
        "{ Epoch:[  2/  2], step:[    1/    2], loss:[10.500000/10.750000], per_step_time: 10ms, lr: 1e-05, "
        "overflow cond: False, loss_scale: 1.0, global_norm: [2.4]",
    ]
    df = parse_log(write_log(tmp_path / "ns.log", lines))
    assert df["step"].tolist() == [1, 3]
    assert df["lm_loss"].tolist() == [11.0, 10.5]
    assert df["lr"].tolist() == [1e-5, 1e-5]


def test_interleaved_ranks_take_the_last_stage():
    df = parse_log(FIXTURES / "mindformers_multirank.log")
    assert df["step"].tolist() == list(range(1, 11))
    np.testing.assert_allclose(df["lm_loss"], LM, atol=1e-6)
    assert any("[rank3]" in n for n in df.attrs["notes"])


def test_only_non_last_stage_lines_is_an_error(tmp_path):
    lines = [pynative_line(k, 3, consumed_samples=8 * k, global_batch_size=8, loss=None, per_step_time_ms=10,
                           lr=1e-5, grad_norm=None) for k in (1, 2, 3)]
    with pytest.raises(LogFormatError, match="N/A"):
        parse_log(write_log(tmp_path / "stage0.log", lines))


def test_unprefixed_duplicates_from_ranks_are_one_step(tmp_path):
    lines = [line for line in mindformers_lines(LM[:4]) for _ in range(2)]
    df = parse_log(write_log(tmp_path / "dup.log", lines))
    assert df["step"].tolist() == [1, 2, 3, 4]
    assert df.attrs["duplicate_steps"] == [1, 2, 3, 4] and df.attrs["restart_steps"] == []


def test_restart_last_wins_and_is_reported():
    df = parse_log(FIXTURES / "mindformers_restart.log")
    assert df["step"].tolist() == list(range(1, 11))
    assert df["lm_loss"].iloc[3] == pytest.approx(LM[3] - 0.004)
    assert df.attrs["restart_steps"] == [4]
    assert any("goes back from step 6 to step 4" in n for n in df.attrs["notes"])


def test_nan_values_are_read(tmp_path):
    losses = [11.0, float("nan"), 10.8]
    df = parse_log(write_log(tmp_path / "nan.log", mindformers_lines(losses, mtp=[[12.0, float("inf"), 11.9]])))
    assert math.isnan(df["lm_loss"].iloc[1]) and math.isinf(df["mtp_1_loss"].iloc[1])


def test_file_handler_prefix_and_missing_lr(tmp_path):
    message = pynative_line(1, 1, consumed_samples=8, global_batch_size=8, loss=11.5, per_step_time_ms=10,
                            lr=None, grad_norm=None, mtp_losses=(12.0, 12.5))
    path = write_log(tmp_path / "fh.log", [f"[INFO] 2026-03-20 10:11:12,345 [{MINDFORMERS_PYNATIVE_SOURCE}] "
                                           f"on_step_end: {message}"])
    df = parse_log(path)
    assert df[["lm_loss", "mtp_1_loss", "mtp_2_loss"]].iloc[0].tolist() == [11.5, 12.0, 12.5]
    assert "lr" not in df.attrs["logged"] and math.isnan(df["grad_norm"].iloc[0])


def test_two_formats_in_one_file_is_an_error(tmp_path):
    lines = [*mindformers_lines(LM[:2]), *mindformers_lines(LM[:2], mode="graph")]
    path = write_log(tmp_path / "both.log", lines)
    with pytest.raises(LogFormatError, match="several formats"):
        detect_format(path, path.read_text())


def test_prefix_helper_matches_the_logger_layout():
    prefix = mindformers_prefix(MINDFORMERS_PYNATIVE_SOURCE)
    assert prefix.endswith("[mindformers/pynative/callback/loss_callback.py:337] - INFO - ")
    assert " - mindformers/" in prefix


def test_lines_laid_out_differently_still_parse(tmp_path):
    plain = pynative_line(1, 2, consumed_samples=8, global_batch_size=8, loss=11.0, per_step_time_ms=10,
                          lr=1e-5, grad_norm=2.0)
    with_aux = pynative_line(2, 2, consumed_samples=16, global_batch_size=8, loss=10.5, per_step_time_ms=10,
                             lr=1e-5, grad_norm=2.0, load_balancing_loss=1.25)
    df = parse_log(write_log(tmp_path / "mixed.log", [plain, with_aux]))
    assert df["lm_loss"].tolist() == [11.0, 10.5]
    assert math.isnan(df["aux_loss"].iloc[0]) and df["aux_loss"].iloc[1] == 1.25


def test_release_branch_lines_without_consumed_samples(tmp_path):
    """r1.9.0/r2.0.0 print no consumed_samples/global_batch_size (master added them in July 2026)."""
    lines = [mindformers_prefix(MINDFORMERS_PYNATIVE_SOURCE) + pynative_line(
        k, 3, consumed_samples=None, global_batch_size=None, loss=LM[k - 1], per_step_time_ms=10, lr=1e-5,
        grad_norm=2.0, load_balancing_loss=AUX[k - 1], mtp_losses=(MTP[k - 1],)) for k in (1, 2, 3)]
    assert "consumed_samples" not in lines[0]
    df = parse_log(write_log(tmp_path / "r200.log", lines))
    assert df.attrs["format"] == "mindformers-pynative" and df["step"].tolist() == [1, 2, 3]
    np.testing.assert_allclose(df[["lm_loss", "aux_loss", "mtp_1_loss"]].to_numpy(),
                               np.array([LM[:3], AUX[:3], MTP[:3]]).T, atol=1e-6)


def _pynative_log(tmp_path: Path, name: str, mtp: list[float], lr: list[float], extra: dict[int, str] | None = None,
                  nan_at: int | None = None) -> Path:
    lines = []
    for k in range(1, len(mtp) + 1):
        lines += (extra or {}).get(k, "").splitlines()
        lines.append(mindformers_prefix(MINDFORMERS_PYNATIVE_SOURCE) + pynative_line(
            k, len(mtp), consumed_samples=8 * k, global_batch_size=8, loss=LM[k - 1], per_step_time_ms=10,
            lr=lr[k - 1], grad_norm=float("nan") if k == nan_at else 2.0, load_balancing_loss=AUX[k - 1],
            mtp_losses=(mtp[k - 1],)))
    return write_log(tmp_path / name, lines)


def test_mtp_loss_is_read_by_the_release_rule(tmp_path):
    """r2.0.0 prints mtp_1_loss multiplied by mtp_loss_scaling_factor / mtp_num_layers, 2.1.0 unscaled: given the
    release and the factor (0.3, one MTP layer) both frames hold the plain cross entropy."""
    scaled = _pynative_log(tmp_path, "r200.log", [0.3 * x for x in MTP[:4]], WARMUP[1:5])
    plain = _pynative_log(tmp_path, "r210.log", MTP[:4], WARMUP[1:5])
    r200 = parse_mindformers_log(scaled, mtp_loss_scaling_factor=0.3, mindformers_version="2.0.0")
    r210 = parse_mindformers_log(plain, mtp_loss_scaling_factor=0.3, mindformers_version="2.1.0")
    np.testing.assert_allclose(r200["mtp_1_loss"], MTP[:4], atol=1e-5)
    np.testing.assert_allclose(r210["mtp_1_loss"], MTP[:4], atol=1e-6)
    assert any("divided by 0.3" in note for note in r200.attrs["notes"])
    assert not any("divided by" in note for note in r210.attrs["notes"])
    unknown = parse_mindformers_log(scaled, mindformers_version="2.0.0")  # no factor: cannot be compared
    assert "mtp_1_loss" in unknown.attrs["unusable"]
    with pytest.raises(ValueError, match="releases before 2.0.0"):
        parse_mindformers_log(plain, mindformers_version="1.9.0")


def test_skipped_nan_steps_shift_the_applied_lr(tmp_path):
    """[SkipStepOnNaN] (2.1.0 pynative/trainer/trainer.py:1966): the skipped steps leave the optimizer's lr behind."""
    warning = ("2026-11-29 15:28:32,602 - mindformers/out/log[mindformers/pynative/trainer/trainer.py:1966] - "
               "WARNING - "
               "[SkipStepOnNaN] Global gradient norm is nan at step {k}, skipping the optimizer update "
               "(consecutive skipped: 1, total skipped: {n}).")
    lr = [1e-4 * k for k in range(1, 7)]  # printed at step k: the schedule at k
    log = _pynative_log(tmp_path, "skip.log", MTP[:6], lr,
                        extra={2: warning.format(k=2, n=1), 4: warning.format(k=4, n=2)})
    df = parse_mindformers_log(log)
    assert df.attrs["skipped_steps"] == [2, 4]
    # row s: the lr applied at s + 1 = the schedule at the updates done before it: s - (skipped <= s)
    expected = [math.nan, 1e-4, math.nan, 2e-4, 3e-4, 4e-4]
    np.testing.assert_allclose(df["lr"], expected, rtol=1e-6)
    assert any("[SkipStepOnNaN]" in note for note in df.attrs["notes"])
    np.testing.assert_allclose(parse_mindformers_log(_pynative_log(tmp_path, "plain.log", MTP[:6], lr))["lr"], lr)


def test_a_printed_nan_is_told_from_a_value_not_printed(tmp_path):
    log = _pynative_log(tmp_path, "nan.log", MTP[:2] + [math.nan] + MTP[3:4], WARMUP[1:5], nan_at=3)
    df = parse_mindformers_log(log)
    assert df.attrs["printed_nan"]["mtp_1_loss"] == [3] and df.attrs["printed_nan"]["grad_norm"] == [3]
    assert df.attrs["printed_nan"]["lm_loss"] == []


def test_the_comparison_reads_the_mtp_loss_by_the_configs_release(tmp_path):
    from crossalign.config import load_config
    from crossalign.report.compare import options_from_config

    config = load_config("qwen35_moe_tiny", ["training.mindformers_version=2.0.0", "model.mtp_loss_scaling_factor=0.3"])
    options = options_from_config(config)
    assert options.mindformers_version == "2.0.0" and options.mtp_loss_scaling_factor == pytest.approx(0.3)
    scaled = _pynative_log(tmp_path, "r200.log", [0.3 * x for x in MTP[:3]], WARMUP[1:4])
    df = parse_log(scaled, mtp_loss_scaling_factor=options.mtp_loss_scaling_factor,
                   mindformers_version=options.mindformers_version)
    np.testing.assert_allclose(df["mtp_1_loss"], MTP[:3], atol=1e-5)
