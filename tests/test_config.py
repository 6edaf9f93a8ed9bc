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


# ---- the parallel layout of each side ------------------------------------------------------------


def test_layouts_default_to_one_card_and_each_side_may_differ():
    config = load_config("qwen35_moe_tiny", ["parallel.megatron.tensor=2", "parallel.megatron.expert=2",
                                             "parallel.megatron.sequence_parallel=true",
                                             "parallel.megatron.expert_tensor=1", "parallel.megatron.cards_per_node=2",
                                             "parallel.mindformers.pipeline=2", "parallel.mindformers.cards_per_node=2"])
    megatron, mindformers = config.parallel.megatron, config.parallel.mindformers
    assert (megatron.tensor, megatron.expert, megatron.expert_tensor_size, megatron.data_parallel) == (2, 2, 1, 1)
    assert (mindformers.tensor, mindformers.pipeline, mindformers.data_parallel) == (1, 2, 1)
    assert megatron.ranks == "TP 2 x PP 1 x EP 2 x ETP 1 + SP (DP 1) on 1 x 2 cards"
    assert load_config("qwen35_dense_tiny").parallel.megatron.world_size == 1


def test_expert_tensor_size_defaults_to_the_tensor_size_as_megatron():
    # core_v0.16.1 megatron/training/arguments.py:410
    config = load_config("qwen35_moe_tiny", ["parallel.megatron.tensor=2", "parallel.megatron.cards_per_node=2",
                                             "parallel.megatron.sequence_parallel=true"])
    assert config.parallel.megatron.expert_tensor_size == 2


def test_megatron_tensor_parallel_on_gated_delta_net_layers_needs_sequence_parallel():
    """Without it megatron-core never sums GatedDeltaNet's replicated out_norm grads over the tensor ranks
    (core_v0.16.1 megatron/core/distributed/finalize_model_grads.py:354-356; tests/test_mcore_parallel.py
    shows the copies drifting apart): refused on the Megatron side, named; MindFormers' layout is its own."""
    with pytest.raises(ConfigError, match=r"parallel\.megatron\.sequence_parallel: required with tensor 2 on a "
                                          r"model with GatedDeltaNet layers"):
        load_config("qwen35_dense_tiny", ["parallel.megatron.tensor=2", "parallel.megatron.cards_per_node=2"])
    assert load_config("qwen35_dense_tiny", ["parallel.megatron.tensor=2", "parallel.megatron.cards_per_node=2",
                                             "parallel.megatron.sequence_parallel=true"]).parallel.megatron.tensor == 2
    assert load_config("qwen35_dense_tiny", ["parallel.mindformers.tensor=2",
                                             "parallel.mindformers.cards_per_node=2"]).parallel.mindformers.tensor == 2


def test_a_file_without_a_parallel_section_takes_overrides(tmp_path):
    text = resolve_config_path("qwen35_dense_tiny").read_text()
    path = _write(tmp_path, text[: text.index("\n# Each side's layout")] + "\n")
    config = load_config(path, ["parallel.megatron.pipeline=2", "parallel.megatron.cards_per_node=2"])
    assert config.parallel.megatron.pipeline == 2 and config.parallel.mindformers.pipeline == 1


