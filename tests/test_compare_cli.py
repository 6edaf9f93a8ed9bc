"""``crossalign compare``: exit codes 0 pass / 1 fail / 2 bad input or invalid run, table and report."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from crossalign.cli import app
from crossalign.logs.synthetic import megatron_lines, mindformers_lines, write_log

FIXTURES = Path(__file__).parent / "fixtures" / "logs"
runner = CliRunner()


def compare(*args: str):
    return runner.invoke(app, ["compare", *args, "--no-plot"])


def test_pass_exits_0_and_prints_the_metrics(tmp_path):
    result = compare("--npu-log", str(FIXTURES / "mindformers_pynative.log"),
                     "--gpu-log", str(FIXTURES / "megatron_0.16_noise.log"), "--out", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    assert "verdict: PASS" in result.output and "lm_loss" in result.output and "mtp_1_loss" in result.output
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["verdict"] == "pass"


def test_fail_exits_1(tmp_path):
    lm = [11.0 - 0.01 * k for k in range(10)]
    npu = write_log(tmp_path / "npu.log", mindformers_lines([x * 1.03 for x in lm]))
    gpu = write_log(tmp_path / "gpu.log", megatron_lines(lm))
    result = compare("--npu-log", str(npu), "--gpu-log", str(gpu), "--out", str(tmp_path / "out"))
    assert result.exit_code == 1, result.output
    assert "verdict: FAIL" in result.output and "constant_offset" in result.output


def test_invalid_run_exits_2(tmp_path):
    result = compare("--npu-log", str(FIXTURES / "mindformers_pynative.log"),
                     "--gpu-log", str(FIXTURES / "megatron_incompatible_keys.log"), "--out", str(tmp_path / "out"))
    assert result.exit_code == 2, result.output
    assert "INVALID" in result.output
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["verdict"] == "invalid"


def test_bad_input_exits_2_naming_the_file(tmp_path):
    result = compare("--npu-log", str(FIXTURES / "foreign.log"),
                     "--gpu-log", str(FIXTURES / "megatron_0.16_noise.log"), "--out", str(tmp_path / "out"))
    assert result.exit_code == 2
    assert "foreign.log" in result.output
    assert not (tmp_path / "out").exists()


def test_options_reach_the_comparison(tmp_path):
    result = compare("--npu-log", str(FIXTURES / "mindformers_graph.log"),
                     "--gpu-log", str(FIXTURES / "megatron_0.16_noise.log"), "--out", str(tmp_path / "out"),
                     "--mtp-loss-scaling-factor", "0.3", "--exclude-steps", "2,4-5",
                     "--megatron-core-version", "0.16.1")
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert data["criteria"]["excluded_steps"] == [2, 4, 5]
    assert data["series"]["mtp_1_loss"]["steps_compared"] == 7


def test_bad_exclude_steps_is_a_usage_error(tmp_path):
    result = compare("--npu-log", "a", "--gpu-log", "b", "--out", str(tmp_path), "--exclude-steps", "x-2")
    assert result.exit_code == 2 and "exclude-steps" in result.output
