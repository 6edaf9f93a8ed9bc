"""training.embedded_device: where the embedded megatron-core trainer runs, and what it says it ran."""

from __future__ import annotations

import pytest
import torch

from crossalign.config import load_config
from crossalign.sides.megatron.embedded import device
from crossalign.sides.megatron.embedded.trainer import LocalMegatronBackend


def test_auto_takes_the_gpu_only_where_torch_sees_one():
    assert device.resolve("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert device.resolve("cpu") == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_a_gpu_is_refused_with_the_setting_named():
    with pytest.raises(device.EmbeddedDeviceError, match="training.embedded_device: cuda, but torch sees no GPU"):
        device.resolve("cuda")


def test_the_config_refuses_an_unknown_device():
    base = load_config("qwen35_moe_tiny")
    with pytest.raises(ValueError, match="embedded_device"):
        type(base.training).model_validate({**base.training.model_dump(), "embedded_device": "npu"})


def test_kernels_follow_the_device_and_deterministic_mode():
    assert device.kernels("cpu", False)["delta_rule"] == "megatron.core torch_chunk_gated_delta_rule"
    assert device.kernels("cuda", True)["delta_rule"] == "megatron.core torch_chunk_gated_delta_rule"
    gpu = device.kernels("cuda", False)
    assert gpu["delta_rule"] == "fla chunk_gated_delta_rule (Triton)"
    assert gpu["conv1d"] in ("causal_conv1d_fn (causal-conv1d)", "torch conv1d")


def test_the_implementation_names_the_device():
    config = load_config("qwen35_moe_tiny")
    cpu = config.model_copy(update={"training": config.training.model_copy(update={"embedded_device": "cpu"})})
    assert "optimizer and scheduler on CPU" in LocalMegatronBackend().implementation(cpu)


def test_kernels_name_what_megatron_core_imported():
    from megatron.core.ssm import gated_delta_net

    gpu = device.kernels("cuda", False)
    assert gpu["conv1d"] == ("torch conv1d" if gated_delta_net.causal_conv1d_fn is None
                             else "causal_conv1d_fn (causal-conv1d)")
    assert gpu["l2norm"] == "fla l2norm (Triton)"  # fla is pinned: megatron-core's import of it succeeded


def test_the_report_names_the_device_and_kernels_each_side_trained_with(tmp_path):
    """What the training step records (``device.details``, in its manifest) reaches summary.json and the
    report's heading."""
    import html
    import json
    from pathlib import Path

    from crossalign.report.compare import CompareOptions, compare_logs

    logs = Path(__file__).parent / "fixtures" / "logs"
    recorded = device.details("cpu", True)
    summary = compare_logs(logs / "mindformers_pynative.log", logs / "megatron_0.16_noise.log", tmp_path,
                           CompareOptions(plot=False), implementations={"gpu": "megatron-core 0.16.1"},
                           trained_on={"gpu": recorded})
    gpu = json.loads((tmp_path / "summary.json").read_text())["inputs"]["gpu"]
    assert gpu["device"] == "cpu" and gpu["kernels"] == recorded["kernels"] == summary.inputs["gpu"]["kernels"]
    named = ("trained by megatron-core 0.16.1 on cpu (kernels: delta rule megatron.core "
             "torch_chunk_gated_delta_rule, l2norm torch l2norm (mcore_cpu), conv1d torch conv1d)")
    assert named in (tmp_path / "report.md").read_text()
    assert html.escape(named) in (tmp_path / "report.html").read_text()
    assert "device" not in summary.inputs["npu"]  # a side that recorded nothing says nothing
