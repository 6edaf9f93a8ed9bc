"""Preflight config: both generated sides agree; every injected pitfall is named; CLI exit codes."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from crossalign.sides.megatron.args import megatron_args
from crossalign.sides.mindformers.yaml import mindformers_yaml
from crossalign.preflight.config import preflight_config
from crossalign.sides.megatron.args_reader import megatron_lr
from crossalign.sides.mindformers.yaml_reader import mindformers_lr
from crossalign.cli import app
from crossalign.config import load_config
from crossalign.sides.readings import PreflightInputError
from crossalign.sides.megatron.args_reader import load_megatron_args_file

PREFIX = "/data/corpus_text_document"


def generated(name: str = "qwen35_moe_tiny"):
    config = load_config(name)
    args = megatron_args(config, data_prefix=PREFIX, tokenizer=None, load_dir="/ckpt")
    y = mindformers_yaml(config, mode="align", data_prefix=PREFIX, load_dir="/ckpt")
    return config, args, y


def set_flag(args: list[str], flag: str, *values: str) -> list[str]:
    out = drop_flag(args, flag)
    return out + [flag, *values]


def drop_flag(args: list[str], flag: str) -> list[str]:
    out, skipping = [], False
    for token in args:
        if token.startswith("--"):
            skipping = token == flag
        if not skipping:
            out.append(token)
    return out


@pytest.mark.parametrize("name", ["qwen35_dense", "qwen35_moe", "qwen35_dense_tiny", "qwen35_moe_tiny"])
def test_generated_sides_agree(name: str):
    report = preflight_config(load_config(name))
    assert report.ok, report.mismatches
    names = [row.name for row in report.rows]
    for expected in ("seed (sample order)", "data path form", "split", "train samples", "seq length",
                     "global batch size", "lr", "lr warmup steps", "lr applied at step 1", "lr decay style",
                     "adam beta1", "adam beta2", "adam eps", "weight decay", "grad clip", "attention dropout",
                     "hidden dropout", "norm epsilon", "layer layout", "rotary base", "rotary percent",
                     "MTP layers", "MTP loss scaling", "bf16", "deterministic"):
        assert expected in names, expected
    if "moe" in name:
        for expected in ("norm_topk_prob", "shared-expert gate", "aux loss coeff", "router topk",
                         "router score function"):
            assert expected in names, expected


def mismatches_after(mutate_args=None, mutate_yaml=None, name: str = "qwen35_moe_tiny") -> list[str]:
    config, args, y = generated(name)
    y = copy.deepcopy(y)
    if mutate_args:
        args = mutate_args(args)
    if mutate_yaml:
        mutate_yaml(y)
    return preflight_config(config, megatron_args=args, mindformers_yaml=y).mismatches


def test_seed_42_against_1234():
    assert mismatches_after(lambda a: set_flag(a, "--seed", "42")) == ["seed (sample order)"]


def test_norm_topk_prob_false():
    def unset(y):
        del y["model"]["norm_topk_prob"]  # MindFormers' default is False
    assert mismatches_after(mutate_yaml=unset) == ["norm_topk_prob"]
    assert mismatches_after(lambda a: a + ["--moe-router-pre-softmax"]) == ["norm_topk_prob"]


def test_keys_mindformers_converter_drops_read_as_absent():
    # ConfigConverter maps TransformerConfig field names and its CONFIG_MAPPING keys only
    def renamed(y):
        y["model"]["rotary_percent"] = y["model"].pop("partial_rotary_factor")
        y["model"]["scoring_func"] = "sigmoid"  # dropped: moe_router_score_function stays at its default
    assert mismatches_after(mutate_yaml=renamed) == ["rotary percent"]

    def defaults(y):
        del y["model"]["normalization"], y["model"]["gated_linear_unit"]  # TransformerConfig: LayerNorm, no GLU
    assert mismatches_after(mutate_yaml=defaults, name="qwen35_dense_tiny") == ["norm", "gated linear unit (SwiGLU)"]


def test_missing_shared_expert_gate():
    assert mismatches_after(lambda a: drop_flag(a, "--moe-shared-expert-gate")) == ["shared-expert gate"]

    def off(y):
        y["model"]["use_shared_expert_gating"] = False
    assert mismatches_after(mutate_yaml=off) == ["shared-expert gate"]


def test_warmup_mismatch_names_the_steps_whose_lr_differs():
    def ten(y):
        y["lr_scheduler"]["warmup_steps"] = 10
    found = mismatches_after(mutate_yaml=ten)
    assert "lr warmup steps" in found and "lr applied at step 2" in found
    assert "lr applied at step 1" not in found  # both start at the warmup init


def test_warmup_ratio_is_read_as_mindformers_computes_it():
    def ratio(y):
        del y["lr_scheduler"]["warmup_steps"]
        y["lr_scheduler"]["warmup_ratio"] = 0.1  # int(50 * 0.1) = 5, the same warmup
    assert mismatches_after(mutate_yaml=ratio) == []


def test_cyclic_loader():
    assert mismatches_after(lambda a: set_flag(a, "--dataloader-type", "cyclic")) == ["sample order (loader)"]


def test_weighted_blend_on_one_side():
    def blend(y):
        y["train_dataset"]["dataloader"]["config"]["data_path"] = ["1", PREFIX]
    assert mismatches_after(mutate_yaml=blend) == ["data path form"]


def test_megatron_default_split():
    assert mismatches_after(lambda a: drop_flag(a, "--split")) == ["split"]
    assert mismatches_after(lambda a: set_flag(a, "--split", "969,30,1")) == ["split"]
    assert mismatches_after(lambda a: set_flag(a, "--split", "100,0,0")) == []  # same proportions


def test_megatron_defaults_that_differ():
    found = mismatches_after(lambda a: drop_flag(drop_flag(a, "--lr-decay-style"), "--hidden-dropout"))
    assert "lr decay style" in found and "hidden dropout" in found
    assert mismatches_after(lambda a: a + ["--apply-layernorm-1p"]) == ["norm weight form"]


def test_mindformers_defaults_that_differ():
    def no_betas(y):
        del y["optimizer"]["betas"]  # MindFormers' default (0.9, 0.95)
    assert mismatches_after(mutate_yaml=no_betas) == ["adam beta2"]

    def lower_none(y):
        y["recompute"]["mode"] = "none"
    assert mismatches_after(mutate_yaml=lower_none) == ["recompute mode (MTP)"]

    def no_deterministic(y):
        y["training"]["deterministic"] = False
    assert mismatches_after(mutate_yaml=no_deterministic) == ["deterministic"]


def test_sample_count_and_layout():
    def sizes(y):
        y["train_dataset"]["dataloader"]["sizes"] = [999, 0, 0]
    assert mismatches_after(mutate_yaml=sizes) == ["train samples"]

    def freq(y):
        y["model"]["linear_attention_freq"] = 2
    assert mismatches_after(mutate_yaml=freq) == ["layer layout"]
    assert mismatches_after(lambda a: set_flag(a, "--mtp-loss-scaling-factor", "0.1")) == ["MTP loss scaling"]


def test_lr_semantics_per_side():
    # SPEC 6: with the same W and init both apply init at step 1, reach max at step W+1
    mg = [megatron_lr(k, lr=1.0, min_lr=0.0, init=0.0, warmup=4, decay_iters=100, style="constant") for k in range(1, 7)]
    mf = [mindformers_lr(k, scheduler="ConstantWarmUpLR", lr=1.0, init=0.0, warmup=4) for k in range(1, 7)]
    assert mg == mf == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert megatron_lr(10, lr=1.0, min_lr=0.0, init=0.0, warmup=0, decay_iters=10, style="linear") == pytest.approx(0.1)


def test_args_file_forms(tmp_path: Path):
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/bash\n# my run\ntorchrun --nproc_per_node 8 pretrain_gpt.py \\\n"
                      "    --seed 42 \\\n    --data-path 1 /data/x \\\n    --bf16\n")
    assert load_megatron_args_file(script) == ["--seed", "42", "--data-path", "1", "/data/x", "--bf16"]
    listed = tmp_path / "args.txt"
    listed.write_text("--seed\n1234\n--bf16\n")
    assert load_megatron_args_file(listed) == ["--seed", "1234", "--bf16"]
    with pytest.raises(PreflightInputError, match="not found"):
        load_megatron_args_file(tmp_path / "missing.txt")


def test_cli(tmp_path: Path):
    runner = CliRunner()
    result = runner.invoke(app, ["preflight", "config", "--model", "qwen35_moe_tiny"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "norm_topk_prob" in result.output and "lr applied at step 1" in result.output

    config, _, y = generated()
    y["train_dataset"]["dataloader"]["config"]["seed"] = 42
    y["model"]["norm_topk_prob"] = False
    own = tmp_path / "mine.yaml"
    own.write_text(yaml.safe_dump(y))
    result = runner.invoke(app, ["preflight", "config", "--model", "qwen35_moe_tiny", "--mindformers-yaml", str(own)],
                           env={"COLUMNS": "200"})
    assert result.exit_code == 1
    assert "2 mismatch(es)" in result.output and "seed (sample order)" in result.output
    assert "norm_topk_prob" in result.output.split("mismatch(es):")[1]


# ---- parallel layouts ------------------------------------------------------------------------------

REAL_LAYOUT = ["parallel.megatron.tensor=2", "parallel.megatron.pipeline=2", "parallel.megatron.expert=4",
               "parallel.megatron.sequence_parallel=true", "parallel.megatron.cards_per_node=8",
               "parallel.megatron.nodes=2", "parallel.mindformers.tensor=4", "parallel.mindformers.pipeline=2",
               "parallel.mindformers.expert=2", "parallel.mindformers.sequence_parallel=true",
               "parallel.mindformers.cards_per_node=16", "training.global_batch_size=16"]


def test_generated_launches_of_a_real_layout_are_read_back_and_the_layout_difference_is_reported():
    """Megatron TP 2 PP 2 EP 4 on 2 nodes x 8 GPUs against MindFormers TP 4 PP 2 EP 2 on 16 cards."""
    config = load_config("qwen35_moe", REAL_LAYOUT)
    args = megatron_args(config, data_prefix=PREFIX, tokenizer=None, load_dir="/ckpt")
    for flag, value in (("--tensor-model-parallel-size", "2"), ("--pipeline-model-parallel-size", "2"),
                        ("--expert-model-parallel-size", "4"), ("--expert-tensor-parallel-size", "2")):
        assert args[args.index(flag) + 1] == value, flag
    assert "--sequence-parallel" in args and "--context-parallel-size" not in args
    y = mindformers_yaml(config, mode="align", data_prefix=PREFIX, load_dir="/ckpt")
    assert {key: y["parallelism"][key] for key in ("tensor_parallel", "pipeline_parallel", "expert_parallel",
                                                   "sequence_parallel")} == {
        "tensor_parallel": 4, "pipeline_parallel": 2, "expert_parallel": 2, "sequence_parallel": True}

    report = preflight_config(config)
    assert report.ok, report.mismatches
    rows = {row.name: row for row in report.rows}
    assert (rows["layout: tensor"].megatron, rows["layout: tensor"].mindformers) == ("2", "4")
    assert "layouts differ: expected" in rows["layout: tensor"].note and rows["layout: pipeline"].note == ""
    assert (rows["layout: expert"].megatron, rows["layout: expert"].mindformers) == ("4", "2")
    assert rows["layout: cards"].megatron == rows["layout: cards"].mindformers == "16"
    assert rows["global batch splits over data-parallel ranks"].megatron == "yes (4 data-parallel ranks)"
    assert rows["global batch splits over data-parallel ranks"].mindformers == "yes (2 data-parallel ranks)"


def test_a_layout_that_changes_the_batch_is_named():
    """A hand-edited YAML whose layout leaves 16 cards in 6 model-parallel groups trains another batch."""
    config = load_config("qwen35_moe", REAL_LAYOUT)
    y = mindformers_yaml(config, mode="align", data_prefix=PREFIX, load_dir="/ckpt")
    y["parallelism"]["tensor_parallel"] = 3
    report = preflight_config(config, mindformers_yaml=y)
    assert report.mismatches == ["global batch splits over data-parallel ranks"]
    row = {row.name: row for row in report.rows}["global batch splits over data-parallel ranks"]
    assert row.mindformers.startswith("no: 16 cards over TP x PP x CP = 6")


def test_preflight_cli_takes_layout_overrides():
    result = CliRunner().invoke(app, ["preflight", "config", "--model", "qwen35_moe",
                                      *[part for setting in REAL_LAYOUT for part in ("--set", setting)]])
    assert result.exit_code == 0, result.output
    assert "layout: expert" in result.output and "same settings" in result.output
