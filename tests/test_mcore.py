"""megatron-core itself on CPU: the workarounds and their self-test, the shared layer-spec builder of the GPU
launcher, the TE<->local name map, strict loading that catches every conversion fault, and training that
matches Megatron's semantics as our PyTorch reference implements them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from crossalign.data.files import DatasetFiles
from crossalign.sides.protocol import TrainRequest
from crossalign.sides.megatron.embedded import mcore_cpu, torch_trainer
from crossalign.sides.megatron.embedded import trainer as mcore_trainer
from crossalign.sides.megatron.embedded.mcore_model import (LAUNCHER, McoreLoadError, build_gpt_model, run_selfcheck_forward,
                                                   transformer_config)
from crossalign.checkpoint.convert import mindformers_to_megatron
from crossalign.tensorio.errors import CheckpointError
from crossalign.checkpoint.faults import FAULTS, inject_fault
from crossalign.models.layout import random_mindformers_state
from crossalign.sides.megatron.checkpoint import read_megatron_checkpoint
from crossalign.checkpoint.rules import conversion_plan
from crossalign.sides.megatron.te_local import local_to_te, te_to_local, te_to_local_names
from crossalign.config import load_config
from crossalign.diagnose.references import build_megatron, random_batch, run_megatron
from crossalign.diagnose.selfcheck import compare_outputs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIGS = ("qwen35_dense_tiny", "qwen35_moe_tiny")
# faults that rename a key: megatron-core's strict load must name the key
KEY_FAULTS = {"a_log_not_renamed": "self_attention.A_log", "wrong_mtp_prefix": "mtp.layers.0.transformer_layer."}


@pytest.fixture(scope="module")
def converted():
    """name -> (config, correct Megatron state, batch, PyTorch reference outputs on it), each made once."""
    cache = {}

    def get(name):
        if name not in cache:
            config = load_config(name)
            state = random_mindformers_state(config.model, seed=7)
            batch = random_batch(config.model, 32, 2, seed=3)
            mg = mindformers_to_megatron(state, config.model)
            net, _ = build_megatron(config.model, mg, config.training.megatron_core_version)
            cache[name] = config, state, batch, run_megatron(net, batch)
        return cache[name]
    return get


def mcore_outputs(config, mg_state, batch):
    from crossalign.diagnose.references import Outputs

    out = run_selfcheck_forward(config.model, config.training, mg_state, config.training.megatron_core_version,
                                batch.input_ids, batch.labels, batch.loss_mask)
    return Outputs(out["logits"], out["lm_loss"], np.asarray(out["mtp_losses"]), out["aux_loss"])


def test_the_runtime_is_undone_on_exit():
    original = torch.cuda.current_device
    with mcore_cpu.megatron_core_on_cpu(seed=5):
        assert torch.cuda.current_device() == "cpu" and torch.distributed.is_initialized()
        from megatron.core import parallel_state
        assert parallel_state.get_tensor_model_parallel_world_size() == 1
    assert torch.cuda.current_device is original and not torch.distributed.is_initialized()


def test_the_self_test_names_what_an_upgrade_changed():
    mcore_cpu.self_test()  # the installed megatron-core is the one the workarounds were written for
    moved = mcore_cpu.Workaround("megatron.core.ssm.gated_delta_net", "l2norm", "a reason",
                                 lambda: None, upstream="from fla.modules.l2norm import l2norm_v2")
    gone = mcore_cpu.Workaround("megatron.core.transformer.utils", "no_such_function", "another reason", lambda: None)
    with pytest.raises(mcore_cpu.MegatronCpuError) as caught:
        mcore_cpu.self_test((moved, gone))
    assert "megatron.core.ssm.gated_delta_net.l2norm" in str(caught.value)
    assert "no_such_function no longer exists" in str(caught.value)
    with pytest.raises(mcore_cpu.MegatronCpuError, match="megatron-core .* checked on 0.15.0"):
        mcore_cpu.self_test((), {"megatron-core": ("0.15.0",), "torch": mcore_cpu.CHECKED_VERSIONS["torch"]})


def test_the_self_test_names_a_bf16_optimizer_that_no_longer_sorts_by_cuda_type_names(monkeypatch):
    monkeypatch.setattr(mcore_cpu.CpuTensorTypesAsCuda, "UPSTREAM",
                        ("megatron.core.optimizer.optimizer", "param.type() in ['torch.BFloat16Tensor']"))
    with pytest.raises(mcore_cpu.MegatronCpuError, match="CpuTensorTypesAsCuda: .* no longer in "
                                                         "megatron.core.optimizer.optimizer"):
        mcore_cpu.self_test(())


@pytest.mark.parametrize("name", CONFIGS)
def test_name_map_is_invertible_and_gives_megatron_cores_own_keys(name, converted):
    config, state, _, _ = converted(name)
    mg = mindformers_to_megatron(state, config.model)
    core = config.training.megatron_core_version
    names = te_to_local_names(config.model, core)
    assert len(set(names.values())) == len(names)  # one to one
    assert local_to_te(te_to_local(mg, config.model, core), config.model, core).keys() == mg.keys()
    with mcore_cpu.megatron_core_on_cpu(seed=1):
        net = build_gpt_model(config.model, config.training)
    assert set(te_to_local(mg, config.model, core)) == {k for k in net.state_dict() if not k.endswith("._extra_state")}


def applicable_faults(name):
    config = load_config(name)
    found = []
    for fault in FAULTS:
        try:
            inject_fault(conversion_plan(config.model), fault, config.model, config.training.megatron_core_version)
        except CheckpointError:
            continue
        found.append(fault)
    return found


CASES = [(name, fault) for name in CONFIGS for fault in [None, *applicable_faults(name)]]


def test_every_fault_is_injected_on_some_config():
    assert {fault for _, fault in CASES if fault} == set(FAULTS)


@pytest.mark.parametrize("name, fault", CASES)
def test_megatron_core_catches_each_conversion_fault(name, fault, converted):
    config, state, batch, reference = converted(name)
    faulty = mindformers_to_megatron(state, config.model, fault=fault)
    if fault in KEY_FAULTS:
        with pytest.raises(McoreLoadError) as caught:
            mcore_outputs(config, faulty, batch)
        assert KEY_FAULTS[fault] in str(caught.value)
        return
    checks = {c.name: c for c in compare_outputs(reference, mcore_outputs(config, faulty, batch))}
    if fault is None:  # a correct conversion: megatron-core and the PyTorch reference agree
        assert all(c.passed for c in checks.values()), checks
        assert max(c.max_rel for c in checks.values()) <= 1e-5
    else:
        assert not checks["logits"].passed and not checks["lm loss"].passed, (fault, checks)


def load_launcher():
    spec = importlib.util.spec_from_file_location("pretrain_qwen35_under_test", LAUNCHER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stock_builders(version):
    """A gpt_builders module whose gpt_builder picks the decoder and MTP specs by name, as core 0.16 / 0.19 do."""
    module = type(sys)("gpt_builders")
    module.get_transformer_block_with_experimental_attention_variant_spec = lambda config, vp_stage=None: "stock block"
    if version == "0.16":
        module.get_gpt_decoder_layer_specs = lambda config, **kwargs: ["stock standard layer"]

        def gpt_builder(args, pre_process, post_process, vp_stage=None, config=None):
            block = module.get_transformer_block_with_experimental_attention_variant_spec(config=config,
                                                                                          vp_stage=vp_stage)
            layers = module.get_gpt_decoder_layer_specs(config, use_transformer_engine=False, vp_stage=vp_stage)
            return block, layers[-1]
    else:
        module.get_transformer_layer_with_experimental_attention_variant_spec = lambda config: ["stock layer"]

        def gpt_builder(args, pre_process, post_process, vp_stage=None, config=None):
            block = module.get_transformer_block_with_experimental_attention_variant_spec(config=config,
                                                                                          vp_stage=vp_stage)
            return block, module.get_transformer_layer_with_experimental_attention_variant_spec(config=config)[-1]
    module.gpt_builder = gpt_builder
    return module


@pytest.mark.parametrize("version", ["0.16", "0.19"])
def test_launcher_builds_with_its_own_layer_specs_during_a_gdn_build(version):
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.transformer.attention import SelfAttention

    launcher, builders = load_launcher(), stock_builders(version)
    config = load_config("qwen35_moe_tiny")
    mcore_config = transformer_config(config.model, config.training)
    wrapped = launcher.wrap_builder(builders)
    gdn = type("Args", (), {"experimental_attention_variant": "gated_delta_net", "transformer_impl": "local"})()
    with mcore_cpu.megatron_core_on_cpu(seed=1):  # the stage slicing reads the parallel state
        block, mtp_layer = wrapped(gdn, True, True, vp_stage=None, config=mcore_config)
    mixers = [spec.submodules.self_attention.module for spec in block.layer_specs]
    assert mixers == [GatedDeltaNet, GatedDeltaNet, GatedDeltaNet, SelfAttention]
    assert mtp_layer.submodules.self_attention.module is SelfAttention  # the model's last layer: full attention
    assert builders.gpt_builder(gdn, True, True, config=mcore_config)[0] == "stock block"  # restored after the build
    plain = type("Args", (), {"experimental_attention_variant": None})()
    assert wrapped(plain, True, True, config=mcore_config)[0] == "stock block"


def test_launcher_finds_the_checkout_through_the_import_path(tmp_path, monkeypatch):
    checkout = tmp_path / "Megatron-LM"
    checkout.mkdir()
    (checkout / "gpt_builders.py").write_text("")
    (checkout / "pretrain_gpt.py").write_text("")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.delenv("MEGATRON_LM_PATH", raising=False)
    launcher = load_launcher()
    assert launcher.find_checkout() is None
    monkeypatch.syspath_prepend(str(checkout))
    assert Path(launcher.find_checkout()) == checkout


def test_megatron_core_trains_as_the_reference_trainer(tmp_path):
    """Same weights, same batches: megatron-core's DDP, optimizer and scheduler log what our PyTorch trainer logs."""
    base = load_config("qwen35_moe_tiny")
    training = base.training.model_copy(update=dict(train_iters=4, lr_warmup_iters=2, seq_length=32,
                                                    global_batch_size=4, micro_batch_size=2))
    config = base.model_copy(update={"training": training})
    mg = mindformers_to_megatron(random_mindformers_state(config.model, seed=11), config.model)
    tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, (4, 4, 33), dtype=np.int64)
    logs = {}
    for label, module in (("reference", torch_trainer), ("megatron-core", mcore_trainer)):
        request = TrainRequest(config=config, side="megatron", mode="align",
                               data=DatasetFiles(tmp_path / "data", tmp_path / "tokenizer.json"),
                               output_dir=tmp_path / label, init_checkpoint=tmp_path / "checkpoint",
                               save=module is mcore_trainer)
        result = module.run_training(request, mg, 1, tokens)
        logs[label] = [line.split("| learning rate:")[1].split("| number of skipped")[0]
                       for line in request.log_path.read_text().splitlines() if "| learning rate:" in line]
    assert len(logs["megatron-core"]) == 4
    # the manifest's record of where and with which GatedDeltaNet kernels it trained, and their probe before
    probed = result.details.pop("kernel_probe")
    assert result.details == {"device": "cpu", "device_name": "cpu", "kernels": {
        "delta_rule": "megatron.core torch_chunk_gated_delta_rule", "l2norm": "torch l2norm (mcore_cpu)",
        "conv1d": "torch conv1d"}}
    assert len(probed) == 11 and all(line.startswith("[ok  ]") for line in probed)
    for ours, theirs in zip(logs["reference"], logs["megatron-core"]):
        a = dict(part.strip().split(": ") for part in ours.split("|") if ":" in part)
        b = dict(part.strip().split(": ") for part in theirs.split("|") if ":" in part)
        assert a.keys() == b.keys() and {"lm loss", "load_balancing_loss", "mtp_1 loss", "grad norm"} <= a.keys()
        for key in a:
            assert float(a[key]) == pytest.approx(float(b[key]), rel=2e-6, abs=1e-3 if key == "grad norm" else 0)
    # the trained weights, saved in Megatron's format under the TE names, load strictly into the PyTorch reference
    saved = read_megatron_checkpoint(result.checkpoint_dir, config.model)
    assert saved.iteration == 4 and saved.state.keys() == mg.keys()
    build_megatron(config.model, saved.state, config.training.megatron_core_version, strict=True)
    assert not torch.equal(saved.state["output_layer.weight"], mg["output_layer.weight"])


