"""MindFormers' own code (the 2.0.0 and 2.1.0 wheels, and 1.9.0's loader) on what crossalign generates.

Each release runs once, in a subprocess (tests/helpers/mindformers_upstream.py, tests/helpers/mindformers_driver.py):
its pynative TrainConfig loader on the generated YAMLs, its config converter, its pynative GPTModel
built from the generated model section, its LossCallback and its NaN-skip warning. The tests then
hold crossalign's readers and checks against what it printed and built.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from crossalign.sides.launch import BackendRunError, BackendSetupError
from crossalign.sides.mindformers.yaml import mindformers_yaml
from crossalign.sides.mindformers.log_checks import verify_built_model, verify_mindformers_log, verify_transformer_config
from crossalign.models.layout import mindformers_buffers
from crossalign.sides.mindformers.checkpoint import default_common, read_mindformers_checkpoint, write_mindformers_checkpoint
from crossalign.tensorio.safetensors_io import read_header
from crossalign.config import load_config
from crossalign.patching import apply_patch, load_patch
from crossalign.sides.mindformers.log_parser import parse_mindformers_log
from helpers.mindformers_upstream import RELEASES, expected_public, generated, run_driver

MODELS = ("qwen35_moe_tiny", "qwen35_dense_tiny")
LR = {"learning_rate": 3e-3, "warmup_steps": 5, "warmup_lr_init": 0.0, "total_steps": 10}  # 3e-3 * s / 5 in warm-up
STEPS = [{"step": 1, "max_steps": 3, "loss": 7.5, "aux": 1.01, "mtp": [7.6], "grad_norm": 1.5},
         {"step": 2, "max_steps": 3, "loss": 7.4, "aux": "nan", "mtp": ["nan"], "grad_norm": "nan"},
         {"step": 3, "max_steps": 3, "loss": 7.3, "aux": 1.02, "mtp": [7.5], "grad_norm": 1.4}]
SKIPPED = [2]
GRAPH_STEPS = [{"step": k, "loss": 11.9 - 0.1 * k, "lm_loss": 11.5 - 0.1 * k, "aux": 1.0123,
                "mtp": 0.3 * (11.6 - 0.1 * k), "grad_norm": 3.25, "lr": 9.9e-05}  # mtp_loss scaled by factor 0.3
               for k in (1, 2, 3)]
FORK = """
from mindspore import nn
from mindformers.parallel_core.utils.model_mixin import ModelMixin, TrainModelMixin
from mindformers.pynative.base_models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from mindformers.pynative.base_models.gpt.gpt_model import GPTModel


def gpt(config, **rope):
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=True),
                    vocab_size=config.vocab_size, max_sequence_length=config.max_position_embeddings,
                    position_embedding_type="rope", rotary_base=config.rotary_base, **rope)


class {passes}(TrainModelMixin, ModelMixin, nn.Cell):  # as PyNativeQwen3ForCausalLM's bases
    def __init__(self, config):
        nn.Cell.__init__(self)
        self.transformer_config = config
        self.model = gpt(config, rotary_percent=config.partial_rotary_factor)


class {full}(TrainModelMixin, ModelMixin, nn.Cell):  # as PyNativeQwen3ForCausalLM's bases
    def __init__(self, config):  # passes no rotary_percent, as PyNativeQwen3ForCausalLM
        nn.Cell.__init__(self)
        self.transformer_config = config
        self.model = gpt(config)
"""
FORK_CLASSES = {"passes": "PyNativeQwen35ForCausalLM", "full": "PyNativeQwen35MoeForCausalLM"}
# Only a fork's TransformerConfig has these (public MindFormers has no Qwen3.5): the readback names them.
FORK_FIELDS = {"attention_output_gate", "linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim",
               "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads"}


def fork_module(root: Path) -> str:
    """A fork's Qwen3.5 model file with the mindformers-qwen35-loss-logging patch applied by crossalign."""
    path = root / "mindformers/models/qwen3_5/modeling_qwen3_5.py"
    path.parent.mkdir(parents=True)
    path.write_text(FORK.format(**FORK_CLASSES))
    report = apply_patch(load_patch("mindformers-qwen35-loss-logging"), root, tuple(FORK_CLASSES.values()))
    assert report.status == "applied" and "get_gpt_transformer_config" in path.read_text(), report
    return str(path)


