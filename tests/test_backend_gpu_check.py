"""The CPU-runnable pieces of scripts/gpu_check.sh: inputs, fp32 reference, reading and judging step 1."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("gpu_check", None)


def megatron_line(step: int, total: int, lm: float, mtp: float) -> str:
    return (f" [2026-03-20 10:11:12.345678] iteration {step:8d}/{total:8d} | consumed samples: {4 * step:12d} | "
            f"elapsed time per iteration (ms): 812.3 | learning rate: 3.000000E-03 | global batch size:     4 | "
            f"lm loss: {lm:.6E} | mtp_1 loss: {mtp:.6E} | loss scale: 1.0 | grad norm: 1.234 | "
            f"number of skipped iterations:   0 | number of nan iterations:   0 |")


def test_check_config_is_a_short_run(gpu_check):
    config = gpu_check.check_config("qwen35_dense_tiny")
    assert config.training.train_iters == 2 and config.training.lr_warmup_iters == 1
    assert config.model.name == "qwen35_dense_tiny"


@pytest.mark.timeout(300)
def test_reference_and_step1_judgement(gpu_check, tmp_path: Path):
    config = gpu_check.check_config("qwen35_moe_tiny")
    data, checkpoint = gpu_check.prepare_inputs(config, tmp_path)
    assert (checkpoint / "latest_checkpointed_iteration.txt").exists()

    reference = gpu_check.reference_losses(config, checkpoint, data.prefix)
    assert set(reference) == {"lm_loss", "mtp_1_loss"}
    assert 6.0 < reference["lm_loss"] < 9.0  # random init: about ln(vocab) = 7.6

    # the two CPU forms of the gated delta rule agree (what the CUDA kernel is held to)
    recurrent = gpu_check.reference_losses(config, checkpoint, data.prefix, "cpu", "recurrent")
    checks = [gpu_check.Check(name, reference[name], recurrent[name], gpu_check.KERNEL_TOLERANCE)
              for name in reference]
    assert all(check.ok for check in checks), [c.line() for c in checks]

    close = tmp_path / "close.log"
    close.write_text(megatron_line(1, 2, reference["lm_loss"] * 1.001, reference["mtp_1_loss"] * 0.999) + "\n"
                     + megatron_line(2, 2, 7.0, 7.0) + "\n")
    logged = gpu_check.megatron_step1(close, "0.16.1")
    assert logged["lm_loss"] == pytest.approx(reference["lm_loss"] * 1.001, rel=1e-6)
    assert all(check.ok for check in gpu_check.step1_checks(reference, logged))

    far = tmp_path / "far.log"
    far.write_text(megatron_line(1, 2, reference["lm_loss"] * 1.02, reference["mtp_1_loss"]) + "\n")
    verdicts = {c.name: c.ok for c in gpu_check.step1_checks(reference, gpu_check.megatron_step1(far, "0.16.1"))}
    assert verdicts == {"step-1 lm_loss (Megatron vs fp32 reference)": False,
                        "step-1 mtp_1_loss (Megatron vs fp32 reference)": True}

    with pytest.raises(ValueError, match="lacks mtp_1_loss"):
        gpu_check.step1_checks(reference, {"lm_loss": reference["lm_loss"]})
