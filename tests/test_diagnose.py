"""Layer-by-layer diagnosis: the dump format and its hooks, the module mapping from the conversion rules,
and the localisation of every conversion fault to the module it breaks.

The MindSpore dump of each tiny config is made once; each fault then needs one PyTorch forward.
"""

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from crossalign.checkpoint.convert import convert_checkpoint, mindformers_to_megatron
from crossalign.tensorio.errors import CheckpointError
from crossalign.checkpoint.faults import FAULTS, LAYOUT_FAULTS, inject_fault
from crossalign.models.layout import random_mindformers_state
from crossalign.sides.mindformers.checkpoint import default_common, write_mindformers_checkpoint
from crossalign.checkpoint.rules import conversion_plan
from crossalign.cli import app
from crossalign.config import load_config
from crossalign.diagnose.causes import KNOWN_CAUSES, explain
from crossalign.diagnose.compare import compare_arrays
from crossalign.diagnose.dump import DumpError, read_dump, tensor_stats
from crossalign.diagnose.hooks import install_mindspore_dump_hooks, install_torch_dump_hooks
from crossalign.diagnose.mapping import MappingError, module_mapping, module_mapping_from_rules
from crossalign.diagnose.run import compare_dump_folders, diagnose, dump_megatron, dump_mindspore
from crossalign.diagnose.references import SideError, random_batch

SEQ, BATCH = 32, 1

# Where each fault must first show (layer 0 of the tiny configs is a GDN layer).
EXPECTED = {
    ("qwen35_dense_tiny", "dense_fc1_not_deinterleaved"): "decoder.layers.0.mlp.linear_fc1",
    ("qwen35_dense_tiny", "gate_up_swapped"): "decoder.layers.0.mlp.linear_fc1",
    ("qwen35_dense_tiny", "in_proj_wrong_order"): "decoder.layers.0.self_attention",  # in_proj is split: not paired
    ("qwen35_dense_tiny", "conv1d_wrong_axis"): "decoder.layers.0.self_attention",
    ("qwen35_dense_tiny", "a_log_not_renamed"): "decoder.layers.0.self_attention",
    ("qwen35_dense_tiny", "wrong_mtp_prefix"): "mtp.layers.0.",
    ("qwen35_moe_tiny", "routed_expert_not_transposed"): "decoder.layers.0.mlp.experts",
    ("qwen35_moe_tiny", "gate_up_swapped"): "decoder.layers.0.mlp.experts",
    ("qwen35_moe_tiny", "shared_fc1_not_deinterleaved"): "decoder.layers.0.mlp.shared_experts.linear_fc1",
    ("qwen35_moe_tiny", "in_proj_wrong_order"): "decoder.layers.0.self_attention.in_proj",
    ("qwen35_moe_tiny", "conv1d_wrong_axis"): "decoder.layers.0.self_attention",
    ("qwen35_moe_tiny", "a_log_not_renamed"): "decoder.layers.0.self_attention",
    ("qwen35_moe_tiny", "wrong_mtp_prefix"): "mtp.layers.0.",
}

# Faults of a sharded checkpoint: (config, fault, (tp, pp, ep), where it first shows). Dense GDN layers split in_proj
# on the MindSpore side, so it shows in the mixer's first compared output (MoE's, in in_proj: the CLI test).
LAYOUT_EXPECTED = [
    ("qwen35_dense_tiny", "in_proj_split_as_one_block", (2, 1, 1), "decoder.layers.0.self_attention"),
    ("qwen35_moe_tiny", "experts_not_renumbered", (1, 1, 2), "decoder.layers.0.mlp.experts"),
]


# ---- dump format and hooks ---------------------------------------------------------------------------


class Wrapper(torch.nn.Module):
    """Like Megatron's DDP wrapper: the model sits under ``module``; ``proj`` runs twice."""

    def __init__(self):
        super().__init__()
        self.module = torch.nn.ModuleDict({"proj": torch.nn.Linear(4, 4), "act": torch.nn.Tanh()})

    def forward(self, x):
        proj = self.module["proj"]
        return self.module["act"](proj(proj(x)))


