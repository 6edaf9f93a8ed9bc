"""MindFormers backend: the pynative YAML from the model config, log verdicts, launch through the run script."""

from __future__ import annotations

import dataclasses
import re
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from crossalign.sides.launch import BackendRunError, BackendSetupError
from crossalign.sides.mindformers.backend import MindFormersBackend
from crossalign.sides.mindformers.log_checks import expected_transformer_config, parse_step_line, read_transformer_config, verify_built_model, verify_mindformers_log, verify_transformer_config
from crossalign.sides.mindformers.yaml import mindformers_yaml
from crossalign.config import load_config
from crossalign.sides.mindformers.log_parser import parse_mindformers_log
from crossalign.patching import apply_patch, load_patch
from crossalign.site import MindFormersSite, SiteConfig
from helpers.mindformers_backend import FIXTURES, request_for, site_for

SPEC_LINE = ("2026-11-29 15:28:32,602 - mindformers/out/log[mindformers/pynative/callback/loss_callback.py:337] - INFO - "
             "{ step:[    2/ 1000], consumed_samples: 16, global_batch_size: 8, loss:  11.912346, per_step_time:   1530ms, "
             "load_balancing_loss:   1.012300, mtp_1_loss:  12.360000, lr: 9.900000e-05, grad_norm:   3.123457, "
             "throughput:   0.65T }")