def module_inputs(tmp: Path, models: dict[str, str]) -> dict:
    """Seeded weights for the gated MLP (dense config) and the gated shared expert (MoE config), and an input."""
    rng = np.random.default_rng(1234)
    dense, moe = load_config("qwen35_dense_tiny").model, load_config("qwen35_moe_tiny").model
    h, f, s = dense.hidden_size, dense.ffn_hidden_size, moe.moe_shared_expert_intermediate_size
    shapes = {"mlp.linear_fc1.weight": (2 * f, h), "mlp.linear_fc2.weight": (h, f),
              "shared_experts.linear_fc1.weight": (2 * s, h), "shared_experts.linear_fc2.weight": (h, s),
              "shared_experts.shared_experts_gate.weight": (1, h)}
    np.savez(tmp / "weights.npz", **{k: (0.1 * rng.standard_normal(v)).astype(np.float32) for k, v in shapes.items()})
    np.save(tmp / "input.npy", rng.standard_normal((8, 2, h)).astype(np.float32))  # [seq, batch, hidden]
    return {"dense": models["qwen35_dense_tiny"], "moe": models["qwen35_moe_tiny"], "weights": str(tmp / "weights.npz"),
            "input": str(tmp / "input.npy"), "out": str(tmp / "modules_out.npz")}


@pytest.fixture(scope="module", params=RELEASES)
def release(request, tmp_path_factory):
    """One run of a release's code on every generated YAML: (version, result, work folder)."""
    version = request.param
    tmp = tmp_path_factory.mktemp(f"mindformers-{version}")
    models = {name: generated(tmp, name) for name in MODELS}
    moe = models["qwen35_moe_tiny"]
    fork = fork_module(tmp / "fork")
    job = {"models": models,
           "loads": {f"{name}_base": generated(tmp, name, "base") for name in MODELS},
           "variants": {"swiglu": {"yaml": moe, "changes": {"hidden_act": "swiglu"}},
                        "no_shared_expert_num": {"yaml": moe, "changes": {"shared_expert_num": None}}},
           "loss_lines": {"yaml": moe, "lr": LR, "steps": STEPS},
           "save": {"yaml": moe, "dir": str(tmp / "saved")},
           "modules": module_inputs(tmp, models),
           "graph_lines": GRAPH_STEPS,
           "forks": {kind: {"module": fork, "classes": [name], "yaml": models["qwen35_dense_tiny"]}
                     for kind, name in FORK_CLASSES.items()}}
    if version >= "2.1.0":
        job["skip_steps"] = SKIPPED
    result, _ = run_driver(version, job, tmp / "work")
    return version, result, tmp / "work"


def test_the_generated_yamls_load(release):
    version, result, _ = release
    assert {name: m["load"] for name, m in result["models"].items()} == {name: "ok" for name in MODELS}
    assert set(result["loads"].values()) == {"ok"}, result["loads"]


def test_the_converted_config_passes_the_readback_but_for_the_fork_fields(release):
    """The real converter's "final converted TransformerConfig" block, fed to the step's check: every
    number-changing setting arrives, only the GatedDeltaNet/gate fields a fork adds are missing."""
    version, result, _ = release
    for name in MODELS:
        with pytest.raises(BackendRunError) as error:
            verify_transformer_config(Path(result["models"][name]["convert_log"]), load_config(name))
        message = str(error.value)
        missing = re.search(r"YAML key was dropped\): ([^;]+)", message)
        assert missing and set(missing[1].split(", ")) == FORK_FIELDS, message
        assert "different" not in message, message


def test_without_shared_expert_num_the_readback_fails_and_no_shared_expert_is_built(release):
    version, result, work = release
    variant = result["variants"]["no_shared_expert_num"]["parameters"]
    assert not any(".shared_experts." in name for name in variant)
    with pytest.raises(BackendRunError, match=r"different: .*shared_expert_num 0 \(expected 1\)"):
        verify_transformer_config(work / "variant_no_shared_expert_num.log", load_config("qwen35_moe_tiny"))


def test_hidden_act_swiglu_fails_the_pynative_build(release):
    _, result, _ = release
    assert "Activation 'swiglu' is not supported" in result["variants"]["swiglu"]["error"]


@pytest.mark.parametrize("name", MODELS)
def test_the_built_modules_have_the_names_and_shapes_the_conversion_expects(release, name):
    _, result, _ = release
    built = {key: tuple(shape) for key, (shape, _) in result["models"][name]["parameters"].items()}
    assert built == expected_public(name)
    if load_config(name).model.is_moe:
        assert any(".mlp.shared_experts.shared_experts_gate." in key for key in built)


def test_params_dtype_float32_is_partly_ignored_from_2_1_0(release):
    """2.1.0's pynative Linear and GroupedMLP default to the compute dtype (bf16 here): its MLP, expert,
    output-layer and eh_proj weights are bf16 whatever params_dtype says; 2.0.0 builds them in float32."""
    version, result, _ = release
    bf16 = sorted(key for key, (_, dtype) in result["models"]["qwen35_moe_tiny"]["parameters"].items()
                  if dtype == "BFloat16")
    if version < "2.1.0":
        assert bf16 == []
        return
    assert all(re.search(r"mlp\.(experts|shared_experts\.linear_fc)|^output_layer|eh_proj", key) for key in bf16), bf16
    assert {"output_layer.weight", "mtp.layers.0.eh_proj.weight", "decoder.layers.0.mlp.experts.weight1"} <= set(bf16)