def test_torch_hooks_write_one_batch_in_forward_order(tmp_path):
    torch.manual_seed(0)
    net, x = Wrapper(), torch.randn(2, 3, 4)
    session = install_torch_dump_hooks(net, tmp_path / "dump", meta={"note": "unit"})
    assert not (tmp_path / "dump").exists()  # nothing that looks complete before the forward ends
    expected = net(x)
    net(x + 1)  # a second batch is not recorded: the hooks removed themselves
    assert session.finished
    dump = read_dump(tmp_path / "dump")
    assert [e.key for e in dump.entries] == ["proj", "proj#1", "act"]  # "module." stripped, calls numbered
    assert dump.meta == {"note": "unit"} and dump.framework == "torch"
    act = dump.by_key["act"]
    np.testing.assert_array_equal(dump.tensor(act, 0), expected.detach().numpy())
    stats = act.outputs[0]
    assert stats["shape"] == [2, 3, 4] and stats["dtype"] == "float32"
    assert stats["norm"] == pytest.approx(float(expected.norm()), rel=1e-6)
    assert not list(tmp_path.glob(".dump*"))  # no partial folder left


def test_tensor_stats_match_numpy_and_count_non_finite():
    values = np.array([[1.0, -3.0, np.nan], [2.0, np.inf, 0.5]], dtype=np.float32)
    stats = tensor_stats(values)
    finite = np.array([1.0, -3.0, 2.0, 0.5])
    assert (stats["nan"], stats["inf"], stats["numel"]) == (1, 1, 6)
    assert stats["mean"] == pytest.approx(finite.mean()) and stats["std"] == pytest.approx(finite.std())
    assert stats["abs_max"] == 3.0 and stats["norm"] == pytest.approx(np.linalg.norm(finite))
    assert stats["quantiles"]["0.5"] == pytest.approx(np.median(finite))


def test_mindspore_hooks_flatten_tuple_outputs_and_skip_none(tmp_path):
    import mindspore as ms
    from mindspore import nn

    class Pair(nn.Cell):
        def construct(self, x):
            return x * 2, None, (x + 1,)

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.pair = Pair()

        def construct(self, x):
            doubled, _, (plus,) = self.pair(x)
            return doubled + plus

    net = Net()
    install_mindspore_dump_hooks(net, tmp_path / "dump", save_tensors=False)
    net(ms.Tensor(np.ones((2, 2), np.float32)))
    dump = read_dump(tmp_path / "dump")
    (entry,) = dump.entries
    assert entry.key == "pair" and [o["mean"] for o in entry.outputs] == [2.0, 2.0]
    assert dump.tensor(entry, 0) is None  # statistics only


def test_read_dump_names_what_is_wrong(tmp_path):
    with pytest.raises(DumpError, match="index.json is missing"):
        read_dump(tmp_path)
    (tmp_path / "index.json").write_text(json.dumps({"format": "msprobe"}))
    with pytest.raises(DumpError, match="format is 'msprobe'"):
        read_dump(tmp_path)


def test_compare_arrays():
    a = np.array([1.0, -2.0, 4.0])
    assert compare_arrays(a, a) == (1.0, 0.0, 0.0)
    cosine, max_abs, max_rel = compare_arrays(a, a + np.array([0.0, 0.4, 0.0]))
    assert max_abs == pytest.approx(0.4) and max_rel == pytest.approx(0.1) and cosine < 1


# ---- module mapping -----------------------------------------------------------------------------------


