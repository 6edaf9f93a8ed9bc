"""The one rule table (MindFormers and Hugging Face rules per Megatron row) and the one conversion front end."""

import pytest
import torch
from helpers.hf_tiny import make_hf_checkpoint
from typer.testing import CliRunner

from crossalign.checkpoint.convert import DIRECTIONS, convert_checkpoint, convert_state
from crossalign.checkpoint.hf import read_hf_checkpoint
from crossalign.checkpoint.norms import stored_norm_convention
from crossalign.checkpoint.rules import Copy, Rename, Row, conversion_plan, rule_table
from crossalign.cli import app
from crossalign.config import load_config
from crossalign.models.layout import megatron_shapes, random_mindformers_state
from crossalign.sides.mindformers.checkpoint import default_common, write_mindformers_checkpoint
from crossalign.tensorio.errors import CheckpointError

CONFIGS = {"dense": load_config("qwen35_dense_tiny").model, "moe": load_config("qwen35_moe_tiny").model}


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {kind: make_hf_checkpoint(root / kind, kind) for kind in CONFIGS}


def _tensors(directory) -> dict[str, torch.Tensor]:
    source = read_hf_checkpoint(directory)
    return {key: source.tensor(key) for key in source.entries}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_both_sides_of_the_table_write_every_megatron_key_in_the_same_order(kind):
    model = CONFIGS[kind]
    for core in ("0.16.1", "0.17.0"):
        for experts in ("per_expert", "stacked"):
            ms = [key for p in conversion_plan(model, core, experts) for key in p.target_keys]
            hf = [key for p in conversion_plan(model, core, experts, "hf", "packed") for key in p.target_keys]
            assert ms == hf and sorted(ms) == sorted(megatron_shapes(model, core, experts))
    table = rule_table(model)
    assert [row.megatron for block in table for row in block.rows] == \
        [row.rule("hf").targets for block in table for row in block.rows]
    with pytest.raises(ValueError, match="different Megatron keys"):
        Row(Copy("mlp.router.weight"), Rename("mlp.gate.weight", "mlp.linear_fc2.weight"))


def test_the_hf_view_names_a_second_mtp_layer_and_unknown_directions_and_sides():
    model = CONFIGS["dense"].model_copy(update={"mtp_num_layers": 2})
    assert len(conversion_plan(model)) > len(conversion_plan(CONFIGS["dense"]))  # MindFormers holds both
    with pytest.raises(CheckpointError, match="2 MTP layers: a Hugging Face checkpoint holds one"):
        conversion_plan(model, side="hf")
    with pytest.raises(CheckpointError, match="side 'megatron' is not one of mindformers, hf"):
        conversion_plan(model, side="megatron")  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match="direction 'mg2mg' is not one of " + ", ".join(DIRECTIONS)):
        convert_state({}, model, "mg2mg")  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match="does not apply to hf2mg"):
        convert_state({}, model, "hf2mg", fault="a_log_not_renamed")


def test_mg2hf_reads_any_megatron_layout_back_to_the_hugging_face_weights(hf_checkpoints, tmp_path):
    model, hf = CONFIGS["moe"], hf_checkpoints["moe"]
    report = convert_checkpoint(model, "hf2mg", hf, tmp_path / "mg", core_version="0.17.0", tp=2, ep=2)
    assert (report.tp, report.ep, len(report.files)) == (2, 2, 4)  # hf2mg shards experts too
    back = convert_checkpoint(model, "mg2hf", tmp_path / "mg", tmp_path / "back", core_version="0.17.0",
                              dtype="bf16")
    assert _same(_tensors(tmp_path / "back"), _tensors(hf))
    assert (back.format, back.iteration, back.keys_out) == ("torch", 0, len(read_hf_checkpoint(hf).entries))
    with pytest.raises(CheckpointError, match="mg2hf reads or writes a single-rank checkpoint"):
        convert_checkpoint(model, "mg2hf", tmp_path / "mg", tmp_path / "never", tp=2)
    assert not (tmp_path / "never").exists()


def test_mg2hf_of_an_ms2mg_checkpoint_is_ms2hf_and_the_cli_runs_it(tmp_path):
    model = CONFIGS["dense"]
    write_mindformers_checkpoint(tmp_path / "ms", 5, random_mindformers_state(model, seed=8), None, default_common(5))
    convert_checkpoint(model, "ms2mg", tmp_path / "ms", tmp_path / "mg", pp=2)
    result = CliRunner().invoke(app, ["convert", "--model", "qwen35_dense_tiny", "--direction", "mg2hf", "--input",
                                      str(tmp_path / "mg"), "--output", str(tmp_path / "via_mg")])
    assert result.exit_code == 0, result.output
    assert "mg2hf qwen35_dense_tiny" in result.output and "iteration 5" in result.output
    convert_checkpoint(model, "ms2hf", tmp_path / "ms", tmp_path / "direct")
    assert _same(_tensors(tmp_path / "via_mg"), _tensors(tmp_path / "direct"))
    wrong = CliRunner().invoke(app, ["convert", "--model", "qwen35_dense_tiny", "--direction", "mg2mg", "--input",
                                     str(tmp_path / "mg"), "--output", str(tmp_path / "never")])
    assert wrong.exit_code == 2 and "is not one of ms2mg, mg2ms, hf2mg, mg2hf, hf2ms, ms2hf" in wrong.output
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_zero_centred_megatron_layout_holds_hugging_face_norms_as_they_are(hf_checkpoints, kind):
    plain = CONFIGS[kind]
    zero = plain.model_copy(update={"norm_convention": "zero_centred"})
    hf = _tensors(hf_checkpoints[kind])
    mg = convert_state(hf, zero, "hf2mg")
    assert stored_norm_convention(mg)[0] == "zero_centred"
    assert torch.equal(mg["decoder.final_layernorm.weight"], hf["model.norm.weight"])  # a copy, same dtype
    assert torch.equal(mg["mtp.layers.0.enorm.weight"], hf["mtp.pre_fc_norm_embedding.weight"])
    assert torch.equal(mg["decoder.layers.0.self_attention.out_norm.weight"],  # HF's plain gated norm: g - 1
                       hf["model.layers.0.linear_attn.norm.weight"].float() - 1)
    assert _same(convert_state(mg, zero, "mg2hf"), {k: v.float() if k.endswith("linear_attn.norm.weight") else v
                                                    for k, v in hf.items()})
    # MindFormers' side does not depend on how Megatron stores its gammas (in fp32, as the folder conversions cast)
    hf32 = {key: tensor.float() for key, tensor in hf.items()}
    ms = convert_state(hf32, plain, "hf2ms")
    assert _same(convert_state(hf32, zero, "hf2ms"), ms)
    assert _same(convert_state(ms, zero, "ms2hf"), convert_state(ms, plain, "ms2hf"))
