"""The shape tables: key counts of the real configs (SPEC section 3), per-layer-kind contents, random init."""

import math

import pytest
import torch

from crossalign.tensorio.errors import CheckpointError
from crossalign.models.layout import (
    megatron_shapes,
    mindformers_buffers,
    mindformers_shapes,
    mtp_layer_prefix,
    random_mindformers_state,
)
from crossalign.config import load_config


def test_real_configs_give_the_key_counts_of_a_correct_conversion():
    dense = load_config("qwen35_dense").model
    moe = load_config("qwen35_moe").model
    assert len(megatron_shapes(dense)) == 91
    assert len(megatron_shapes(moe, experts="stacked")) == 127
    decoder = [k for k in megatron_shapes(dense) if k.startswith("decoder.layers.")]
    mtp = [k for k in megatron_shapes(dense) if k.startswith("mtp.")]
    assert (len(decoder), len(mtp)) == (76, 12)
    assert len([k for k in megatron_shapes(moe, experts="stacked") if k.startswith("mtp.")]) == 16
    # Per-expert form: each stacked expert tensor becomes E tensors, in every MoE layer including MTP.
    assert len(megatron_shapes(moe)) == 127 + 9 * 2 * (moe.num_experts - 1)


def test_the_real_moe_model_saves_nine_token_count_buffers():
    """mlp.tokens_per_expert (E,) in each of the 8 MoE layers and the MTP layer's; none in the dense model."""
    moe = load_config("qwen35_moe").model
    buffers = mindformers_buffers(moe)
    assert len(buffers) == 9 and set(buffers.values()) == {(8,)}
    assert "mtp.layers.0.transformer_layer.mlp.tokens_per_expert" in buffers
    assert not set(buffers) & set(mindformers_shapes(moe))
    assert mindformers_buffers(load_config("qwen35_dense").model) == {}


def test_real_shapes_match_the_source_checkpoints():
    dense = mindformers_shapes(load_config("qwen35_dense").model)
    moe = mindformers_shapes(load_config("qwen35_moe").model)
    assert moe["decoder.layers.0.self_attention.in_proj.weight"] == (8224, 1024)
    assert dense["decoder.layers.0.self_attention.in_proj_qkv.weight"] == (6144, 1024)
    assert dense["decoder.layers.0.self_attention.linear_g.weight"] == (2048, 1024)
    assert dense["decoder.layers.0.self_attention.linear_b.weight"] == (16, 1024)
    assert dense["decoder.layers.0.self_attention.conv1d.weight"] == (6144, 1, 1, 4)
    assert dense["decoder.layers.3.self_attention.linear_qkv.weight"] == (10240, 1024)
    assert dense["decoder.layers.0.self_attention.out_norm.weight"] == (128,)
    assert moe["decoder.layers.0.mlp.experts.weight1"] == (8, 1024, 1024)
    assert moe["decoder.layers.0.mlp.experts.weight2"] == (8, 512, 1024)
    assert moe["mtp.layers.0.transformer_layer.mlp.shared_experts.shared_experts_gate.weight"] == (1, 1024)
    mg = megatron_shapes(load_config("qwen35_moe").model, experts="stacked")
    assert mg["decoder.layers.0.mlp.experts.linear_fc1.weight"] == (8, 1024, 1024)
    assert mg["decoder.layers.0.mlp.experts.linear_fc2.weight"] == (8, 1024, 512)
    assert mg["decoder.layers.0.self_attention.conv1d.weight"] == (6144, 1, 4)


@pytest.mark.parametrize(("version", "prefix"), [("0.16.1", "transformer_layer"), ("0.15.0", "transformer_layer"),
                                                 ("0.17.0", "mtp_model_layer"), ("0.19.2", "mtp_model_layer"),
                                                 ("1.0", "mtp_model_layer")])
def test_mtp_prefix_follows_the_core_version(version, prefix):
    assert mtp_layer_prefix(version) == prefix
    model = load_config("qwen35_dense_tiny").model
    assert any(k.startswith(f"mtp.layers.0.{prefix}.") for k in megatron_shapes(model, version))


def test_bad_version_and_expert_form_are_named():
    with pytest.raises(CheckpointError, match="banana"):
        mtp_layer_prefix("banana")
    with pytest.raises(CheckpointError, match="sideways"):
        megatron_shapes(load_config("qwen35_moe_tiny").model, experts="sideways")


def test_random_state_matches_the_table_and_is_realistic():
    model = load_config("qwen35_moe_tiny").model
    state = random_mindformers_state(model, seed=3)
    assert {k: tuple(v.shape) for k, v in state.items()} == mindformers_shapes(model)
    assert all(v.dtype == torch.float32 for v in state.values())
    assert torch.equal(state["decoder.layers.0.input_layernorm.weight"], torch.ones(model.hidden_size))
    a = state["decoder.layers.0.self_attention.a_log"].exp()
    assert ((a >= 1) & (a <= 16)).all()
    dt = torch.nn.functional.softplus(state["decoder.layers.0.self_attention.dt_bias"])
    assert ((dt >= 1e-3 * 0.999) & (dt <= 1e-1 * 1.001)).all()
    emb = state["embedding.word_embeddings.weight"]
    assert math.isclose(emb.std().item(), model.init_method_std, rel_tol=0.05)
    again = random_mindformers_state(model, seed=3)
    other = random_mindformers_state(model, seed=4)
    assert all(torch.equal(state[k], again[k]) for k in state)
    assert not torch.equal(state["output_layer.weight"], other["output_layer.weight"])
