"""``crossalign diagnose --npu-dump --gpu-dump`` on dumps written by msprobe's own PrecisionDebugger.

The MindSpore side is crossalign's MindSpore reference model running a seeded MindFormers checkpoint (PyNative on
CPU, with the one stand-in msprobe needs there, ``sides/mindformers/dump.py``); the PyTorch side is crossalign's
torch reference model running that checkpoint's conversion, correct or with each fault of
``checkpoint/faults.py``, loaded the way Megatron loads it. A layout fault is converted into its (tp, pp, ep) rank
files and read back as Megatron's ranks load them, so the PyTorch side computes what those ranks compute.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from crossalign.checkpoint.faults import FAULTS, LAYOUT_FAULTS
from crossalign.cli import app
from crossalign.config import load_config, resolve_config_path
from crossalign.diagnose import msprobe_metrics
from crossalign.diagnose.msprobe_dump import TensorRecord, read_dump
from crossalign.diagnose.msprobe_match import _module_of_key
from crossalign.diagnose.msprobe_run import diagnose_msprobe
from crossalign.diagnose.msprobe_shards import SideLayout, WholeRecord, combine_statistics
from crossalign.sides.megatron.sharding import Partition, split_tensor
from tests.helpers.msprobe_pairs import run_dumps

pytest.importorskip("msprobe")

# (config, fault) -> (the weight it breaks where the MindSpore dump holds that weight, the module it first shows at)
# The MindSpore reference model keeps conv1d and the routed experts' weights in cells it never calls, so msprobe
# records no forward for them and those faults first show in the activations.
EXPECTED = {
    ("qwen35_dense_tiny", "dense_fc1_not_deinterleaved"): ("decoder.layers.0.mlp.linear_fc1.weight",
                                                           "decoder.layers.0.mlp.linear_fc1"),
    ("qwen35_dense_tiny", "gate_up_swapped"): ("decoder.layers.0.mlp.linear_fc1.weight",
                                               "decoder.layers.0.mlp.linear_fc1"),
    ("qwen35_dense_tiny", "in_proj_wrong_order"): ("decoder.layers.0.self_attention.in_proj.weight",
                                                   "decoder.layers.0.self_attention"),
    ("qwen35_dense_tiny", "conv1d_wrong_axis"): (None, "decoder.layers.0.self_attention"),
    ("qwen35_dense_tiny", "a_log_not_renamed"): ("decoder.layers.0.self_attention.A_log",
                                                 "decoder.layers.0.self_attention"),
    ("qwen35_dense_tiny", "wrong_mtp_prefix"): ("mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight",
                                                "mtp.layers.0."),
    ("qwen35_dense_tiny", "in_proj_split_as_one_block@2,1,1"): ("decoder.layers.0.self_attention.in_proj.weight",
                                                                "decoder.layers.0.self_attention"),
    ("qwen35_moe_tiny", "routed_expert_not_transposed"): (None, "decoder.layers.0.mlp.experts"),
    ("qwen35_moe_tiny", "gate_up_swapped"): ("decoder.layers.0.mlp.shared_experts.linear_fc1.weight",
                                             "decoder.layers.0.mlp.experts"),
    ("qwen35_moe_tiny", "shared_fc1_not_deinterleaved"): ("decoder.layers.0.mlp.shared_experts.linear_fc1.weight",
                                                          "decoder.layers.0.mlp.shared_experts.linear_fc1"),
    ("qwen35_moe_tiny", "in_proj_wrong_order"): ("decoder.layers.0.self_attention.in_proj.weight",
                                                 "decoder.layers.0.self_attention.in_proj"),
    ("qwen35_moe_tiny", "conv1d_wrong_axis"): (None, "decoder.layers.0.self_attention"),
    ("qwen35_moe_tiny", "a_log_not_renamed"): ("decoder.layers.0.self_attention.A_log",
                                               "decoder.layers.0.self_attention"),
    ("qwen35_moe_tiny", "wrong_mtp_prefix"): ("mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight",
                                              "mtp.layers.0."),
    ("qwen35_moe_tiny", "experts_not_renumbered@1,1,2"): (None, "decoder.layers.0.mlp.experts"),
}
CONFIGS = ("qwen35_dense_tiny", "qwen35_moe_tiny")
# changes of the PyTorch side's computation, by hooks (tests/helpers/msprobe_pairs.py perturb), the weights as they are
SCALED_OUTPUT = "clean|output:decoder.layers.1.self_attention.out_proj*1.01"  # one module's output x 1.01
SCALED_GRADIENT = "clean|grad:decoder.layers.0.mlp.shared_experts.linear_fc1.weight*1.01"  # one weight's gradient
SCALED_NORM_GRADIENT = "clean|grad:decoder.layers.1.pre_mlp_layernorm.weight*0.5"  # a replicated weight's
SCALED_BACKWARD = "clean|grad_input:decoder.layers.2.mlp.linear_fc2*1.01"  # the gradient one module passes on
CHANGED = [("qwen35_moe_tiny", SCALED_OUTPUT), ("qwen35_moe_tiny", SCALED_GRADIENT),
           ("qwen35_moe_tiny", SCALED_NORM_GRADIENT), ("qwen35_dense_tiny", SCALED_BACKWARD)]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """config -> {'mindspore': dump, 'statistics': clean PyTorch statistics dump, spec: PyTorch tensor dump}, from
    three processes (msprobe's debugger is one per process, each dumping one model per step)."""
    root = tmp_path_factory.mktemp("msprobe_pairs")
    items = [(name, "clean") for name in CONFIGS] + sorted(EXPECTED) + CHANGED
    pytorch = run_dumps("pytorch", items, root / "pytorch", "tensor")
    mindspore = run_dumps("mindspore", [(name, "clean") for name in CONFIGS], root / "mindspore", "tensor")
    statistics = run_dumps("pytorch", [("qwen35_dense_tiny", "clean")], root / "statistics", "statistics")
    found = {name: {spec: path for (config, spec), path in pytorch.items() if config == name} for name in CONFIGS}
    for name in CONFIGS:
        found[name]["mindspore"] = mindspore[name, "clean"]
    found["qwen35_dense_tiny"]["statistics"] = statistics["qwen35_dense_tiny", "clean"]
    return found


def _diagnose(dumps, name, spec, out):
    return diagnose_msprobe(dumps[name]["mindspore"], dumps[name][spec], load_config(name), out, precision="fp32")


def test_every_fault_has_a_case():
    faults = {spec.partition("@")[0] for _, spec in EXPECTED}
    assert faults == set(FAULTS) | set(LAYOUT_FAULTS)


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_a_clean_pair_shows_no_divergence_and_lists_every_pair(dumps, name, tmp_path):
    result = _diagnose(dumps, name, "clean", tmp_path / "out")
    diagnosis = result.diagnosis
    assert not diagnosis.diverged, diagnosis.hint()
    compared = {row.section for row in diagnosis.rows if row.status == "ok"}
    assert compared == {"weights", "forward", "backward", "weight gradients"}
    assert ("decoder.layers.0.self_attention.linear_proj", "decoder.layers.0.self_attention.out_proj") \
        in diagnosis.mapped
    assert any(n.startswith("decoder.layers.0.input_layernorm (its norm is fused into")
               for n in diagnosis.unmapped_mindspore)
    summary = json.loads(result.files["msprobe_summary.json"].read_text())
    assert summary["diverged"] is False and summary["unmapped_megatron"] == diagnosis.unmapped_megatron
    assert summary["layouts"]["megatron"].startswith("TP 1 x PP 1 x EP 1")


@pytest.mark.slow
@pytest.mark.parametrize("name, spec", sorted(EXPECTED))
def test_each_fault_is_named_at_its_tensor_and_module(dumps, name, spec, tmp_path):
    weight, module = EXPECTED[name, spec]
    fault = spec.partition("@")[0]
    diagnosis = _diagnose(dumps, name, spec, tmp_path / "out").diagnosis
    forward = diagnosis.first["forward"]
    assert forward is not None and _module_of_key(forward.megatron).startswith(module), diagnosis.hint()
    assert forward.input_status != "differs"
    first = diagnosis.first_divergence
    if weight is not None:
        # a conversion fault shows at its own tensor, before any activation
        assert first.section == "weights" and first.megatron == weight, diagnosis.hint()
        assert first.msprobe == "No" and first.metrics["Cosine"] < 0.99
    else:
        assert first is forward
    if fault in FAULTS:
        assert any(fault in cause.faults for cause in diagnosis.causes), diagnosis.hint()


@pytest.mark.slow
def test_metrics_are_msprobes_own_on_the_dumped_tensors(dumps):
    from msprobe.core.compare.algorithm.builtin_algorithm import (alg_cosine_similarity, alg_five_thousand_error,
                                                                  alg_max_absolute_error, alg_max_relative_error,
                                                                  alg_one_thousand_error)
    from msprobe.core.compare.multiprocessing_compute import check_accuracy

    ms = read_dump(dumps["qwen35_dense_tiny"]["mindspore"]).ranks[0].entries
    mg = read_dump(dumps["qwen35_dense_tiny"]["conv1d_wrong_axis"]).ranks[0].entries
    wrapped = "Module.module.module."  # the PyTorch side runs under Megatron's two wrappers
    pairs = [("Cell.decoder.layers.0.self_attention.GatedDeltaNet.forward.0",
              wrapped + "decoder.layers.0.self_attention.GatedDeltaNet.forward.0"),
             ("Cell.decoder.layers.0.mlp.linear_fc2.Linear.forward.0",
              wrapped + "decoder.layers.0.mlp.linear_fc2.Linear.forward.0"),
             ("Cell.embedding.Embedding.forward.0", wrapped + "embedding.Embedding.forward.0")]
    for ms_key, mg_key in pairs:
        n_value, b_value = ms[ms_key].outputs[0].load(), mg[mg_key].outputs[0].load()
        ours = msprobe_metrics.tensor_metrics(n_value, b_value)
        assert ours.cosine == alg_cosine_similarity.compare(n_value, b_value)[0]
        assert ours.max_abs_err == alg_max_absolute_error.compare(n_value, b_value)[0]
        assert ours.max_relative_err == alg_max_relative_error.compare(n_value, b_value)[0]
        assert ours.one_thousandth_err_ratio == alg_one_thousand_error.compare(n_value, b_value)[0]
        assert ours.five_thousandths_err_ratio == alg_five_thousand_error.compare(n_value, b_value)[0]
        assert ours.accuracy_reached == check_accuracy(ours.cosine, ours.max_abs_err)


def test_the_pass_rule_and_relative_error_are_msprobes():
    from msprobe.core.compare.multiprocessing_compute import check_accuracy
    from msprobe.core.compare.utils import get_relative_err

    for cos in (0.5, 0.95, 0.989, 0.995, 1.0):
        for max_abs in (0.0, 0.0005, 0.01, 0.5, 2.0):
            assert msprobe_metrics.check_accuracy(cos, max_abs) == check_accuracy(cos, max_abs), (cos, max_abs)
    n_value = np.array([0.0, 1.0, -2.0, 3.0], dtype=np.float32)
    b_value = np.array([0.0, 0.0, -2.5, 3.0], dtype=np.float32)
    np.testing.assert_array_equal(msprobe_metrics.relative_errors(n_value, b_value), get_relative_err(n_value, b_value))
    assert msprobe_metrics.cosine(np.float32(1.0).reshape(()), np.float32(1.0).reshape(())) is None


@pytest.mark.slow
def test_msprobe_compare_with_the_exported_mappings_finds_the_same_first_divergence(dumps, tmp_path):
    """msprobe's own compare (its CLI) on the same pair, paired by the data_mapping.yaml crossalign wrote: the first
    module whose mapped input passes msprobe's rule and whose mapped output fails it is crossalign's."""
    import pandas as pd

    from msprobe.core.compare.multiprocessing_compute import check_accuracy

    name, spec = "qwen35_dense_tiny", "conv1d_wrong_axis"
    result = _diagnose(dumps, name, spec, tmp_path / "out")
    ours = result.diagnosis.first["forward"]
    npu_json = next(dumps[name]["mindspore"].glob("step0/*/dump.json"))
    bench_json = next(dumps[name][spec].glob("step0/*/dump.json"))
    msprobe = Path(sys.executable).with_name("msprobe")
    found = {}
    for option, mapping in (("-dm", "data_mapping.yaml"), ("-lm", "layer_mapping.yaml")):
        out = tmp_path / option
        out.mkdir()
        run = subprocess.run([str(msprobe), "compare", "-tp", str(npu_json), "-gp", str(bench_json), "-o", str(out),
                              option, str(result.files[mapping])], capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        (csv_path,) = out.glob("compare_result_*.csv")
        table = pd.read_csv(csv_path, keep_default_na=False)
        found[option] = table[table["Bench Name"] != "N/A"]
    verdicts: dict[str, dict[str, list[str]]] = {}
    for _, row in found["-dm"].iterrows():
        key, _, slot = row["NPU Name"].partition(".forward.0.")
        if not slot:
            continue
        verdict = check_accuracy(row["Cosine"], row["MaxAbsErr"])
        verdicts.setdefault(key + ".forward.0", {}).setdefault(slot.split(".")[0], []).append(verdict)
    first = next(key for key, slots in verdicts.items()
                 if "No" in slots.get("output", []) and "No" not in slots.get("input", []))
    assert first == ours.mindspore
    # the layer mapping pairs the cells crossalign renames (the GDN's linear_proj is Megatron's out_proj)
    assert ("Cell.decoder.layers.0.self_attention.linear_proj.Linear.forward.0.output.0"
            in set(found["-lm"]["NPU Name"]))
    assert any(b.startswith("Module.module.module.decoder.layers.0.self_attention.out_proj.")
               for b in found["-lm"]["Bench Name"])


# ---- merging rank folders -----------------------------------------------------------------------------------


def test_which_ranks_a_layout_needs():
    layout = SideLayout(tensor=2, pipeline=1, expert=2, data=2)  # TP 2 x EP 2 (ETP 2) on 4 cards
    assert layout.needed() == [0, 1, 2, 3]
    assert [layout.coordinates(r) for r in range(4)] == [(0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1)]
    assert [layout.expert_coordinates(r)[:2] for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    two_cards = SideLayout(tensor=2, pipeline=1, expert=2, data=1, expert_tensor=1)  # experts over the TP ranks
    assert two_cards.needed() == [0, 1] and [two_cards.expert_coordinates(r)[:2] for r in (0, 1)] == [(0, 0), (0, 1)]
    assert SideLayout(tensor=2, pipeline=2, expert=1, data=2).needed() == [0, 1, 4, 5]


@pytest.mark.slow
def test_shards_of_a_dumped_tensor_merge_back_exactly(dumps, tmp_path):
    """A real in_proj output split as Megatron's tensor ranks hold it (each rank its [q|k|v|z|beta|alpha] slice)
    merges back bit for bit, and its statistics combine to what msprobe wrote for the whole tensor."""
    model = load_config("qwen35_dense_tiny").model
    entry = read_dump(dumps["qwen35_dense_tiny"]["clean"]).ranks[0].entries[
        "Module.module.module.decoder.layers.0.self_attention.in_proj.LayerNormLinear.forward.0"]
    whole = entry.outputs[0]
    array = whole.load()
    qk, v, nv = model.gdn_key_dim, model.gdn_value_dim, model.linear_num_value_heads
    partition = Partition(array.ndim - 1, (qk, qk, v, v, nv, nv))
    shards = split_tensor(torch.from_numpy(array), partition, 2)
    records = []
    for rank, shard in enumerate(shards):
        path = tmp_path / f"rank{rank}.npy"
        np.save(path, shard.numpy())
        values = shard.numpy()
        records.append(TensorRecord(whole.dtype, tuple(values.shape),
                                    {"Max": float(values.max()), "Min": float(values.min()),
                                     "Mean": float(values.mean()), "Norm": float(np.linalg.norm(values))},
                                    data_path=path))
    merged = WholeRecord(whole.dtype, whole.shape, records, array.ndim - 1, partition.segments)
    np.testing.assert_array_equal(merged.load(), array)
    stats = combine_statistics(records)
    for key in ("Max", "Min"):
        assert stats[key] == pytest.approx(whole.stats[key], rel=1e-6)
    assert stats["Norm"] == pytest.approx(whole.stats["Norm"], rel=1e-5)
    assert stats["Mean"] == pytest.approx(whole.stats["Mean"], rel=1e-4, abs=1e-7)
    assert math.prod(merged.shape) == array.size


# ---- bad input: a clear error naming the file, exit 2, nothing written ---------------------------------------


@pytest.mark.slow
def test_bad_dumps_are_refused_naming_the_file(dumps, tmp_path):
    import shutil

    runner = CliRunner()
    pairs = dumps["qwen35_dense_tiny"]
    ms, pt = pairs["mindspore"], pairs["clean"]

    def refused(npu, gpu, match, model="qwen35_dense_tiny"):
        out = tmp_path / "out"
        result = runner.invoke(app, ["diagnose", "--model", str(model), "--npu-dump", str(npu), "--gpu-dump",
                                     str(gpu), "--out", str(out)])
        assert result.exit_code == 2, result.output
        assert match in " ".join(result.output.split()), result.output
        assert not out.exists()

    refused(pt, pt, "dump.json: a pytorch dump given as --npu-dump")
    refused(ms, pairs["statistics"], "holds tensor and")
    other_step = tmp_path / "step3dump"
    shutil.copytree(pt / "step0", other_step / "step3")
    refused(ms, other_step, "is step 0 and")
    truncated = tmp_path / "truncated"
    shutil.copytree(pt, truncated)
    (dump_json,) = truncated.glob("step0/*/dump.json")
    dump_json.write_text(dump_json.read_text()[:1000])
    refused(ms, truncated, "dump.json: not valid JSON")
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(ms, empty, "empty: no step{N} folder and no dump.json (empty dump?)")
    two_ranks = yaml.safe_load(resolve_config_path("qwen35_dense_tiny").read_text())
    two_ranks["parallel"]["megatron"].update(tensor=2, sequence_parallel=True, cards_per_node=2)
    config = tmp_path / "tp2.yaml"
    config.write_text(yaml.safe_dump(two_ranks))
    refused(ms, pt, "the Megatron dump does not fit the config's layout parallel.megatron (TP 2 x PP 1 + SP (DP 1) "
                    "on 1 x 2 cards). It implies TP 1 x PP 1 on 1 card", model=config)
    refused(ms, pt, "Pass --set parallel.megatron.tensor=1 --set parallel.megatron.sequence_parallel=false",
            model=config)


@pytest.mark.slow
def test_cli_diagnose_takes_the_dumps_a_run_collected(dumps, tmp_path):
    import shutil

    from crossalign.diagnose.msprobe_run import RUN_DUMP_DIR
    from crossalign.store import RunStore

    config = load_config("qwen35_dense_tiny")
    run = RunStore(tmp_path / "store").create_run("r1", config, config_source="test", parameters={}, code_version={})
    pairs = dumps["qwen35_dense_tiny"]
    shutil.copytree(pairs["mindspore"], run.step_dir("pynative-train") / RUN_DUMP_DIR)
    shutil.copytree(pairs["dense_fc1_not_deinterleaved"], run.step_dir("megatron-train") / RUN_DUMP_DIR)
    result = CliRunner().invoke(app, ["diagnose", "--run", str(run.path), "--precision", "fp32", "--rows", "2"])
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert "weights: first differs at decoder.layers.0.mlp.linear_fc1.weight" in text
    assert "forward: first differs at Module.decoder.layers.0.mlp.linear_fc1.LayerNormLinear.forward.0" in text
    assert "de-interleaved" in text
    summary = json.loads((run.path / "diagnose" / "msprobe_summary.json").read_text())
    assert summary["first_divergence"]["megatron"] == "decoder.layers.0.mlp.linear_fc1.weight"
    assert (run.path / "diagnose" / "data_mapping.yaml").is_file()


# ---- thresholds from the dumps' dtypes, and causes that fit the evidence ---------------------------------------


def _cli(dumps, name, spec, out, *options):
    result = CliRunner().invoke(app, ["diagnose", "--model", name, "--npu-dump", str(dumps[name]["mindspore"]),
                                      "--gpu-dump", str(dumps[name][spec]), "--out", str(out), *options])
    assert result.exit_code in (0, 1), result.output
    return result, json.loads((out / "msprobe_summary.json").read_text())


@pytest.mark.slow
def test_fp32_dumps_with_one_output_scaled_by_1_01_name_that_module_under_precision_auto(dumps, tmp_path):
    """Both dumps record float32 only: --precision auto holds them to fp32's thresholds and names the module whose
    output was scaled; bf16's, looser, pass it (what auto took for every msprobe dump before)."""
    result, summary = _cli(dumps, "qwen35_moe_tiny", SCALED_OUTPUT, tmp_path / "auto")
    assert result.exit_code == 1, result.output
    assert summary["thresholds"]["precision"] == "fp32"
    assert "both sides ran in fp32" in summary["thresholds"]["why"] and "float32 only" in summary["thresholds"]["why"]
    assert "thresholds: fp32 (--precision auto: both sides ran in fp32" in " ".join(result.output.split())
    first = summary["first_divergence"]
    assert first["section"] == "forward" and first["input"] == "ok", first
    assert _module_of_key(first["megatron"]) == "decoder.layers.1.self_attention.out_proj"
    assert first["norm ratio"] == pytest.approx(1.01, rel=1e-4) and first["Cosine"] > 0.99999  # a scale, not noise
    # the module's weight agrees element by element: no conversion cause is offered for it
    assert summary["evidence"] == "forward"
    assert "the conversion is ruled out at decoder.layers.1.self_attention.out_proj" in summary["conversion_ruled_out"]
    assert summary["causes"] == []
    _, loose = _cli(dumps, "qwen35_moe_tiny", SCALED_OUTPUT, tmp_path / "bf16", "--precision", "bf16")
    assert loose["diverged"] is False and loose["thresholds"]["why"].startswith("--precision bf16 (asked")


@pytest.mark.slow
def test_a_gradient_only_divergence_names_gradient_causes_and_rules_the_conversion_out(dumps, tmp_path):
    """One weight's gradient scaled while the weights, the forward and the backward activations agree: the causes
    are the gradient's, and no conversion cause (not the shared-expert fc1 de-interleave) is offered."""
    diagnosis = _diagnose(dumps, "qwen35_moe_tiny", SCALED_GRADIENT, tmp_path / "out").diagnosis
    first = diagnosis.first_divergence
    assert (first.section, first.megatron) == ("weight gradients", "decoder.layers.0.mlp.shared_experts.linear_fc1.weight")
    assert diagnosis.first["forward"] is None and diagnosis.first["backward"] is None
    assert first.metrics["norm ratio"] == pytest.approx(1.01, rel=1e-4)
    assert diagnosis.evidence.kind == "gradient"
    assert not [cause for cause in diagnosis.causes if cause.conversion or cause.faults]
    assert [cause.needs for cause in diagnosis.causes] == ["only a weight gradient diverges"]
    hint = diagnosis.hint()
    assert "the conversion is ruled out" in hint and "weights compared agree" in hint and "de-interleaved" not in hint
    assert "one gradient scaled on one side" in hint


@pytest.mark.slow
def test_a_missing_all_reduce_is_a_cause_only_where_a_side_splits_the_model(dumps, tmp_path):
    """A norm's gradient halved: at TP 1 on both sides no all-reduce over tensor ranks exists to miss."""
    diagnosis = _diagnose(dumps, "qwen35_moe_tiny", SCALED_NORM_GRADIENT, tmp_path / "out").diagnosis
    first = diagnosis.first_divergence
    assert first.section == "weight gradients" and first.megatron.startswith("decoder.layers.1.")
    assert diagnosis.evidence.kind == "gradient" and diagnosis.evidence.parallel is False
    assert not any("all-reduced" in cause.cause for cause in diagnosis.causes)
    from crossalign.diagnose.causes import Evidence, explain

    split = explain(first.megatron, load_config("qwen35_moe_tiny").model, None, Evidence("gradient", True, True))
    assert any("all-reduced" in cause.cause for cause in split)


@pytest.mark.slow
def test_a_backward_only_divergence_offers_no_conversion_cause(dumps, tmp_path):
    diagnosis = _diagnose(dumps, "qwen35_dense_tiny", SCALED_BACKWARD, tmp_path / "out").diagnosis
    first = diagnosis.first_divergence
    assert first.section == "backward" and _module_of_key(first.megatron) == "decoder.layers.2.mlp.linear_fc2", \
        diagnosis.hint()
    assert diagnosis.first["forward"] is None and diagnosis.evidence.kind == "backward"
    assert diagnosis.causes and not [cause for cause in diagnosis.causes if cause.conversion]
    assert "the conversion is ruled out" in diagnosis.hint()