def test_mapping_from_rules_pairs_renames_and_skips_what_differs():
    rules = [
        (["layers.0.input_layernorm.weight"], ["layers.0.self_attention.linear_qkv.layer_norm_weight"]),
        (["layers.0.self_attention.linear_qkv.weight"], ["layers.0.self_attention.linear_qkv.weight"]),
        (["mtp.0.transformer_layer.self_attention.linear_proj.weight"], ["mtp.0.inner.self_attention.out_proj.weight"]),
        (["layers.0.mlp.experts.weight1"], ["layers.0.mlp.experts.linear_fc1.weight0",
                                            "layers.0.mlp.experts.linear_fc1.weight1"]),
        (["layers.0.attn.a.weight", "layers.0.attn.b.weight"], ["layers.0.attn.ab.weight"]),
    ]
    mapping = module_mapping_from_rules(rules)
    assert mapping.pairs["layers.0.self_attention.linear_qkv"] == "layers.0.self_attention.linear_qkv"
    assert "layers.0.input_layernorm" not in mapping.pairs  # fused norm: no Megatron output of its own
    assert mapping.fused["layers.0.input_layernorm"] == "layers.0.self_attention.linear_qkv"
    assert mapping.pairs["mtp.0.transformer_layer.self_attention.linear_proj"] == "mtp.0.inner.self_attention.out_proj"
    assert mapping.pairs["mtp.0.transformer_layer"] == "mtp.0.inner"
    assert mapping.pairs["layers.0.mlp.experts"] == "layers.0.mlp.experts"
    assert "layers.0.attn.a" not in mapping.pairs and mapping.pairs["layers.0.attn"] == "layers.0.attn"
    with pytest.raises(MappingError, match="pairs with both"):
        module_mapping_from_rules(rules + [(["layers.0.mlp.experts.weight2"], ["layers.0.moe.experts.fc2.weight"])])


def test_mapping_of_the_real_rules_follows_the_core_version_and_fc1_layout():
    model = load_config("qwen35_dense").model
    old, new = module_mapping(model, "0.16.1"), module_mapping(model, "0.17.0")
    assert old.pairs["mtp.layers.0.transformer_layer.mlp"] == "mtp.layers.0.transformer_layer.mlp"
    assert new.pairs["mtp.layers.0.transformer_layer.mlp"] == "mtp.layers.0.mtp_model_layer.mlp"
    assert new.pairs["decoder.layers.0.self_attention.linear_proj"] == "decoder.layers.0.self_attention.out_proj"
    order = new.output_permutations["decoder.layers.7.mlp.linear_fc1"]
    ffn = model.ffn_hidden_size
    np.testing.assert_array_equal(order, np.concatenate([np.arange(0, 2 * ffn, 2), np.arange(1, 2 * ffn, 2)]))
    assert "decoder.layers.7.mlp.linear_fc2" not in new.output_permutations


def test_every_fault_has_a_known_cause():
    named = {fault for cause in KNOWN_CAUSES for fault in cause.faults}
    assert named == set(FAULTS) | set(LAYOUT_FAULTS)
    assert {fault for _, fault in EXPECTED} == set(FAULTS)
    assert {fault for _, fault, _, _ in LAYOUT_EXPECTED} == set(LAYOUT_FAULTS)


def test_a_fault_of_the_rank_files_is_a_cause_only_where_the_layout_can_have_it():
    model = load_config("qwen35_moe_tiny").model

    def faults(module, layout):
        return {fault for cause in explain(module, model, layout) for fault in cause.faults}

    in_proj, experts = "decoder.layers.0.self_attention.in_proj", "decoder.layers.0.mlp.experts"
    assert "in_proj_split_as_one_block" not in faults(in_proj, (1, 2, 2))
    assert "in_proj_split_as_one_block" in faults(in_proj, (2, 1, 1))
    assert "experts_not_renumbered" not in faults(experts, (2, 2, 1))
    assert "experts_not_renumbered" in faults(experts, (1, 1, 2))
    assert {"in_proj_split_as_one_block", "in_proj_wrong_order"} <= faults(in_proj, None)  # dumps of a run


