"""Hugging Face checkpoints: config.json import, the HF rules, hf2ms / hf2mg / ms2hf and their round trips."""

import json
from pathlib import Path

import pytest
import torch
from helpers.hf_tiny import make_hf_checkpoint

from crossalign.checkpoint.convert import convert_checkpoint
from crossalign.tensorio.errors import CheckpointError
from crossalign.checkpoint.hf import hf_shapes, read_hf_checkpoint
from crossalign.checkpoint.rules import GatedQKV, conversion_plan
from crossalign.models.layout import megatron_shapes, random_mindformers_state
from crossalign.sides.megatron.checkpoint import read_megatron_checkpoint
from crossalign.sides.mindformers.checkpoint import default_common, read_mindformers_checkpoint, write_mindformers_checkpoint
from crossalign.config import ConfigError, load_config
from crossalign.hf_config import hf_config_from_model, model_config_from_hf, read_config_json

CONFIGS = {"dense": load_config("qwen35_dense_tiny").model, "moe": load_config("qwen35_moe_tiny").model}


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {kind: make_hf_checkpoint(root / kind, kind) for kind in CONFIGS}


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    source = read_hf_checkpoint(directory)
    return {key: source.tensor(key) for key in source.entries}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_config_json_imports_as_the_tiny_config(hf_checkpoints, kind):
    source = read_hf_checkpoint(hf_checkpoints[kind])
    expected = CONFIGS[kind]
    imported = source.model_config(expected.name)
    if kind == "moe":  # HF MoE configs have no dense intermediate size: the routed size stands in
        expected = expected.model_copy(update={"ffn_hidden_size": expected.moe_ffn_hidden_size})
    assert imported == expected
    assert source.root == "model." and source.experts == "per_expert" and source.has_mtp


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_hf_rules_use_every_key_once_and_the_model_config_writes_back(kind):
    model = CONFIGS[kind]
    for hf_experts in ("per_expert", "packed"):
        for experts in ("per_expert", "stacked"):
            plan = conversion_plan(model, "0.17.0", experts, "hf", hf_experts, "model.language_model.")
            hf = [k for p in plan for k in p.source_keys]
            mg = [k for p in plan for k in p.target_keys]
            assert sorted(hf) == sorted(hf_shapes(model, hf_experts, "model.language_model."))
            assert sorted(mg) == sorted(megatron_shapes(model, "0.17.0", experts)) and len(mg) == len(set(mg))
    written = hf_config_from_model(model, "float32")
    assert model_config_from_hf(written, model.name, True) == model.model_copy(
        update={"ffn_hidden_size": model.moe_ffn_hidden_size} if model.is_moe else {})