def test_bf16_computes_in_bf16_and_updates_fp32_main_weights(tmp_path):
    """training.embedded_precision bf16 is megatron-core's --bf16 on CPU: Float16Module and the fp32-main optimizer."""
    from helpers.embedded import config_with

    model = load_config("qwen35_dense_tiny").model
    mg = {key: value.to(torch.bfloat16)
          for key, value in mindformers_to_megatron(random_mindformers_state(model, seed=5), model).items()}
    tokens = np.random.default_rng(1).integers(0, model.vocab_size, (2, 2, 33), dtype=np.int64)
    losses, saved = {}, {}
    for precision in ("fp32", "bf16"):
        config = config_with("qwen35_dense_tiny", train_iters=2, lr_warmup_iters=0, seq_length=32,
                             global_batch_size=2, micro_batch_size=1, embedded_precision=precision)
        metrics = []
        request = TrainRequest(config=config, side="megatron", mode="align",
                               data=DatasetFiles(tmp_path / "data", tmp_path / "tokenizer.json"),
                               output_dir=tmp_path / precision, init_checkpoint=tmp_path / "checkpoint", save=True,
                               on_step=lambda step, total, values: metrics.append(values["lm_loss"]))
        result = mcore_trainer.run_training(request, mg, 1, tokens)
        losses[precision] = metrics
        saved[precision] = read_megatron_checkpoint(result.checkpoint_dir, config.model).state
    # the same bf16-exact weights: iteration 1 differs only by bf16 arithmetic, which is small but not nothing
    assert losses["bf16"][0] != losses["fp32"][0]
    assert losses["bf16"][0] == pytest.approx(losses["fp32"][0], rel=1e-2)
    # the model (and its checkpoint) is bf16; Adam updated fp32 main weights and the step reached the model
    assert {value.dtype for value in saved["bf16"].values()} == {torch.bfloat16}
    assert {value.dtype for value in saved["fp32"].values()} == {torch.float32}
    assert not torch.equal(saved["bf16"]["output_layer.weight"], mg["output_layer.weight"])