def test_a_cause_is_offered_only_where_the_evidence_shows_it():
    """A conversion cause needs a weight that differs or a forward that diverges first where the module's weights
    were not proven equal; gradient-side causes need the backward or one gradient alone."""
    from crossalign.diagnose.causes import BACKWARD, FORWARD, GRADIENT, WEIGHT, Evidence

    model = load_config("qwen35_moe_tiny").model
    shared = "decoder.layers.0.mlp.shared_experts.linear_fc1"

    def causes(where, evidence):
        return explain(where, model, None, evidence)

    assert any("shared_fc1_not_deinterleaved" in c.faults for c in causes(shared, Evidence(WEIGHT)))
    assert any("shared_fc1_not_deinterleaved" in c.faults for c in causes(shared, Evidence(FORWARD)))
    assert not [c for c in causes(shared, Evidence(FORWARD, weights_agree=True)) if c.conversion]
    gradient = causes(shared + ".weight", Evidence(GRADIENT, weights_agree=True, parallel=True))
    assert gradient and not [c for c in gradient if c.conversion or c.faults]
    assert all(c.needs == "only a weight gradient diverges" for c in gradient)
    norm = "decoder.layers.1.pre_mlp_layernorm.weight"
    assert any("all-reduced" in c.cause for c in causes(norm, Evidence(GRADIENT, True, parallel=True)))
    assert not any("all-reduced" in c.cause for c in causes(norm, Evidence(GRADIENT, True, parallel=False)))
    backward = causes("decoder.layers.0.self_attention", Evidence(BACKWARD, True))
    assert any("GatedDeltaNet backward kernel" in c.cause for c in backward)
    assert not [c for c in backward if c.conversion]
    assert any("loss differs" in c.cause for c in causes("output_layer", Evidence(BACKWARD, True)))
    assert causes("output_layer", Evidence(WEIGHT))[0].needs == "a weight differs or the forward diverges first"


# ---- localisation of each fault ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """name -> (config, state, batch, MindSpore dump folder), each made once."""
    cache = {}

    def get(name):
        if name not in cache:
            config = load_config(name)
            state = random_mindformers_state(config.model, seed=11)
            batch = random_batch(config.model, SEQ, BATCH, seed=5)
            folder = dump_mindspore(config.model, state, batch, tmp_path_factory.mktemp(name) / "mindspore")
            cache[name] = config, state, batch, folder
        return cache[name]
    return get


def _applies(name, fault):
    config = load_config(name)
    try:
        inject_fault(conversion_plan(config.model), fault, config.model, config.training.megatron_core_version)
    except CheckpointError:
        return False
    return True


def test_expected_table_covers_every_applicable_fault():
    for name in ("qwen35_dense_tiny", "qwen35_moe_tiny"):
        assert {f for f in FAULTS if _applies(name, f)} == {f for n, f in EXPECTED if n == name}


@pytest.mark.parametrize("name", ["qwen35_dense_tiny", "qwen35_moe_tiny"])
def test_a_correct_conversion_shows_no_divergence(references, name, tmp_path):
    config, state, batch, ms_dump = references(name)
    converted = mindformers_to_megatron(state, config.model)
    mg_dump, problems = dump_megatron(config.model, converted, batch, tmp_path / "megatron", "0.16.1")
    diagnosis = compare_dump_folders(ms_dump, mg_dump, config.model, "0.16.1")
    assert problems == [] and not diagnosis.diverged, diagnosis.hint()
    compared = {row.megatron for row in diagnosis.rows}
    assert {"decoder.layers.0.self_attention", "decoder.layers.3.self_attention.linear_qkv", "output_layer#1",
            "mtp.layers.0.transformer_layer.mlp"} <= compared
    assert all(row.cosine > 1 - 1e-6 for row in diagnosis.rows)


@pytest.mark.parametrize("name, fault", sorted(EXPECTED))
def test_each_fault_is_localised_to_the_module_it_breaks(references, name, fault, tmp_path):
    config, state, batch, ms_dump = references(name)
    converted = mindformers_to_megatron(state, config.model, fault=fault)
    mg_dump, problems = dump_megatron(config.model, converted, batch, tmp_path / "megatron", "0.16.1")
    diagnosis = compare_dump_folders(ms_dump, mg_dump, config.model, "0.16.1", load_problems=problems)
    first = diagnosis.first_divergence
    assert first is not None
    assert first.megatron.startswith(EXPECTED[name, fault]), diagnosis.hint()
    assert fault in {f for cause in diagnosis.causes for f in cause.faults}, diagnosis.hint()
    if fault in ("a_log_not_renamed", "wrong_mtp_prefix"):
        assert problems and "missing keys" in problems[0]  # what Megatron's load_return would have said


def test_statistics_alone_still_localise_a_fault(references, tmp_path):
    config, state, batch, ms_dump = references("qwen35_moe_tiny")
    converted = mindformers_to_megatron(state, config.model, fault="routed_expert_not_transposed")
    mg_dump, _ = dump_megatron(config.model, converted, batch, tmp_path / "megatron", "0.16.1", save_tensors=False)
    diagnosis = compare_dump_folders(ms_dump, mg_dump, config.model, "0.16.1")
    assert diagnosis.first_divergence.megatron == "decoder.layers.0.mlp.experts"
    assert diagnosis.first_divergence.basis == "stats"