def test_gated_qkv_regroups_heads_per_query_group():
    """q_proj rows per head [q_h | gate_h] -> per group [q heads | gate heads | k | v] (Megatron-Bridge QKVMapping)."""
    groups, per, d, hidden = 2, 2, 3, 1
    rows = lambda tag, n: torch.tensor([[tag * 100 + i] for i in range(n)], dtype=torch.float32)  # noqa: E731
    q_proj = torch.cat([torch.cat([rows(1, d) + 10 * h, rows(2, d) + 10 * h]) for h in range(groups * per)])
    k_proj, v_proj = rows(3, groups * d), rows(4, groups * d)
    rule = GatedQKV(("q", "k", "v"), "qkv", groups, per, d)
    (fused,) = rule.forward([q_proj, k_proj, v_proj])
    group0 = fused[: (2 * per + 2) * d, 0].tolist()
    assert group0 == [100, 101, 102, 110, 111, 112, 200, 201, 202, 210, 211, 212, 300, 301, 302, 400, 401, 402]
    assert all(torch.equal(a, b) for a, b in zip(rule.inverse([fused]), [q_proj, k_proj, v_proj]))


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_hf_round_trips_through_both_layouts_are_bit_identical(hf_checkpoints, tmp_path, kind):
    model, hf = CONFIGS[kind], hf_checkpoints[kind]
    convert_checkpoint(model, "hf2ms", hf, tmp_path / "ms")
    convert_checkpoint(model, "ms2hf", tmp_path / "ms", tmp_path / "back_ms", dtype="bf16")
    convert_checkpoint(model, "hf2mg", hf, tmp_path / "mg", experts="stacked")
    convert_checkpoint(model, "mg2ms", tmp_path / "mg", tmp_path / "ms_from_mg")
    convert_checkpoint(model, "ms2hf", tmp_path / "ms_from_mg", tmp_path / "back_mg", dtype="bf16")
    original = _tensors(hf)
    assert _same(_tensors(tmp_path / "back_ms"), original)
    assert _same(_tensors(tmp_path / "back_mg"), original)
    # the two imports agree, and a zero-centred HF norm is the plain gamma 1 + w on our side
    ms = read_mindformers_checkpoint(tmp_path / "ms").model_state()
    assert _same(ms, read_mindformers_checkpoint(tmp_path / "ms_from_mg").model_state())
    assert torch.equal(ms["decoder.final_layernorm.weight"], original["model.norm.weight"].float() + 1)
    assert torch.equal(ms["mtp.layers.0.enorm.weight"], original["mtp.pre_fc_norm_embedding.weight"].float() + 1)
    assert torch.equal(ms["decoder.layers.0.self_attention.out_norm.weight"],
                       original["model.layers.0.linear_attn.norm.weight"].float())  # the GDN norm is plain on both
    assert read_megatron_checkpoint(tmp_path / "mg", model).iteration == 0
    # the MindFormers import carries the token-count buffers MindFormers' MoE layer saves (zeros, nothing routed yet)
    buffers = read_mindformers_checkpoint(tmp_path / "ms").buffer_state()
    assert len(buffers) == (model.num_layers + model.mtp_num_layers if model.is_moe else 0)
    assert all(not tensor.any() for tensor in buffers.values())


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_mindformers_round_trip_through_hf_is_bit_identical(tmp_path, kind):
    model = CONFIGS[kind]
    state = random_mindformers_state(model, seed=5)
    write_mindformers_checkpoint(tmp_path / "ms", 3, state, None, default_common(3))
    convert_checkpoint(model, "ms2hf", tmp_path / "ms", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == ("qwen3_5_moe_text" if model.is_moe else "qwen3_5_text")
    convert_checkpoint(model, "hf2ms", tmp_path / "hf", tmp_path / "back")
    assert _same(read_mindformers_checkpoint(tmp_path / "back").model_state(), state)


def test_bad_hf_input_is_named_and_nothing_is_written(hf_checkpoints, tmp_path):
    dense, moe = CONFIGS["dense"], CONFIGS["moe"]
    with pytest.raises(CheckpointError, match="does not match model qwen35_moe_tiny: .*missing keys"):
        convert_checkpoint(moe, "hf2ms", hf_checkpoints["dense"], tmp_path / "out")
    assert not (tmp_path / "out").exists()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="model_type 'llama' is not a Qwen3.5 model"):
        convert_checkpoint(dense, "hf2mg", broken, tmp_path / "out")
    hf = read_config_json(hf_checkpoints["dense"])
    with pytest.raises(ConfigError, match="tie_word_embeddings"):
        model_config_from_hf({**hf, "tie_word_embeddings": True}, "x", True)
    with pytest.raises(ConfigError, match="layer_types .* is not the pattern"):
        irregular = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
        model_config_from_hf({**hf, "layer_types": irregular}, "x", True)
    assert not (tmp_path / "out").exists()


def test_cli_imports_the_config_and_converts(hf_checkpoints, tmp_path):
    from typer.testing import CliRunner

    from crossalign.cli import app

    runner = CliRunner()
    out = tmp_path / "imported.yaml"
    result = runner.invoke(app, ["configs", "import-hf", str(hf_checkpoints["moe"]), "--name", "tiny_moe_hf",
                                 "--training", "qwen35_moe_tiny", "--out", str(out)])
    assert result.exit_code == 0, result.output
    imported = load_config(out)
    assert imported.model.name == "tiny_moe_hf" and imported.model.num_experts == 4
    assert imported.training == load_config("qwen35_moe_tiny").training
    again = runner.invoke(app, ["configs", "import-hf", str(hf_checkpoints["moe"]), "--out", str(out)])
    assert again.exit_code == 2 and "exists" in again.output
    converted = runner.invoke(app, ["convert", "--model", str(out), "--direction", "hf2ms", "--input",
                                    str(hf_checkpoints["moe"]), "--output", str(tmp_path / "ms")])
    assert converted.exit_code == 0, converted.output
    assert read_mindformers_checkpoint(tmp_path / "ms").iteration == 0
    listing = runner.invoke(app, ["configs"])  # the bare group still lists the shipped configs
    assert listing.exit_code == 0 and "GGGA" in listing.output


def test_a_vision_language_release_layout_imports_like_the_text_model(hf_checkpoints, tmp_path):
    """Released Qwen3.5 checkpoints: text model under model.language_model., a vision tower, config in text_config."""
    from safetensors.torch import save_file

    text = _tensors(hf_checkpoints["dense"])
    release = tmp_path / "release"
    release.mkdir()
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v for k, v in text.items()}
    save_file({**renamed, "model.visual.patch_embed.proj.weight": torch.zeros(2, 3)}, str(release / "model.safetensors"))
    config = json.loads((hf_checkpoints["dense"] / "config.json").read_text())
    (release / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": config,
                                                     "vision_config": {"depth": 1}}))
    source = read_hf_checkpoint(release)
    assert source.root == "model.language_model." and source.skipped == ["model.visual.patch_embed.proj.weight"]
    model = CONFIGS["dense"]
    convert_checkpoint(model, "hf2ms", release, tmp_path / "from_release")
    convert_checkpoint(model, "hf2ms", hf_checkpoints["dense"], tmp_path / "from_text")
    assert _same(read_mindformers_checkpoint(tmp_path / "from_release").model_state(),
                 read_mindformers_checkpoint(tmp_path / "from_text").model_state())
