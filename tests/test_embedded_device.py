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