def test_megatron_core_refuses_a_warmup_that_megatron_asserts_on(tmp_path):
    config = load_config("qwen35_dense_tiny")
    config = config.model_copy(update={"training": config.training.model_copy(update=dict(train_iters=5))})
    request = TrainRequest(config=config, side="megatron", mode="align",
                           data=DatasetFiles(tmp_path / "data", tmp_path / "tokenizer.json"),
                           output_dir=tmp_path / "out", init_checkpoint=tmp_path / "checkpoint")
    with pytest.raises(ValueError, match="lr_warmup_iters 5 must be below training.train_iters 5"):
        mcore_trainer.run_training(request, {}, 1, np.zeros((5, 4, 129), dtype=np.int64))


def test_the_report_names_what_trained_each_side(tmp_path):
    from crossalign.report.compare import CompareOptions, compare_logs

    fixtures = Path(__file__).parent / "fixtures" / "logs"
    config = load_config("qwen35_dense_tiny")
    ran = {"npu": "crossalign's MindSpore Qwen3.5", "gpu": mcore_trainer.LocalMegatronBackend().implementation(config)}
    summary = compare_logs(fixtures / "mindformers_pynative.log", fixtures / "megatron_0.16_noise.log", tmp_path,
                           CompareOptions(plot=False), implementations=ran)
    assert summary.to_dict()["inputs"]["gpu"]["implementation"].startswith("megatron-core 0.16.1")
    report = (tmp_path / "report.md").read_text()
    assert f"trained by {ran['gpu']}" in report and f"trained by {ran['npu']}" in report


