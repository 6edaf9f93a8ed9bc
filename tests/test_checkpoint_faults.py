"""Fault injection: each known conversion bug changes the output, is refused where it cannot apply, skips validation."""

import logging

import pytest
import torch

from crossalign.checkpoint.convert import convert_checkpoint, mindformers_to_megatron
from crossalign.tensorio.errors import CheckpointError
from crossalign.checkpoint.faults import FAULTS
from crossalign.models.layout import megatron_shapes, random_mindformers_state
from crossalign.sides.megatron.checkpoint import read_megatron_checkpoint
from crossalign.sides.mindformers.checkpoint import default_common, write_mindformers_checkpoint
from crossalign.config import load_config

DENSE = load_config("qwen35_dense_tiny").model
MOE = load_config("qwen35_moe_tiny").model
APPLIES = {
    "routed_expert_not_transposed": {"moe"},
    "shared_fc1_not_deinterleaved": {"moe"},
    "dense_fc1_not_deinterleaved": {"dense"},
    "in_proj_wrong_order": {"dense", "moe"},
    "conv1d_wrong_axis": {"dense", "moe"},
    "a_log_not_renamed": {"dense", "moe"},
    "wrong_mtp_prefix": {"dense", "moe"},
    "gate_up_swapped": {"dense", "moe"},
}
STATES = {"dense": (DENSE, random_mindformers_state(DENSE, 5)), "moe": (MOE, random_mindformers_state(MOE, 6))}


def test_every_fault_is_listed():
    assert set(FAULTS) == set(APPLIES)


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_each_fault_changes_the_output_or_is_refused(fault, kind):
    model, state = STATES[kind]
    if kind not in APPLIES[fault]:
        with pytest.raises(CheckpointError, match=f"fault '{fault}' does not apply to model {model.name}"):
            mindformers_to_megatron(state, model, fault=fault)
        return
    good = mindformers_to_megatron(state, model)
    bad = mindformers_to_megatron(state, model, fault=fault)
    changed = {k for k in good.keys() & bad.keys() if not torch.equal(good[k], bad[k])}
    renamed = good.keys() ^ bad.keys()
    assert changed or renamed
    # The fault touches only what it says it breaks; shapes stay Megatron's, so loading would not crash.
    assert all(good[k].shape == bad[k].shape for k in changed)
    expected_keys = {
        "routed_expert_not_transposed": "mlp.experts.linear_fc",
        "shared_fc1_not_deinterleaved": "shared_experts.linear_fc1",
        "dense_fc1_not_deinterleaved": "mlp.linear_fc1.weight",
        "in_proj_wrong_order": "self_attention.in_proj.weight",
        "conv1d_wrong_axis": "self_attention.conv1d.weight",
        "gate_up_swapped": "linear_fc1.weight",
        "a_log_not_renamed": "_log",
        "wrong_mtp_prefix": "mtp.layers.0.",
    }[fault]
    assert all(expected_keys in k for k in changed | renamed)


def test_the_faults_that_only_rename():
    model, state = STATES["moe"]
    good = mindformers_to_megatron(state, model)
    bad = mindformers_to_megatron(state, model, fault="a_log_not_renamed")
    assert "decoder.layers.0.self_attention.a_log" in bad and "decoder.layers.0.self_attention.A_log" not in bad
    bad = mindformers_to_megatron(state, model, "0.16.1", fault="wrong_mtp_prefix")
    assert any(k.startswith("mtp.layers.0.mtp_model_layer.") for k in bad)
    bad = mindformers_to_megatron(state, model, "0.17.0", fault="wrong_mtp_prefix")
    assert any(k.startswith("mtp.layers.0.transformer_layer.") for k in bad) and len(bad) == len(good)


def test_routed_expert_fault_is_invisible_in_the_shapes():
    """Tiny MoE weight1 is square per expert (H == 2*moe_ffn), as in the real config."""
    model, state = STATES["moe"]
    bad = mindformers_to_megatron(state, model, fault="routed_expert_not_transposed")
    assert {k: tuple(v.shape) for k, v in bad.items()} == megatron_shapes(model)


def test_faulty_checkpoint_is_written_without_validation(tmp_path, caplog):
    model, state = STATES["dense"]
    write_mindformers_checkpoint(tmp_path / "ms", 2, state, None, default_common(2))
    with caplog.at_level(logging.WARNING, logger="crossalign.checkpoint"):
        report = convert_checkpoint(model, "ms2mg", tmp_path / "ms", tmp_path / "mg", fault="a_log_not_renamed")
    assert not report.output_validated and report.fault == "a_log_not_renamed"
    assert "NOT validated" in caplog.text
    written = read_megatron_checkpoint(tmp_path / "mg").state
    assert "decoder.layers.0.self_attention.a_log" in written
    with pytest.raises(CheckpointError, match="unknown fault 'nope'"):
        convert_checkpoint(model, "ms2mg", tmp_path / "ms", tmp_path / "x", fault="nope")
    with pytest.raises(CheckpointError, match="tp=1, pp=1"):
        convert_checkpoint(model, "ms2mg", tmp_path / "ms", tmp_path / "y", fault="gate_up_swapped", tp=2)