def test_the_built_model_takes_no_rope_fraction_from_the_config(release):
    """GPTModel takes the rope fraction from its constructor argument rotary_percent (default 1.0), not
    from partial_rotary_factor: a class that passes nothing trains full rope whatever the config says."""
    _, result, _ = release
    model = result["models"]["qwen35_moe_tiny"]
    assert model["rotary_percent"] == 1.0 and model["rotary_dims"] == load_config("qwen35_moe_tiny").model.kv_channels


def test_the_patch_reports_the_rope_fraction_the_built_model_uses(release):
    """The patched get_gpt_transformer_config (called by LossCallback every step) logs the built GPTModel's
    rotary_percent once; the step's check fails a class that passes none to GPTModel."""
    _, _, work = release
    config = load_config("qwen35_dense_tiny")
    verify_built_model(work / "fork_passes.log", config)
    assert (work / "fork_passes.log").read_text().count("crossalign built model") == 1
    with pytest.raises(BackendRunError, match=r"uses rotary_percent 1.0, the config 0.25"):
        verify_built_model(work / "fork_full.log", config)


def test_loss_callback_lines_are_read_and_a_nan_is_named(release):
    version, _, work = release
    log = work / "loss_lines.log"
    frame = parse_mindformers_log(log, mtp_loss_scaling_factor=1.0, mindformers_version=version)
    assert frame["step"].tolist() == [1, 2, 3]
    assert frame["lm_loss"].tolist() == [7.5, 7.4, 7.3]
    assert frame.loc[0, "aux_loss"] == 1.01 and frame.loc[0, "mtp_1_loss"] == 7.6
    assert frame.attrs["printed_nan"]["mtp_1_loss"] == [2] and frame.attrs["printed_nan"]["aux_loss"] == [2]
    with pytest.raises(BackendRunError, match=r"mtp_1_loss is NaN at step 2 \(the MTP loss diverged"):
        verify_mindformers_log(log, steps=3, loaded=False, exit_status=0, mtp=True, moe=True)
    with pytest.raises(BackendRunError, match=r"load_balancing_loss is NaN at step 2"):
        verify_mindformers_log(log, steps=3, loaded=False, exit_status=0, mtp=False, moe=True)


def test_the_lr_is_corrected_for_steps_skipped_on_nan(release):
    version, _, work = release
    if version < "2.1.0":
        pytest.skip(f"MindFormers {version} has no training.use_skip_step_on_nan")
    combined = work / "with_skips.log"
    combined.write_text((work / "loss_lines.log").read_text() + (work / "skip.log").read_text() + "\n")
    printed = parse_mindformers_log(work / "loss_lines.log")["lr"].tolist()
    assert [round(x, 12) for x in printed] == [6e-4, 1.2e-3, 1.8e-3]  # the schedule at the printed step
    frame = parse_mindformers_log(combined, mindformers_version=version)
    assert frame.attrs["skipped_steps"] == SKIPPED
    lr = frame["lr"].tolist()  # the lr applied at step s + 1 (lr_step_offset 1)
    assert math.isnan(lr[0]) and lr[1:] == [printed[0], printed[1]]


@pytest.mark.slow
def test_r190_rejects_the_generated_yaml_and_is_not_supported(tmp_path):
    result, _ = run_driver("1.9.0", {"loads": {"moe": generated(tmp_path, "qwen35_moe_tiny")}}, tmp_path / "work")
    assert "Unknown configuration keys for ParallelismConfig" in result["loads"]["moe"]
    assert "data_parallel_shard" in result["loads"]["moe"] and "expert_parallel" in result["loads"]["moe"]
    config = load_config("qwen35_moe_tiny", ["training.mindformers_version=1.9.0"])
    with pytest.raises(BackendSetupError, match="mindformers_version: MindFormers 1.9.0: releases before 2.0.0"):
        mindformers_yaml(config, mode="align", data_prefix="/d", load_dir="/c")


