"""Megatron log parsing: real-looking logs with noise, the core-0.16 iteration-2 mean, restarts, load failures."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from crossalign.sides.log_common import LogFormatError
from crossalign.logs import parse_log
from crossalign.sides.megatron.log_parser import parse_megatron_log
from crossalign.sides.megatron.log_lines import megatron_line
from crossalign.logs.synthetic import megatron_lines, write_log

FIXTURES = Path(__file__).parent / "fixtures" / "logs"
LM = [11.91, 11.85, 11.80, 11.76, 11.70, 11.65, 11.61, 11.55, 11.50, 11.46]
MTP = [12.4 - 0.04 * k for k in range(10)]
WARMUP = [1e-5 * min(k, 4) / 4 for k in range(10)]  # applied lr of steps 1..10


def test_noisy_log_gives_every_series_and_undoes_the_iteration2_mean():
    df = parse_megatron_log(FIXTURES / "megatron_0.16_noise.log")
    assert list(df.columns) == ["step", "lm_loss", "mtp_1_loss", "aux_loss", "lr", "grad_norm", "step_time_ms"]
    assert df["step"].tolist() == list(range(1, 11))
    np.testing.assert_allclose(df["lm_loss"], LM, rtol=1e-6)  # step 2 printed 11.88 = mean(11.91, 11.85)
    np.testing.assert_allclose(df["mtp_1_loss"], MTP, rtol=1e-6)
    assert df.attrs["corrections"][0]["raw"]["lm_loss"] == pytest.approx(11.88)
    assert df.attrs["lr_step_offset"] == 1
    np.testing.assert_allclose(df["lr"].iloc[:-1], WARMUP[1:], rtol=1e-6)  # the next step's lr
    assert df.attrs["invalid"] == []
    assert any("2*printed(2) - printed(1)" in n for n in df.attrs["notes"])


def test_older_core_reads_the_second_line_as_is():
    df = parse_megatron_log(FIXTURES / "megatron_0.16_noise.log", core_version="0.15.3")
    assert df["lm_loss"].iloc[1] == pytest.approx(11.88)
    assert df.attrs["corrections"] == []


def test_a_non_strict_load_is_recorded_and_extra_state_only_is_a_note(tmp_path):
    df = parse_megatron_log(FIXTURES / "megatron_incompatible_keys.log")
    assert df.attrs["invalid"] == [] and len(df.attrs["non_strict_load"]) == 1  # the comparison decides
    assert "load_return: None" in df.attrs["non_strict_load"][0]  # what real Megatron prints (tests/test_rehearsal.py)

    text = (FIXTURES / "megatron_0.16_noise.log").read_text().replace(
        "training ...\n", "load_return: _IncompatibleKeys(missing_keys=['decoder.layers.0.mlp.linear_fc1._extra_state'], "
        "unexpected_keys=[])\ntraining ...\n")
    df = parse_megatron_log(write_log(tmp_path / "extra.log", text.splitlines()))
    assert df.attrs["invalid"] == []
    assert any("_extra_state" in n for n in df.attrs["notes"])


def test_could_not_load_is_invalid(tmp_path):
    lines = ["could not load the checkpoint", "Weights only load failed", *megatron_lines(LM)]
    df = parse_megatron_log(write_log(tmp_path / "x.log", lines))
    assert "could not load the checkpoint" in df.attrs["invalid"][0]


def test_restart_last_wins_and_each_process_gets_its_own_correction():
    df = parse_megatron_log(FIXTURES / "megatron_restart.log")
    assert df["step"].tolist() == list(range(1, 11))
    # process 2 resumed at step 5: its second line (step 6) was a mean of 5 and 6 and is undone too
    assert [c["step"] for c in df.attrs["corrections"]] == [2, 6]
    assert df["lm_loss"].iloc[4] == pytest.approx(LM[4] + 0.002)
    assert df["lm_loss"].iloc[5] == pytest.approx(LM[5] + 0.003)
    assert df.attrs["restart_steps"] == [5, 6]
    assert any("goes back from step 6 to step 5" in n for n in df.attrs["notes"])


def test_rank_prefixed_lines_are_read():
    df = parse_log(FIXTURES / "megatron_multirank.log")
    np.testing.assert_allclose(df["lm_loss"], LM, rtol=1e-6)


def test_log_interval_line_holds_its_interval_and_only_a_first_line_on_a_boundary_is_undone(tmp_path):
    losses = [10.0 + k for k in range(12)]
    fresh = parse_megatron_log(write_log(tmp_path / "i4.log", megatron_lines(losses, log_interval=4)))
    assert fresh["step"].tolist() == [1, 4, 8, 12]
    # iteration 1 is off the boundary: the step-4 line is the interval 1..4 by design, in every core
    assert fresh["lm_loss"].tolist() == pytest.approx([10.0, np.mean(losses[0:4]), np.mean(losses[4:8]),
                                                       np.mean(losses[8:12])])
    assert fresh.attrs["corrections"] == [] and fresh.attrs["log_interval"] == 4
    # a process resumed at iteration 4 (on the boundary): 0.16-0.19 print mean(4..8) at step 8
    resumed = megatron_lines(losses[3:], log_interval=4, first_step=4)
    df = parse_megatron_log(write_log(tmp_path / "r4.log", resumed))
    assert df["step"].tolist() == [4, 8, 12]
    assert df["lm_loss"].tolist() == pytest.approx([losses[3], np.mean(losses[4:8]), np.mean(losses[8:12])])
    assert [c["step"] for c in df.attrs["corrections"]] == [8]
    fixed = megatron_lines(losses[3:], log_interval=4, first_step=4, core_version="0.20.0")
    df = parse_megatron_log(write_log(tmp_path / "f4.log", fixed), core_version="0.20.0")
    assert df["lm_loss"].tolist() == pytest.approx([losses[3], np.mean(losses[4:8]), np.mean(losses[8:12])])
    assert df.attrs["corrections"] == []


def test_nan_loss_is_not_printed_and_reads_as_nan(tmp_path):
    losses = [11.0, 10.9, 10.8, float("nan"), 10.6]
    df = parse_megatron_log(write_log(tmp_path / "nan.log", megatron_lines(losses, core_version="0.15.0")))
    assert math.isnan(df["lm_loss"].iloc[3]) and df["lm_loss"].iloc[4] == pytest.approx(10.6)
    assert any("printed no lm loss at step(s) 4" in n for n in df.attrs["notes"])


def test_inf_is_printed_and_read():
    line = megatron_line(1, 2, consumed_samples=8, elapsed_ms=1.0, learning_rate=1e-5, global_batch_size=8,
                         losses={"lm loss": float("inf")}, grad_norm=float("nan"))
    assert "lm loss: INF" in line


def test_lines_laid_out_differently_still_parse(tmp_path):
    def line(step, losses):
        return megatron_line(step, 2, consumed_samples=8, elapsed_ms=5.0, learning_rate=1e-5, global_batch_size=8,
                             losses=losses, grad_norm=2.5)

    lines = [line(1, {"lm loss": 11.0, "mtp_1 loss": 12.0}),
             line(2, {"lm loss": 10.0, "indexer loss": 0.5, "mtp_1 loss": 11.0})]  # unknown field in between
    df = parse_megatron_log(write_log(tmp_path / "odd.log", lines), core_version="0.15.0")
    assert df[["lm_loss", "mtp_1_loss", "grad_norm"]].to_numpy().tolist() == [[11.0, 12.0, 2.5], [10.0, 11.0, 2.5]]


@pytest.mark.parametrize("name, text", [("empty.log", ""), ("foreign.log", None), ("truncated_megatron.log", None)])
def test_not_a_training_log_names_the_file(tmp_path, name, text):
    path = FIXTURES / name if text is None else write_log(tmp_path / name, [])
    with pytest.raises(LogFormatError, match=name):
        parse_log(path)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(LogFormatError, match="no such log file"):
        parse_log(tmp_path / "nope.log")


def test_cut_off_last_line_is_dropped(tmp_path):
    lines = megatron_lines(LM[:4], core_version="0.15.0")
    path = tmp_path / "cut.log"
    path.write_text("\n".join(lines) + "\n" + lines[-1][:150])
    df = parse_log(path)
    assert df["step"].tolist() == [1, 2, 3, 4]
    assert any("cut off" in n for n in df.attrs["notes"])


@pytest.mark.parametrize("cut_after, losses, column", [
    ("my_router_lo", {"lm loss": 3.0, "my_router_loss": 0.25}, "my_router_loss"),  # an unknown extra loss
    ("mtp_1 lo", {"lm loss": 3.0, "mtp_1 loss": 3.5}, "mtp_1_loss"),
    ("nsp", {"lm loss": 3.0, "nsp loss": 0.6}, "nsp_loss"),  # the break ate the space
])
def test_a_record_wrapped_inside_a_field_name_is_rejoined_by_the_name(tmp_path, cut_after, losses, column):
    line = megatron_line(1, 2, consumed_samples=8, elapsed_ms=5.0, learning_rate=1e-5, global_batch_size=8,
                         losses=losses, grad_norm=2.5)
    at = line.index(cut_after) + len(cut_after)
    rest = line[at:].removeprefix(" ")
    df = parse_megatron_log(write_log(tmp_path / "wrapped.log", [line[:at], rest]), core_version="0.15.0")
    assert df[column].tolist() == [list(losses.values())[1]] and df["grad_norm"].tolist() == [2.5]
    assert not df.attrs["unreadable"] and not df.attrs["notes"]