@pytest.mark.parametrize("overrides, message", [
    (["parallel.megatron.tensor=4", "parallel.megatron.cards_per_node=4"],
     r"parallel\.megatron\.tensor: 4 does not divide model\.num_query_groups = 2"),
    (["parallel.mindformers.tensor=4", "parallel.mindformers.cards_per_node=4"],
     r"parallel\.mindformers\.tensor: 4 does not divide model\.linear_num_key_heads = 2"),
    (["model.linear_num_value_heads=3", "model.linear_num_key_heads=3", "model.num_attention_heads=6",
      "model.num_query_groups=6", "parallel.megatron.tensor=2", "parallel.megatron.cards_per_node=2"],
     r"parallel\.megatron\.tensor: 2 does not divide model\.linear_num_value_heads = 3"),
    (["model.ffn_hidden_size=100", "parallel.megatron.tensor=8", "model.num_attention_heads=8",
      "model.num_query_groups=8", "model.linear_num_key_heads=8", "model.linear_num_value_heads=8",
      "parallel.megatron.cards_per_node=8", "training.global_batch_size=4"],
     r"parallel\.megatron\.tensor: 8 does not divide model\.ffn_hidden_size = 100"),
    (["parallel.megatron.pipeline=3", "parallel.megatron.cards_per_node=3"],
     r"parallel\.megatron\.pipeline: 3 does not divide model\.num_layers = 4"),
    (["model.num_layers=8", "parallel.megatron.pipeline=4", "parallel.megatron.virtual_pipeline_layers=3",
      "parallel.megatron.cards_per_node=4"],
     r"parallel\.megatron\.virtual_pipeline_layers: 3 does not divide the 2 layers of a pipeline stage"),
    (["parallel.megatron.pipeline=2", "parallel.megatron.virtual_pipeline_layers=1",
      "parallel.megatron.cards_per_node=2"],
     r"parallel\.megatron\.virtual_pipeline_layers: the interleaved schedule needs pipeline > 2"),
    (["parallel.megatron.sequence_parallel=true"], r"parallel\.megatron\.sequence_parallel: needs tensor > 1"),
    (["parallel.megatron.expert=2", "parallel.megatron.cards_per_node=2"],
     r"parallel\.megatron\.expert: 2 expert ranks, but the model has no experts"),
    (["parallel.megatron.tensor=2", "parallel.megatron.cards_per_node=1"],
     r"parallel\.megatron\.cards_per_node: TP 2 x PP 1 x CP 1 = 2 does not fit 1 x 1 cards"),
    (["parallel.megatron.context=4", "parallel.megatron.cards_per_node=4", "training.seq_length=36"],
     r"parallel\.megatron\.context: training\.seq_length 36 is not a multiple of 2 x 4"),
    (["parallel.mindformers.cards_per_node=2", "parallel.mindformers.nodes=4"],
     r"training\.global_batch_size: 4 is not a multiple of micro_batch_size 4 x 8 data-parallel ranks of "
     r"parallel\.mindformers"),
    (["parallel.megatron.tenser=2"], r"parallel\.megatron\.tenser: unknown field"),
])
def test_a_layout_that_does_not_cut_the_model_names_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("qwen35_dense_tiny", overrides)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.megatron.expert=3", "parallel.megatron.cards_per_node=3"],
     r"parallel\.megatron\.expert: 3 does not divide model\.num_experts = 4"),
    (["parallel.megatron.expert_tensor=64", "parallel.megatron.cards_per_node=64", "training.global_batch_size=256"],
     r"parallel\.megatron\.expert_tensor: 64 does not divide model\.moe_ffn_hidden_size = 32"),
    (["parallel.megatron.tensor=2", "parallel.megatron.expert=2", "parallel.megatron.cards_per_node=4",
      "training.global_batch_size=8"],
     r"parallel\.megatron\.sequence_parallel: required with tensor 2 and expert 2"),
    (["parallel.megatron.tensor=2", "parallel.megatron.expert=2", "parallel.megatron.sequence_parallel=true",
      "parallel.megatron.cards_per_node=2"],
     r"parallel\.megatron\.expert: ETP 2 x EP 2 x PP 1 does not fit 1 x 2 cards"),
])
def test_an_expert_layout_that_does_not_cut_the_model_names_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("qwen35_moe_tiny", overrides)


def test_the_real_layouts_of_the_launch_example_are_accepted():
    config = load_config("qwen35_moe", [
        "parallel.megatron.tensor=2", "parallel.megatron.pipeline=2", "parallel.megatron.expert=4",
        "parallel.megatron.sequence_parallel=true", "parallel.megatron.cards_per_node=8", "parallel.megatron.nodes=2",
        "parallel.mindformers.tensor=4", "parallel.mindformers.pipeline=2", "parallel.mindformers.expert=2",
        "parallel.mindformers.sequence_parallel=true", "parallel.mindformers.cards_per_node=16",
        "training.global_batch_size=16"])
    assert config.parallel.megatron.data_parallel == 4 and config.parallel.mindformers.data_parallel == 2


def test_a_copy_with_another_attention_frequency_has_its_own_layer_kinds():
    """The layer kinds are read from the fields each time: a copy made with model_copy(update=...) does not keep
    the original's."""
    model = load_config("qwen35_dense_tiny").model
    assert model.layer_kinds == ("gdn", "gdn", "gdn", "attention")
    assert model.model_copy(update={"linear_attention_freq": 2}).layer_kinds == ("gdn", "attention", "gdn", "attention")