def test_cli_diagnose_a_run_folder_and_existing_dumps(references, tmp_path):
    from crossalign.store import RunStore

    config, state, batch, ms_dump = references("qwen35_dense_tiny")
    run = RunStore(tmp_path / "store").create_run("r1", config, config_source="test", parameters={},
                                                  code_version={})
    ms_ckpt = run.step_dir("cast-bf16") / "checkpoint"
    write_mindformers_checkpoint(ms_ckpt, 1, {k: v.to(torch.bfloat16) for k, v in state.items()}, None,
                                 default_common(1))
    convert_checkpoint(config.model, "ms2mg", ms_ckpt, run.step_dir("convert") / "checkpoint",
                       fault="dense_fc1_not_deinterleaved")
    runner = CliRunner()
    result = runner.invoke(app, ["diagnose", "--run", str(run.path), "--seq", str(SEQ), "--batch", "1",
                                 "--rows", "3"])
    assert result.exit_code == 1, result.output
    assert "decoder.layers.0.mlp.linear_fc1" in result.output and "de-interleaved" in result.output
    out = run.path / "diagnose"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["first_divergence"]["megatron"] == "decoder.layers.0.mlp.linear_fc1"
    assert "dense_fc1_not_deinterleaved" in summary["causes"][0]["faults"]
    assert "decoder.layers.0.mlp.linear_fc1" in (out / "diagnosis.csv").read_text()
    assert "class='first'" in (out / "diagnosis.html").read_text()

    # Existing dumps (as real runs would write them) of a correct conversion: no divergence, exit 0.
    mg_dump, _ = dump_megatron(config.model, mindformers_to_megatron(state, config.model), batch,
                               tmp_path / "megatron", "0.16.1")
    good = runner.invoke(app, ["diagnose", "--model", "qwen35_dense_tiny", "--mindspore-dump", str(ms_dump),
                               "--megatron-dump", str(mg_dump), "--out", str(tmp_path / "good")])
    assert good.exit_code == 0, good.output
    assert "no module diverges" in good.output

    missing = runner.invoke(app, ["diagnose", "--model", "qwen35_dense_tiny", "--mindspore-dump", str(ms_dump)])
    assert missing.exit_code == 2 and "go together" in missing.output


# ---- sharded checkpoints: faults only a layout shows ------------------------------------------------------------


@pytest.mark.parametrize("name, fault, layout, shows", LAYOUT_EXPECTED)
def test_a_fault_of_the_layout_is_named_at_the_module_it_breaks(name, fault, layout, shows, tmp_path):
    config = load_config(name)
    result = diagnose(config, None, None, tmp_path / "out", fault=fault, layout=layout, seq=16, batch=1)
    diagnosis = result.diagnosis
    assert diagnosis.first_divergence is not None and diagnosis.first_divergence.megatron.startswith(shows), \
        diagnosis.hint()
    assert diagnosis.causes[0].faults == (fault,), diagnosis.hint()
    assert diagnosis.layout == layout
    summary = json.loads(result.summary.read_text())
    assert summary["megatron_layout"] == dict(zip(("tp", "pp", "ep"), layout))
    if fault == "experts_not_renumbered":
        # EP rank 1 holds its experts under global numbers: Megatron's rank loads none, they stay at initial values.
        rank_1 = next(p for p in diagnosis.load_problems if p.startswith("mp_rank_00_001 "))
        assert "not loaded" in rank_1 and "decoder.layers.0.mlp.experts.linear_fc1.weight2" in rank_1
        assert "kept at their initial values: decoder.layers.0.mlp.experts.linear_fc1.weight0" in rank_1
        assert not any(p.startswith("mp_rank_00_000 ") for p in diagnosis.load_problems)
    else:
        assert diagnosis.load_problems == []


