"""The model config schema: shipped configs load, derived sizes match the real checkpoints, errors name the field."""

from pathlib import Path

import pytest

from crossalign.config import ConfigError, load_config, resolve_config_path


@pytest.mark.parametrize("name", ["qwen35_dense", "qwen35_moe", "qwen35_dense_tiny", "qwen35_moe_tiny"])
def test_shipped_configs_load(name):
    config = load_config(name)
    assert config.model.name == name
    assert config.model.layer_kinds.count("attention") == config.model.num_layers // 4


def test_real_sizes_match_the_checkpoint_shapes():
    model = load_config("qwen35_moe").model
    assert model.qkv_rows == 10240
    assert model.in_proj_rows == 8224
    assert model.conv_channels == 6144
    assert model.rotary_dim == 64
    assert [i for i, kind in enumerate(model.layer_kinds) if kind == "attention"] == [3, 7]
    assert model.in_proj_layout == "fused"
    assert load_config("qwen35_dense").model.in_proj_layout == "split"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def _tiny_with(tmp_path: Path, old: str, new: str) -> Path:
    text = resolve_config_path("qwen35_dense_tiny").read_text()
    assert old in text
    return _write(tmp_path, text.replace(old, new))


def test_unknown_field_is_named(tmp_path):
    path = _tiny_with(tmp_path, "  hidden_size: 64\n", "  hidden_size: 64\n  hiden_sise: 3\n")
    with pytest.raises(ConfigError, match=r"model\.hiden_sise: unknown field"):
        load_config(path)


def test_indivisible_groups_are_named(tmp_path):
    path = _tiny_with(tmp_path, "num_query_groups: 2", "num_query_groups: 3")
    with pytest.raises(ConfigError, match=r"num_query_groups: 4 attention heads are not divisible into 3"):
        load_config(path)


def test_moe_needs_expert_sizes(tmp_path):
    path = _tiny_with(tmp_path, "  mtp_num_layers: 1\n", "  mtp_num_layers: 1\n  num_experts: 4\n")
    with pytest.raises(ConfigError, match=r"moe_ffn_hidden_size: required"):
        load_config(path)


def test_nonzero_dropout_is_refused(tmp_path):
    path = _tiny_with(tmp_path, "  seed: 1234\n", "  seed: 1234\n  hidden_dropout: 0.1\n")
    with pytest.raises(ConfigError, match=r"training\.hidden_dropout"):
        load_config(path)


def test_missing_file_lists_known_configs():
    with pytest.raises(ConfigError, match=r"qwen35_dense_tiny"):
        load_config("no_such_model")


def test_warmup_as_long_as_the_run_is_refused_before_any_step(tmp_path):
    path = _tiny_with(tmp_path, "  train_iters: 50\n", "  train_iters: 5\n")
    with pytest.raises(ConfigError, match=r"training\.lr_warmup_iters: 5 is not below train_iters 5"):
        load_config(path)
