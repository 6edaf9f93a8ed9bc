"""``crossalign compare``: exit codes 0 pass / 1 fail / 2 bad input or invalid run, table and report."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from crossalign.cli import app
from crossalign.logs.synthetic import megatron_lines, mindformers_lines, write_log

FIXTURES = Path(__file__).parent / "fixtures" / "logs"
LM30 = [2.5 - 0.01 * k + 0.01 * e for k, e in enumerate(np.random.default_rng(3).normal(size=30))]
runner = CliRunner()


def compare(*args: str):
    return runner.invoke(app, ["compare", *args, "--no-plot"])


def test_pass_exits_0_and_prints_the_metrics(tmp_path):
    rng = np.random.default_rng(11)
    gpu_lm = [x * (1 + 1e-4 * e) for x, e in zip(LM30, rng.normal(size=30))]
    npu = write_log(tmp_path / "npu.log", mindformers_lines(LM30, mtp=[[x + 0.4 for x in LM30]]))
    gpu = write_log(tmp_path / "gpu.log", megatron_lines(gpu_lm, mtp=[[x + 0.4 for x in gpu_lm]]))
    result = compare("--npu-log", str(npu), "--gpu-log", str(gpu), "--out", str(tmp_path / "out"))
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
    assert result.exit_code in (0, 2), result.output  # 7 steps: too few to tell co-movement, by design
    data = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert data["criteria"]["excluded_steps"] == [2, 4, 5]
    assert data["series"]["mtp_1_loss"]["steps_compared"] == 7


def test_bad_exclude_steps_is_a_usage_error(tmp_path):
    result = compare("--npu-log", "a", "--gpu-log", "b", "--out", str(tmp_path), "--exclude-steps", "x-2")
    assert result.exit_code == 2 and "exclude-steps" in result.output


def _pair(tmp_path, npu_lm, gpu_lm, **npu_kwargs):
    npu = write_log(tmp_path / "npu.log", mindformers_lines(npu_lm, **npu_kwargs))
    gpu = write_log(tmp_path / "gpu.log", megatron_lines(gpu_lm))
    return npu, gpu


def _leftovers(folder: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


def test_out_on_an_existing_file_names_it_and_exits_2(tmp_path):
    npu, gpu = _pair(tmp_path, LM30, LM30)
    out = tmp_path / "report.html"
    out.write_text("an earlier file\n")
    result = compare("--npu-log", str(npu), "--gpu-log", str(gpu), "--out", str(out))
    assert result.exit_code == 2, result.output
    assert str(out) in result.output and "existing file" in result.output and "Traceback" not in result.output
    assert out.read_text() == "an earlier file\n" and _leftovers(tmp_path, {"npu.log", "gpu.log", "report.html"}) == []


@pytest.fixture
def tmpfs(tmp_path):
    """A real tmpfs of 64 KiB mounted under tmp_path (needs root: a read-only mount is the only thing that
    stops root from writing, chmod does not); skipped with the reason where it cannot be mounted."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_out_on_a_read_only_mount_names_the_path_and_the_cause_and_leaves_nothing(tmp_path, tmpfs):
    npu, gpu = _pair(tmp_path, LM30, LM30)
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    out = tmpfs / "runs" / "report"
    result = compare("--npu-log", str(npu), "--gpu-log", str(gpu), "--out", str(out))
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert str(out) in text and "Read-only file system" in text and "Traceback" not in text
    assert _leftovers(tmpfs, set()) == []


def test_out_on_a_full_disk_names_the_cause_and_leaves_nothing(tmp_path, tmpfs):
    npu, gpu = _pair(tmp_path, LM30, LM30)
    filler = os.open(tmpfs / "filler", os.O_WRONLY | os.O_CREAT)
    with pytest.raises(OSError, match="No space left"):  # fill the 64 KiB up
        while True:
            os.write(filler, b"x" * 4096)
    os.close(filler)
    out = tmpfs / "new" / "report"
    result = compare("--npu-log", str(npu), "--gpu-log", str(gpu), "--out", str(out))
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert str(out) in text and "No space left on device" in text and "Traceback" not in text
    assert _leftovers(tmpfs, {"filler"}) == []  # neither the temporary folder nor the parent made for it