def test_checkpoint_callback_output_is_read_and_crossalign_output_loads(release, tmp_path):
    """CheckpointCallback's save (model + pynative AdamW after step 2 of 3) read by crossalign; crossalign's
    checkpoint of new values loaded by MindFormers' load_checkpoint into a fresh model."""
    version, result, work = release
    saved = read_mindformers_checkpoint(work.parent / "saved")
    built = result["models"]["qwen35_moe_tiny"]["parameters"]
    common = default_common(2, global_batch_size=4, total_steps=3)
    if version < "2.1.0":
        del common["consumed_samples"]  # 2.0.0's CommonInfo has no such field
    assert saved.iteration == 2 and saved.common == common
    assert set(saved.model_entries()) | set(saved.buffer_entries()) == set(built)
    assert set(saved.buffer_entries()) == set(mindformers_buffers(load_config("qwen35_moe_tiny").model))
    masters = sorted(name for name in saved.optimizer_entries() if name.startswith("main_param."))
    bf16 = sorted(f"main_param.{key}" for key, (_, dtype) in built.items() if dtype == "BFloat16")
    assert masters == bf16 and (version < "2.1.0") == (not masters)  # 2.1.0: fp32 masters of its bf16 weights
    for name, info in saved.model_entries().items():
        assert info.dtype == "F32", name  # the weight is the master where there is one
        assert saved.tensor(name).dtype == torch.float32

    stored = {info.name: info for file in saved.model_files for info in read_header(file)[0]}
    # new seeded values (the saved ones are whatever memory the un-initialised pynative parameters held)
    generator = torch.Generator().manual_seed(1234)
    changed = {name: torch.randn(info.shape, generator=generator).to(
        torch.bfloat16 if stored[name].dtype == "BF16" else torch.float32)
        for name, info in saved.model_entries().items()}
    changed.update(saved.buffer_state())
    extra = "decoder.layers.0.mlp.not_in_the_model.weight"
    root = tmp_path / "ours"
    write_mindformers_checkpoint(root, 2, {**changed, extra: torch.ones(3)}, None, default_common(2, 4))
    _, log = run_driver(version, {"load": {"yaml": str(work.parent / "qwen35_moe_tiny_align.yaml"),
                                           "checkpoint": str(root), "dump": str(tmp_path / "loaded.safetensors")}},
                        tmp_path / "work")
    loaded = load_file(tmp_path / "loaded.safetensors")
    assert set(loaded) == set(changed)
    for name, tensor in changed.items():
        assert torch.equal(loaded[name], tensor), name
    # MindFormers loads the network's own names only and never names a tensor it left out
    # (checkpoint/checkpoint.py: load_checkpoint's filter_func): the step's checks cannot rest on its messages
    text = (tmp_path / "work" / "load.log").read_text()
    assert "Loading Checkpoint Finished" in text and "not_in_the_model" not in text


def test_our_gated_mlp_and_shared_expert_equal_mindformers_own_modules(release):
    """crossalign's MindSpore model (models/ms_model.py) against MindFormers' pynative MLP and
    SharedExpertMLP, fp32 on CPU, same weights and input (its MoE router runs on Ascend kernels only)."""
    import mindspore as ms

    from crossalign.models.ms_model import MLP, SharedExperts

    _, _, work = release
    weights, x = np.load(work.parent / "weights.npz"), np.load(work.parent / "input.npy")
    theirs = np.load(work.parent / "modules_out.npz")
    dense, moe = load_config("qwen35_dense_tiny").model, load_config("qwen35_moe_tiny").model
    ours = {"mlp": MLP(dense.hidden_size, dense.ffn_hidden_size),
            "shared_experts": SharedExperts(moe.hidden_size, moe.moe_shared_expert_intermediate_size, gated=True)}
    for name, module in ours.items():
        ms.load_param_into_net(module, {key: ms.Parameter(ms.Tensor(weights[f"{name}.{key}"]), name=key)
                                        for key, _ in module.parameters_and_names()}, strict_load=True)
        np.testing.assert_allclose(module(ms.Tensor(x)).asnumpy(), theirs[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_graph_mode_monitor_lines_are_read(release):
    """MFLossMonitor's lines: the total 'loss' is not compared, lm_loss is; mtp_loss is divided by its factor."""
    _, _, work = release
    frame = parse_mindformers_log(work / "graph_lines.log", mtp_loss_scaling_factor=0.3)
    assert frame.attrs["format"] == "mindformers-graph" and frame["step"].tolist() == [1, 2, 3]
    np.testing.assert_allclose(frame["lm_loss"], [s["lm_loss"] for s in GRAPH_STEPS], atol=1e-6)
    np.testing.assert_allclose(frame["mtp_1_loss"], [s["mtp"] / 0.3 for s in GRAPH_STEPS], atol=1e-5)
    np.testing.assert_allclose(frame["aux_loss"], 1.0123, atol=1e-6)
    np.testing.assert_allclose(frame["grad_norm"], 3.25, atol=1e-6)
    np.testing.assert_allclose(frame["lr"], 9.9e-05)
    assert frame.attrs["lr_step_offset"] == 0