def test_cli_diagnose_converts_into_a_layout_and_names_the_layout_fault(tmp_path):
    runner = CliRunner()
    common = ["diagnose", "--model", "qwen35_moe_tiny", "--seq", "16", "--batch", "1", "--rows", "2"]
    clean = runner.invoke(app, [*common, "--tp", "2", "--ep", "2", "--out", str(tmp_path / "clean")])
    assert clean.exit_code == 0, clean.output
    assert "(tp, pp, ep) = (2, 1, 2)" in clean.output and "no module diverges" in clean.output

    faulty = runner.invoke(app, [*common, "--tp", "2", "--fault", "in_proj_split_as_one_block",
                                 "--out", str(tmp_path / "faulty")])
    assert faulty.exit_code == 1, faulty.output
    summary = json.loads((tmp_path / "faulty" / "summary.json").read_text())
    assert summary["first_divergence"]["megatron"] == "decoder.layers.0.self_attention.in_proj"
    assert summary["causes"][0]["faults"] == ["in_proj_split_as_one_block"]
    assert "TP contiguous row blocks" in faulty.output

    unknown = runner.invoke(app, [*common, "--fault", "no_such_fault"])
    assert unknown.exit_code == 2 and "in_proj_split_as_one_block" in unknown.output


def test_a_converted_checkpoint_must_hold_the_layout_asked_for(tmp_path):
    from crossalign.diagnose.selfcheck import make_checkpoints

    config = load_config("qwen35_moe_tiny")
    ms_ckpt, mg_ckpt = make_checkpoints(config, tmp_path, None, None, seed=3, layout=(1, 1, 2))
    with pytest.raises(SideError, match=r"holds \(tp, pp, ep\) = \(1, 1, 2\) ranks, not the \(2, 1, 2\) asked for"):
        diagnose(config, ms_ckpt, mg_ckpt, tmp_path / "out", layout=(2, 1, 2), seq=16, batch=1)
    assert not (tmp_path / "out").exists()  # refused before any forward ran


@pytest.mark.parametrize("etp", [1, 2])
def test_rank_files_that_do_not_fit_are_loaded_by_the_expert_tensor_size_they_were_written_with(etp, tmp_path):
    """TP 2 x EP 2 with the experts whole on each tensor rank (ETP 1, Megatron's expert layout ETP x EP x EDP) or
    split over both (ETP 2): EP rank 1's experts under their global numbers keep their initial values, EP rank 0's
    sound experts load as written, whichever ETP the files hold."""
    from crossalign.checkpoint.faults import inject_layout_fault
    from crossalign.diagnose.ranks import read_as_megatron_loads
    from crossalign.sides.megatron.checkpoint import iteration_dir_name

    config = load_config("qwen35_moe_tiny")
    model, version = config.model, config.training.megatron_core_version
    state = random_mindformers_state(model, 5)
    write_mindformers_checkpoint(tmp_path / "ms", 1, state, None, default_common(1, 1))
    report = convert_checkpoint(model, "ms2mg", tmp_path / "ms", tmp_path / "mg", core_version=version, dtype="fp32",
                                tp=2, ep=2, etp=etp)
    whole = mindformers_to_megatron(state, model, version)
    inject_layout_fault(tmp_path / "mg" / iteration_dir_name(report.iteration), "experts_not_renumbered", model, 2, 1, 2)
    for expert_tensor in (etp, None):  # given, or read off the files
        loaded = read_as_megatron_loads(tmp_path / "mg", model, version, expert_tensor=expert_tensor)
        local = model.num_experts // 2
        fc1 = "decoder.layers.0.mlp.experts.linear_fc1.weight"
        for e in range(local):  # EP rank 0: loaded as converted
            torch.testing.assert_close(loaded.state[f"{fc1}{e}"], whole[f"{fc1}{e}"], rtol=0, atol=0)
        for e in range(local, model.num_experts):  # EP rank 1: its files hold them under other names
            assert not torch.equal(loaded.state[f"{fc1}{e}"], whole[f"{fc1}{e}"])
        folders = sorted(problem.split(" ")[0] for problem in loaded.problems[1:])
        assert folders == ["mp_rank_00_001", "mp_rank_01_001"], loaded.problems
        assert all(f"not loaded (its part of the model has no such key): {fc1}{local}" in problem
                   for problem in loaded.problems[1:])