def test_the_same_log_on_both_sides_is_invalid_not_gold(tmp_path):
    _, gpu = _pair(tmp_path, LM30, LM30)
    copy = tmp_path / "copy.log"
    copy.write_bytes(gpu.read_bytes())
    header = write_log(tmp_path / "header.log", ["training ...", *megatron_lines(LM30)])  # the same records
    for other in (gpu, copy, header):
        result = compare("--npu-log", str(other), "--gpu-log", str(gpu), "--out", str(tmp_path / "out"))
        assert result.exit_code == 2, result.output
        data = json.loads((tmp_path / "out" / "summary.json").read_text())
        assert data["verdict"] == "invalid" and not data["gold_standard"]
        assert data["reasons"][0].startswith("both sides are the same log"), data["reasons"]


def test_a_log_in_the_other_sides_format_is_refused_unless_allowed(tmp_path):
    npu, gpu = _pair(tmp_path, LM30, [x * 1.001 for x in LM30])
    swapped = compare("--npu-log", str(gpu), "--gpu-log", str(npu), "--out", str(tmp_path / "out"))
    assert swapped.exit_code == 2 and not (tmp_path / "out").exists()
    text = " ".join(swapped.output.split())
    assert f"--npu-log {gpu} is a Megatron log" in text and f"--gpu-log {npu} is a MindFormers" in text
    assert "swapped" in text and "--allow-any-format" in text
    other = write_log(tmp_path / "gpu2.log", megatron_lines([x * 1.002 for x in LM30]))
    both = compare("--npu-log", str(other), "--gpu-log", str(gpu), "--out", str(tmp_path / "out"))
    assert both.exit_code == 2 and "--npu-log" in both.output and not (tmp_path / "out").exists()
    allowed = compare("--npu-log", str(other), "--gpu-log", str(gpu), "--out", str(tmp_path / "out"),
                      "--allow-any-format")
    assert "verdict:" in allowed.output, allowed.output
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["inputs"]["npu"]["format"] == "megatron"


def _diagnosis(tmp_path, result):
    assert result.exit_code in (1, 2), result.output
    return [d["pattern"] for d in json.loads((tmp_path / "out" / "summary.json").read_text())["diagnosis"]]


def test_a_moe_log_against_a_dense_one_is_named_as_different_models(tmp_path):
    rng = np.random.default_rng(5)
    dense = [2.6 * (1 + 0.004 * e) - 0.005 * k for k, e in enumerate(rng.normal(size=30))]
    moe = [2.7 * (1 + 0.004 * e) - 0.006 * k for k, e in enumerate(rng.normal(size=30))]  # 3.8% apart at step 1
    npu, gpu = _pair(tmp_path, moe, dense, aux=[1.02] * 30, lr_applied=[2e-5] * 30)
    result = compare("--npu-log", str(npu), "--gpu-log", str(gpu), "--out", str(tmp_path / "out"))
    patterns = _diagnosis(tmp_path, result)
    assert patterns[0] == "different_models" and "lr_mismatch" not in patterns and "uncorrelated" not in patterns
    text = " ".join(result.output.split())
    assert "different models" in text and "load-balancing loss is printed by npu only" in text


def test_a_loss_scale_far_apart_at_step_1_is_named_as_different_models(tmp_path):
    npu, gpu = _pair(tmp_path, [3.3 - 0.01 * k for k in range(30)], LM30)
    patterns = _diagnosis(tmp_path, compare("--npu-log", str(npu), "--gpu-log", str(gpu),
                                            "--out", str(tmp_path / "out")))
    assert patterns[0] == "different_models"


def test_an_aux_loss_printed_by_one_side_alone_is_not_called_a_different_model(tmp_path):
    npu, gpu = _pair(tmp_path, LM30, [x * 1.001 for x in LM30], aux=[1.02] * 30)
    result = compare("--npu-log", str(npu), "--gpu-log", str(gpu), "--out", str(tmp_path / "out"))
    patterns = [d["pattern"] for d in json.loads((tmp_path / "out" / "summary.json").read_text())["diagnosis"]]
    assert "different_models" not in patterns, result.output


def test_a_path_longer_than_the_terminal_is_printed_whole():
    """The CLI never breaks a printed path (or run id) across lines: the terminal wraps it, copy-paste keeps it."""
    from crossalign.cli.common import console

    path = "/store/" + "a-long-folder-name/" * 8 + "06-compare/report.html"
    with console.capture() as captured:
        console.print(f"verdict: pass    report: {path}", highlight=False)
    assert console.width < len(path) and path in captured.get()