def write_indexed_dataset(prefix: Path, vocab: int, documents: int = 40, seed: int = 0) -> None:
    """A small Megatron indexed dataset of random documents, written by megatron-core's own builder."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for _ in range(documents):
        length = int(rng.integers(50, 300))
        builder.add_document(torch.from_numpy(rng.integers(0, vocab, length).astype(np.int32)), [length])
    builder.finalize(f"{prefix}.idx")


def test_backend_trains_from_a_bf16_megatron_checkpoint_on_the_megatron_sample_order(tmp_path):
    from helpers.embedded import config_with, initial_state, iteration_lines

    from crossalign.sides.megatron.embedded.trainer import LocalMegatronBackend
    from crossalign.sides.megatron.checkpoint import write_megatron_checkpoint
    from crossalign.sides.registry import batches_for

    config = config_with("qwen35_dense_tiny", train_iters=2, lr_warmup_iters=1)
    prefix = tmp_path / "data" / "corpus_text_document"
    prefix.parent.mkdir()
    write_indexed_dataset(prefix, config.model.vocab_size)
    state = {key: value.to(torch.bfloat16) for key, value in initial_state(config).items()}
    write_megatron_checkpoint(tmp_path / "checkpoint", 20, state)

    metrics = []
    request = TrainRequest(config=config, side="megatron", mode="align",
                           data=DatasetFiles(prefix, tmp_path / "data" / "tokenizer.json"),
                           output_dir=tmp_path / "out", init_checkpoint=tmp_path / "checkpoint",
                           on_step=lambda step, total, values: metrics.append((step, total, values)))
    result = LocalMegatronBackend().train(request)
    assert result.iterations == 2 and result.checkpoint_dir is None
    lines = result.log_path.read_text().splitlines()
    assert f" loading checkpoint from {tmp_path / 'checkpoint'} at iteration 20" in lines
    assert len(iteration_lines(lines)) == 2
    assert [(step, total) for step, total, _ in metrics] == [(1, 2), (2, 2)]

    # iteration 1 is the loss of the upcast bf16 weights on Megatron's first global batch, as our reference computes it
    from crossalign.models.torch_model import Qwen35Model

    net = Qwen35Model(config.model)
    net.load_state_dict({key: value.float() for key, value in state.items()})
    tokens = torch.as_tensor(batches_for("megatron", config.training, prefix)[0])
    _, lm_loss, _, _ = net(tokens[:, :-1], tokens[:, 1:], torch.ones(4, config.training.seq_length))
    assert metrics[0][2]["lm_loss"] == pytest.approx(lm_loss.item(), rel=1e-6)
    assert LocalMegatronBackend().implementation(config).startswith("megatron-core 0.16.1")
    assert LocalMegatronBackend().implementation(config).endswith("on CPU, fp32)")
    bf16 = config.model_copy(update={"training": config.training.model_copy(update={"embedded_precision": "bf16"})})
    assert LocalMegatronBackend().implementation(bf16).endswith("on CPU, bf16 on fp32 main weights)")


def test_backend_runs_the_alignment_step_only(tmp_path):
    from crossalign.sides.megatron.embedded.trainer import LocalMegatronBackend

    config = load_config("qwen35_dense_tiny")
    request = TrainRequest(config=config, side="megatron", mode="base",
                           data=DatasetFiles(tmp_path / "corpus", tmp_path / "tokenizer.json"), output_dir=tmp_path)
    with pytest.raises(ValueError, match="mode 'base' is not supported"):
        LocalMegatronBackend().train(request)
    newer = config.training.model_copy(update={"megatron_core_version": "0.17.0"})
    other = config.model_copy(update={"training": newer})
    request = TrainRequest(config=other, side="megatron", mode="align", init_checkpoint=tmp_path / "checkpoint",
                           data=DatasetFiles(tmp_path / "corpus", tmp_path / "tokenizer.json"), output_dir=tmp_path)
    with pytest.raises(ValueError, match="megatron_core_version is 0.17.0, but the embedded GPU side is the installed "
                                         "megatron-core 0.16.1"):
        LocalMegatronBackend().train(request)


def test_the_orchestrating_process_never_loads_megatron_core():
    """Picking the GPU backend (what the flow does) imports neither megatron-core nor its CPU workarounds."""
    import subprocess

    code = ("import sys; from crossalign.site import SiteConfig; "
            "from crossalign.tasks.backends import training_backend; "
            "backend = training_backend('gpu', SiteConfig()); "
            "print(backend.name, 'megatron.core' in sys.modules, 'crossalign.sides.megatron.embedded.mcore_cpu' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["local-megatron", "False", "False"], done.stderr


def test_the_te_path_of_the_layer_specs_calls_helpers_this_megatron_core_has():
    """The TE branch cannot be built without TransformerEngine; every upstream helper it calls must exist here
    (core 0.16.1; core_v0.17.0 .. core_v0.19.0 have the same names in experimental_attention_variant_module_specs)."""
    import inspect
    import re

    from megatron.core.models.gpt import experimental_attention_variant_module_specs as hybrid

    called = set(re.findall(r"hybrid\.(\w+)\(", inspect.getsource(load_launcher())))
    assert {"get_gated_delta_net_module_spec", "_get_self_attention_module_spec", "_get_moe_module_spec",
            "_get_dense_mlp_module_spec"} <= called
    assert [name for name in called if not hasattr(hybrid, name)] == []