def test_align_yaml_follows_the_spec():
    config = load_config("qwen35_moe")
    y = mindformers_yaml(config, mode="align", data_prefix="/data/corpus_text_document", load_dir="/ckpt/bf16")
    loader = y["train_dataset"]["dataloader"]
    assert loader["type"] == "BlendedMegatronDatasetDataLoader" and loader["datasets_type"] == "GPTDataset"
    assert loader["sizes"] == [100 * 8, 0, 0] and loader["shuffle"] is False
    assert loader["config"]["seed"] == 1234 and loader["config"]["split"] == "1,0,0"
    assert loader["config"]["seq_length"] == 2048 and loader["config"]["data_path"] == ["/data/corpus_text_document"]
    assert y["training"] == {"steps": 100, "local_batch_size": 1, "global_batch_size": 8, "max_norm": 1.0,
                             "seed": 1234, "deterministic": True}
    assert y["optimizer"] == {"type": "AdamW", "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
    assert y["lr_scheduler"] == {"type": "ConstantWarmUpLR", "learning_rate": 3e-4, "warmup_steps": 10,
                                 "warmup_lr_init": 0.0}
    assert y["checkpoint"]["load_path"] == "/ckpt/bf16" and y["checkpoint"]["no_load_optim"] is True
    assert y["checkpoint"]["enable_save"] is False
    assert y["recompute"] == {"mode": "None"}
    model = y["model"]
    assert model["norm_topk_prob"] is True and model["use_shared_expert_gating"] is True
    assert model["mtp_num_layers"] == 1 and model["mtp_loss_scaling_factor"] == 1.0
    assert model["num_experts"] == 8 and model["num_experts_per_tok"] == 2 and model["moe_intermediate_size"] == 512
    assert model["partial_rotary_factor"] == 0.25 and model["rope_theta"] == 1e6 and model["rms_norm_eps"] == 1e-5
    assert model["compute_dtype"] == "bfloat16" and model["vocab_size"] == 248320


def test_model_keys_are_the_ones_mindformers_converter_reads():
    # ConfigConverter drops keys it does not map with only a warning (config_converter.py:97-101,
    # r1.9.0..master): scoring_func is such a key; moe_router_score_function is a TransformerConfig field.
    moe = mindformers_yaml(load_config("qwen35_moe"), mode="align", data_prefix="/d/p", load_dir="/c")
    assert "scoring_func" not in moe["model"] and moe["model"]["moe_router_score_function"] == "softmax"
    dense = mindformers_yaml(load_config("qwen35_dense"), mode="align", data_prefix="/d/p", load_dir="/c")
    for y in (moe, dense):
        # TransformerConfig defaults are LayerNorm and no GLU: written always, for any fork's config class
        assert y["model"]["normalization"] == "RMSNorm" and y["model"]["gated_linear_unit"] is True
        # the pynative TrainConfig reads no top-level run_mode or seed
        assert "run_mode" not in y and "seed" not in y
        assert y["training"]["seed"] == 1234 and y["train_dataset"]["dataloader"]["config"]["seed"] == 1234


def test_base_yaml_saves_and_dense_has_no_moe_keys():
    y = mindformers_yaml(load_config("qwen35_dense_tiny"), mode="base", data_prefix="/d/p", save_dir="/out/ckpt",
                         model_overrides={"model_type": "site_qwen35"})
    assert y["training"]["steps"] == 20 and y["train_dataset"]["dataloader"]["sizes"] == [20 * 4, 0, 0]
    assert y["checkpoint"]["enable_save"] is True and y["checkpoint"]["save_path"] == "/out/ckpt"
    assert y["checkpoint"]["load_path"] == ""
    assert "num_experts" not in y["model"] and y["model"]["model_type"] == "site_qwen35"
    with pytest.raises(BackendSetupError, match="needs load_dir"):
        mindformers_yaml(load_config("qwen35_dense_tiny"), mode="align", data_prefix="/d/p")
    with pytest.raises(BackendSetupError, match="micro_batch_size 4 x 3 cards"):
        mindformers_yaml(load_config("qwen35_dense_tiny"), mode="base", data_prefix="/d/p", nproc=3)


def test_step_line_parsing():
    step, total, metrics = parse_step_line(SPEC_LINE)
    assert (step, total) == (2, 1000)
    assert metrics == {"lm_loss": 11.912346, "step_time_ms": 1530.0, "aux_loss": 1.0123, "mtp_1_loss": 12.36,
                       "lr": 9.9e-05, "grad_norm": 3.123457}


def step_lines(n: int, mtp: bool = True) -> list[str]:
    line = SPEC_LINE if mtp else SPEC_LINE.replace("mtp_1_loss:  12.360000, ", "")
    return [line.replace("step:[    2/ 1000]", f"step:[{k:5d}/{n:5d}]") for k in range(1, n + 1)]


def test_log_verdicts(tmp_path: Path):
    finished = "... - INFO - ..........Loading Checkpoint Finished.........."
    good = tmp_path / "good.log"
    good.write_text("\n".join([finished, *step_lines(3)]) + "\n")
    verify_mindformers_log(good, steps=3, loaded=True, exit_status=0, mtp=True)

    partial = tmp_path / "partial.log"
    partial.write_text("\n".join(["x - INFO - Network parameters not loaded:",
                                  "x - INFO -   - decoder.layers.0.mlp.router.weight", finished, *step_lines(3)]) + "\n")
    with pytest.raises(BackendRunError, match=r"incompletely: .*partial.log:1: .*decoder.layers.0.mlp.router.weight"):
        verify_mindformers_log(partial, steps=3, loaded=True, exit_status=0, mtp=True)

    short = tmp_path / "short.log"
    short.write_text("\n".join([finished, *step_lines(3)[:1]]) + "\n")
    with pytest.raises(BackendRunError, match=r"steps 2..3 of 3 were never logged"):
        verify_mindformers_log(short, steps=3, loaded=True, exit_status=0, mtp=True)

    no_mtp = tmp_path / "nomtp.log"
    no_mtp.write_text("\n".join([finished, *step_lines(3, mtp=False)]) + "\n")
    with pytest.raises(BackendRunError, match=r"nomtp.log: the model has MTP but the line of step 1 has no "
                                              r"mtp_1_loss.*loss-logging patch"):
        verify_mindformers_log(no_mtp, steps=3, loaded=True, exit_status=0, mtp=True)

    no_aux = tmp_path / "noaux.log"
    no_aux.write_text("\n".join([finished, *(line.replace("load_balancing_loss:   1.012300, ", "")
                                             for line in step_lines(3))]) + "\n")
    verify_mindformers_log(no_aux, steps=3, loaded=True, exit_status=0, mtp=True)  # dense: not needed
    with pytest.raises(BackendRunError, match=r"noaux.log: the model has MoE but the line of step 1 has no "
                                              r"load_balancing_loss"):
        verify_mindformers_log(no_aux, steps=3, loaded=True, exit_status=0, mtp=True, moe=True)
    verify_mindformers_log(good, steps=3, loaded=True, exit_status=0, mtp=True, moe=True)

    unloaded = tmp_path / "unloaded.log"
    unloaded.write_text("\n".join(step_lines(3)) + "\n")
    with pytest.raises(BackendRunError, match="no 'Loading Checkpoint Finished'"):
        verify_mindformers_log(unloaded, steps=3, loaded=True, exit_status=0, mtp=True)
    with pytest.raises(BackendRunError, match="exited with status 2"):
        verify_mindformers_log(good, steps=3, loaded=True, exit_status=2, mtp=True)


def test_release_branch_lines_are_read_like_master_ones(tmp_path: Path):
    # r1.9.0 and r2.0.0 print no consumed_samples/global_batch_size (loss_callback.py::_print_log);
    # the log check reads lines through the log parser, as the comparison does
    release = [line.replace("consumed_samples: 16, global_batch_size: 8, ", "") for line in step_lines(3)]
    assert "consumed_samples" not in release[0]
    log = tmp_path / "r2.0.0.log"
    log.write_text("\n".join(["x - INFO - Loading Checkpoint Finished", *release]) + "\n")
    verify_mindformers_log(log, steps=3, loaded=True, exit_status=0, mtp=True, moe=True)
    assert parse_step_line(release[1]) == parse_step_line(step_lines(3)[1])
    frame = parse_mindformers_log(log)
    assert list(frame["step"]) == [1, 2, 3] and frame["aux_loss"].notna().all()

    # a non-last pipeline stage prints 'loss: N/A (...)': steps the comparison cannot read are not logged steps
    stage = [re.sub(r"loss:  11.912346, .*?grad_norm", "loss: N/A (non-last PP stage, refer to last stage for "
                    "real loss), per_step_time:   1530ms, grad_norm", line) for line in release]
    assert "loss: N/A (non-last PP stage" in stage[0]
    log.write_text("\n".join(["x - INFO - Loading Checkpoint Finished", *stage]) + "\n")
    with pytest.raises(BackendRunError, match=r"steps 1..3 of 3 were never logged"):
        verify_mindformers_log(log, steps=3, loaded=True, exit_status=0, mtp=False)


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    root = tmp_path / "mindformers-checkout"
    shutil.copytree(FIXTURES / "mindformers_tree", root)
    apply_patch(load_patch("mindformers-load-digest"), root)  # the stand-in trainer records what it loaded
    return root


@pytest.mark.timeout(60)
def test_base_and_align_runs_through_the_run_script(tmp_path: Path, checkout: Path):
    steps: list = []
    base = request_for(tmp_path, "base", steps)
    result = MindFormersBackend(site=site_for(checkout)).train(base)
    assert result.iterations == 20 and [s[0] for s in steps] == list(range(1, 21)) and steps[0][2] == pytest.approx(7.69)
    assert result.checkpoint_dir == base.checkpoint_dir
    assert (base.checkpoint_dir / "latest_checkpointed_iteration.txt").read_text() == "20"
    written = yaml.safe_load((base.output_dir / "base_train.yaml").read_text())
    assert written["checkpoint"]["save_path"] == str(base.checkpoint_dir)
    script = (base.output_dir / "run_mindformers.sh").read_text()
    assert "run_mindformer.py \\\n    --mode 1 \\\n    --config" in script and "export HCCL_DETERMINISTIC=true" in script
    assert f"export LOG_MF_PATH={base.output_dir / 'mf_log'}" in script

    assert "run it again by hand with: bash" in script, "no staging folder: the script can be run again as it is"

    align = request_for(tmp_path, "align", [])
    align.published_dir = tmp_path / "store" / "run-7" / "05-pynative-train"
    result = MindFormersBackend(site=site_for(checkout)).train(align)
    script = (align.output_dir / "run_mindformers.sh").read_text()
    assert f"# Written by crossalign for the staging folder {align.output_dir}," in script
    assert f"# which became {align.published_dir} when the step committed" in script
    assert f"#   crossalign rerun run-7 --step 05-pynative-train --store {tmp_path / 'store'}" in script
    assert "run it again by hand" not in script
    assert result.iterations == 50 and result.checkpoint_dir is None
    written = yaml.safe_load((align.output_dir / "align_train.yaml").read_text())
    assert written["checkpoint"]["load_path"] == str(tmp_path / "bf16")


def test_converted_config_read_back_from_the_log(tmp_path: Path):
    config = load_config("qwen35_moe_tiny")
    expected = expected_transformer_config(config)
    lines = ["x - INFO - The final converted TransformerConfig is: {"]
    lines += [f"  {name!r}: {'mindspore.' + value if name.endswith('dtype') else repr(value)}," for name, value in
              {**expected, "batch_size": 1, "init_method": "<function init_method_normal.<locals>.init_>"}.items()]
    lines += ["  'last': None", "}", "x - INFO - { step:[    1/    2], loss: ... }"]
    log = tmp_path / "train.log"
    log.write_text("\n".join(lines) + "\n")
    line, built = read_transformer_config(log)
    assert line == 1 and built["moe_router_dtype"] == "float32" and built["last"] is None
    verify_transformer_config(log, config)
    log.write_text(log.read_text().replace("'moe_router_score_function': 'softmax'", "'moe_router_score_function': "
                                           "'sigmoid'").replace("  'attention_output_gate': True,\n", ""))
    with pytest.raises(BackendRunError, match=r"train.log:1: .*missing .*: attention_output_gate; different: "
                                              r"moe_router_score_function 'sigmoid' \(expected 'softmax'\)"):
        verify_transformer_config(log, config)
    log.write_text("x - INFO - { step:[    1/    2], loss: ... }\n")
    with pytest.raises(BackendRunError, match="no 'The final converted TransformerConfig is:' block"):
        verify_transformer_config(log, config)


@pytest.mark.timeout(60)
def test_a_setting_mindformers_dropped_fails_the_run(tmp_path: Path, checkout: Path):
    backend = MindFormersBackend(site=site_for(checkout, FAKE_MINDFORMERS="public-converter"))
    with pytest.raises(BackendRunError, match=r"missing .*: attention_output_gate, linear_attention_freq, "
                                              r"linear_conv_kernel_dim.*linear_num_value_heads"):
        backend.train(request_for(tmp_path, "align", []))
    request = request_for(tmp_path, "base", [])
    request.extra["mindformers_model"] = {"partial_rotary_factor": 1.0}
    with pytest.raises(BackendRunError, match=r"different: partial_rotary_factor 1.0 \(expected 0.25\)"):
        MindFormersBackend(site=site_for(checkout)).train(request)


@pytest.mark.timeout(60)
def test_a_model_built_with_full_rope_fails_the_run_though_the_readback_passes(tmp_path: Path, checkout: Path):
    """GPTModel takes rotary_percent from its constructor (default 1.0), not from partial_rotary_factor."""
    backend = MindFormersBackend(site=site_for(checkout, FAKE_MINDFORMERS="full-rope"))
    with pytest.raises(BackendRunError, match=r"the built GPTModel uses rotary_percent 1.0, the config 0.25: the "
                                              r"fork's Qwen3.5 class must pass rotary_percent=config.partial_rotary_factor"):
        backend.train(request_for(tmp_path, "align", []))
    log = tmp_path / "no_line.log"
    log.write_text("\n".join(step_lines(2)) + "\n")
    with pytest.raises(BackendRunError, match=r"no 'crossalign built model' line.*loss-logging patch"):
        verify_built_model(log, load_config("qwen35_moe_tiny"))


@pytest.mark.timeout(60)
def test_missing_mtp_loss_fails_the_run(tmp_path: Path, checkout: Path):
    backend = MindFormersBackend(site=site_for(checkout, FAKE_MINDFORMERS="no-mtp"))
    with pytest.raises(BackendRunError, match="no mtp_1_loss"):
        backend.train(request_for(tmp_path, "align", []))


@pytest.mark.timeout(60)
def test_relative_paths_still_hold_in_the_step_folder(tmp_path: Path, checkout: Path, monkeypatch):
    """The run script cds into the step folder: the checkout, the YAML and its data paths are made absolute."""
    monkeypatch.chdir(tmp_path)
    request = request_for(Path("."), "align", [])
    site = SiteConfig(mindformers=MindFormersSite(path=Path(checkout.name), python=sys.executable))
    assert MindFormersBackend(site=site).train(request).iterations == 50
    written = yaml.safe_load((tmp_path / request.output_dir / "align_train.yaml").read_text())
    assert written["checkpoint"]["load_path"] == str(tmp_path / "bf16")
    assert written["train_dataset"]["dataloader"]["config"]["data_path"] == [str(tmp_path / "data" /
                                                                                 "corpus_text_document")]
    assert f"cd {tmp_path / request.output_dir}\n" in (tmp_path / request.output_dir / "run_mindformers.sh").read_text()


def test_several_cards_use_msrun(tmp_path: Path, checkout: Path):
    site = SiteConfig(mindformers=MindFormersSite(path=checkout, python="python3", nproc_per_node=4))
    request = request_for(tmp_path, "align", [])
    layout = ["parallel.mindformers.tensor=2", "parallel.mindformers.pipeline=2",
              "parallel.mindformers.cards_per_node=4"]
    request = dataclasses.replace(request, config=load_config("qwen35_dense_tiny", layout))
    script = MindFormersBackend(site=site).run_script(request, tmp_path / "x.yaml").render()
    for needle in ("-m mindspore.parallel.cluster.run", "--worker_num=4", "--local_worker_num=4", "--join=True",
                   "--tail_worker_log=3", f"--log_dir={request.output_dir / 'msrun_log'}"):
        assert needle in script, needle


def test_a_nan_loss_is_named_with_its_step_not_taken_for_a_missing_one(tmp_path: Path):
    lines = step_lines(4)
    lines[2] = lines[2].replace("mtp_1_loss:  12.360000", "mtp_1_loss:        nan").replace(
        "load_balancing_loss:   1.012300", "load_balancing_loss:        nan")
    log = tmp_path / "nan.log"
    log.write_text("\n".join(lines) + "\n")
    with pytest.raises(BackendRunError, match=r"nan.log: mtp_1_loss is NaN at step 3 \(the MTP loss diverged; NaN at "
                                              r"step\(s\) 3 of 4\)"):
        verify_mindformers_log(log, steps=4, loaded=False, exit_status=0, mtp=True, moe=True)
    with pytest.raises(BackendRunError, match=r"load_balancing_loss is NaN at step 3"):
        verify_mindformers_log(log, steps=4, loaded=False, exit_status=0, mtp=False, moe=True)
    lines[1] = lines[1].replace("loss:  11.912346", "loss:        nan")
    log.write_text("\n".join(lines) + "\n")
    with pytest.raises(BackendRunError, match=r"loss is NaN at step 2 \(the LM loss diverged"):
        verify_mindformers_log(log, steps=4, loaded=False, exit_status=0, mtp=True, moe=True)


def test_releases_before_2_0_0_are_refused_and_2_0_0_is_taken():
    for version in ("2.0.0", "2.1.0"):
        mindformers_yaml(load_config("qwen35_moe_tiny", [f"training.mindformers_version={version}"]), mode="align",
                         data_prefix="/d/p", load_dir="/c")
    with pytest.raises(BackendSetupError, match=r"mindformers_version: MindFormers r1.9.0: releases before 2.0.0"):
        mindformers_yaml(load_config("qwen35_moe_tiny", ["training.mindformers_version=r1.9.0"]), mode="align",
                         data_prefix="/d/p", load_dir="/c")


def test_moe_yaml_builds_the_shared_expert_with_silu():
    model = mindformers_yaml(load_config("qwen35_moe_tiny"), mode="align", data_prefix="/d/p", load_dir="/c")["model"]
    assert model["hidden_act"] == "silu" and model["gated_linear_unit"] is True
    assert model["shared_expert_num"] == 1
    assert expected_transformer_config(load_config("qwen35_moe_tiny"))["shared_expert_num"] == 1
