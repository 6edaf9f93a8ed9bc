"""Loads verified by the project itself: a missing, extra, renamed or different tensor fails, named."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from crossalign.backends.megatron import verify_load_digest
from crossalign.checkpoint.digest import (LoadDigestError, compare_loaded, numpy_sha256, torch_digests,
                                          torch_sha256)
from crossalign.checkpoint.layout import megatron_shapes, random_mindformers_state
from crossalign.checkpoint.megatron import write_megatron_checkpoint
from crossalign.checkpoint.te_local import te_to_local
from crossalign.config import load_config

RENAMED = ("decoder.layers.1.mlp.experts.linear_fc1.weight2", "decoder.layers.1.mlp.experts.linear_fc1.weight_2")
MISSING = "decoder.layers.3.mlp.experts.linear_fc2.weight0"


def random_megatron_state(config, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {key: torch.randn(shape, generator=generator)
            for key, shape in megatron_shapes(config.model, config.training.megatron_core_version).items()}


def faulty(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One routed-expert tensor renamed, one missing: the fault every side must name."""
    out = {(RENAMED[1] if key == RENAMED[0] else key): value for key, value in state.items()}
    del out[MISSING]
    return out


def test_a_renamed_and_a_missing_expert_tensor_are_both_named():
    config = load_config("qwen35_moe_tiny")
    state = random_megatron_state(config)
    loaded = torch_digests(state)
    compare_loaded(loaded, state, what="model vs ckpt")
    with pytest.raises(LoadDigestError) as caught:
        compare_loaded(loaded, faulty(state), what="model vs ckpt")
    message = str(caught.value)
    assert f"2 not in the checkpoint, so left at its initial value: {RENAMED[0]}, {MISSING}" in message
    assert f"1 in the checkpoint but never loaded (extra or renamed): {RENAMED[1]}" in message


def test_other_values_and_shapes_are_named():
    state = {"a": torch.ones(3), "b": torch.zeros(2, 2)}
    loaded = torch_digests(state)
    changed = {"a": torch.tensor([1.0, 1.0, 1.5]), "b": torch.zeros(4)}
    with pytest.raises(LoadDigestError, match=r"loaded with another shape: b \(loaded \(2, 2\), checkpoint \(4,\)\)"
                                              r".*loaded with other values: a \(float32\)"):
        compare_loaded(loaded, changed, what="x")


def test_bf16_parameters_are_held_against_the_checkpoint_rounded_to_bf16():
    """Megatron under --bf16 copies the fp32 checkpoint into bf16 parameters: compared in the loaded dtype."""
    fp32 = {"w": torch.tensor([1.0 + 2 ** -10, 3.0, -0.1])}
    loaded = torch_digests({"w": fp32["w"].to(torch.bfloat16)})
    assert loaded["w"]["dtype"] == "bfloat16"
    compare_loaded(loaded, fp32, what="x")
    with pytest.raises(LoadDigestError, match="other values: w"):
        compare_loaded(loaded, {"w": fp32["w"] + 0.01}, what="x")


def test_numpy_and_torch_hash_the_same_bytes():
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert numpy_sha256(values) == torch_sha256(torch.from_numpy(values))
    assert numpy_sha256(values.T) == torch_sha256(torch.from_numpy(values).T)  # C order either way


def test_the_launchers_digest_is_verified_against_the_checkpoint_under_the_te_names(tmp_path: Path):
    """The launcher hashes with its own copy of the function (it imports nothing from crossalign): both agree,
    and a CPU model's local names are mapped back to the checkpoint's TE names."""
    from crossalign.backends.local.mcore_model import layer_specs_module

    launcher = layer_specs_module()
    config = load_config("qwen35_moe_tiny")
    state = random_megatron_state(config)
    write_megatron_checkpoint(tmp_path / "ckpt", 0, state)
    local = te_to_local(state, config.model, config.training.megatron_core_version)
    digest = {key: {"shape": list(value.shape), "dtype": "float32", "sha256": launcher.tensor_sha256(value)}
              for key, value in local.items()}
    folder = tmp_path / "load_digest"
    folder.mkdir()
    (folder / "mp_rank_00.json").write_text(json.dumps({"rank": "mp_rank_00", "tensors": digest}))
    assert verify_load_digest(folder, tmp_path / "ckpt", config) == len(state)

    write_megatron_checkpoint(tmp_path / "bad", 0, faulty(state))
    with pytest.raises(LoadDigestError, match=f"{RENAMED[0]}, {MISSING}.*never loaded.*{RENAMED[1]}"):
        verify_load_digest(folder, tmp_path / "bad", config)
    with pytest.raises(LoadDigestError, match="wrote no load digest for rank mp_rank_00"):
        verify_load_digest(tmp_path / "nothing", tmp_path / "ckpt", config)


def test_the_mindspore_side_names_what_it_did_not_load():
    from crossalign.backends.local.ms_trainer import _verify_loaded

    config = load_config("qwen35_moe_tiny")
    state = random_mindformers_state(config.model, seed=0)
    values = {name: np.asarray(value, dtype=np.float32) for name, value in state.items()}
    _verify_loaded(values, state)
    expert = next(name for name in state if "experts" in name and "shared" not in name)
    changed = dict(state)
    changed[expert + "_renamed"] = changed.pop(expert)
    with pytest.raises(LoadDigestError, match=f"not in the checkpoint.*{expert}.*never loaded.*{expert}_renamed"):
        _verify_loaded(values, changed)


@pytest.mark.timeout(300)
def test_the_embedded_megatron_core_side_names_both_and_verifies_a_clean_load(tmp_path: Path):
    from crossalign.backends.local.mcore_cpu import megatron_core_on_cpu
    from crossalign.backends.local.mcore_model import McoreLoadError, build_gpt_model, load_converted_state
    from crossalign.backends.local.mcore_trainer import verify_loaded
    from crossalign.backends.base import DatasetFiles, TrainRequest

    config = load_config("qwen35_moe_tiny")
    state = random_megatron_state(config)
    request = TrainRequest(config=config, side="megatron", mode="align", output_dir=tmp_path,
                           data=DatasetFiles(prefix=tmp_path / "data", tokenizer=tmp_path),
                           init_checkpoint=tmp_path / "ckpt")
    with megatron_core_on_cpu(config.training.seed):
        net = build_gpt_model(config.model, config.training)
        load_converted_state(net, state, config.model, config.training.megatron_core_version)
        verify_loaded(net, state, request)
        with pytest.raises(LoadDigestError, match="other values: decoder.final_layernorm.weight"):
            verify_loaded(net, {**state, "decoder.final_layernorm.weight": state["decoder.final_layernorm.weight"] + 1},
                          request)
        with pytest.raises(McoreLoadError) as caught:
            load_converted_state(net, faulty(state), config.model, config.training.megatron_core_version)
    local_renamed = RENAMED[0].replace("linear_fc1.weight2", "local_experts.2.linear_fc1.weight")
    for name in (local_renamed, MISSING.replace("linear_fc2.weight0", "local_experts.0.linear_fc2.weight"),
                 RENAMED[1]):
        assert name in str(caught.value)
