"""The conversion self-check: a correct conversion passes at fp32 parity, every known fault is caught.

The MindSpore reference output is computed once per config (MindSpore pynative is the slow
part); each fault then needs one PyTorch forward.
"""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from crossalign.checkpoint.convert import convert_checkpoint, mindformers_to_megatron
from crossalign.tensorio.errors import CheckpointError
from crossalign.checkpoint.faults import FAULTS, inject_fault
from crossalign.models.layout import random_mindformers_state
from crossalign.sides.mindformers.checkpoint import default_common, write_mindformers_checkpoint
from crossalign.checkpoint.rules import conversion_plan
from crossalign.cli import app
from crossalign.config import load_config
from crossalign.diagnose.references import (SideError, build_megatron, build_mindspore, random_batch, run_megatron,
                                       run_mindspore)
from crossalign.diagnose.selfcheck import IMPLEMENTATIONS, compare_outputs, selfcheck

SEQ, BATCH = 32, 1
CONFIGS = ("qwen35_dense_tiny", "qwen35_moe_tiny")
# faults the strict load must catch, with a key it must name
KEY_FAULTS = {"a_log_not_renamed": "self_attention.A_log", "wrong_mtp_prefix": "mtp.layers.0.transformer_layer."}


def applicable_faults(name):
    """The faults that break some rule of this config (e.g. no routed experts in a dense model)."""
    config = load_config(name)
    plan = conversion_plan(config.model)
    found = []
    for fault in FAULTS:
        try:
            inject_fault(plan, fault, config.model, config.training.megatron_core_version)
        except CheckpointError:
            continue
        found.append(fault)
    return found


CASES = [(name, fault) for name in CONFIGS for fault in [None, *applicable_faults(name)]]


@pytest.fixture(scope="module")
def references():
    """name -> (config, MindFormers state, batch, MindSpore outputs), each computed once."""
    cache = {}

    def get(name):
        if name not in cache:
            config = load_config(name)
            state = random_mindformers_state(config.model, seed=7)
            batch = random_batch(config.model, SEQ, BATCH, seed=3)
            cache[name] = config, state, batch, run_mindspore(build_mindspore(config.model, state), batch)
        return cache[name]
    return get


def test_every_fault_applies_to_some_tiny_config():
    assert {fault for _, fault in CASES if fault} == set(FAULTS)


@pytest.mark.parametrize("name, fault", CASES)
def test_each_fault_is_caught_and_a_correct_conversion_passes(references, name, fault):
    config, state, batch, ms_out = references(name)
    converted = mindformers_to_megatron(state, config.model, fault=fault)
    core = config.training.megatron_core_version
    if fault in KEY_FAULTS:
        with pytest.raises(SideError, match="Megatron load") as caught:
            build_megatron(config.model, converted, core, strict=True)
        assert KEY_FAULTS[fault] in str(caught.value)
        return
    net, problems = build_megatron(config.model, converted, core, strict=True)
    assert problems == []
    checks = {c.name: c for c in compare_outputs(ms_out, run_megatron(net, batch))}
    if fault is None:
        assert all(c.passed for c in checks.values()), [c for c in checks.values() if not c.passed]
        assert checks["lm loss"].max_rel <= 1e-5 and checks["mtp_1 loss"].max_rel <= 1e-5
    else:
        failed = [name for name, c in checks.items() if not c.passed]
        assert "logits" in failed and "lm loss" in failed, (fault, checks)


def test_selfcheck_converts_a_random_model_and_passes():
    report = selfcheck("qwen35_dense_tiny", seq=SEQ, batch=BATCH)
    assert report.passed, report.failures()
    assert [r.name for r in report.implementations] == [i.name for i in IMPLEMENTATIONS]
    assert len(report.pairs) == len(IMPLEMENTATIONS) * (len(IMPLEMENTATIONS) - 1) // 2
    for pair in report.pairs:
        by_name = {c.name: c for c in pair.checks}
        assert set(by_name) == {"logits", "lm loss", "mtp_1 loss", "aux loss"}
        assert by_name["lm loss"].max_rel <= 1e-5 and by_name["mtp_1 loss"].max_rel <= 1e-5, pair.name
        assert by_name["aux loss"].reference == 0.0
    assert report.odd_one_out() is None


def test_selfcheck_with_a_fault_names_the_failing_outputs():
    report = selfcheck("qwen35_moe_tiny", seq=SEQ, batch=BATCH, fault="routed_expert_not_transposed")
    assert not report.passed and not report.load_errors
    failed = {line.split(": ")[1] for line in report.failures() if line.startswith("MindSpore vs PyTorch")}
    assert {"logits", "lm loss", "mtp_1 loss"} <= failed


def _checkpoints(tmp_path: Path, name: str, fault=None):
    config = load_config(name)
    state = random_mindformers_state(config.model, seed=1)
    ms = tmp_path / "ms"
    write_mindformers_checkpoint(ms, 1, state, None, default_common(1))
    convert_checkpoint(config.model, "ms2mg", ms, tmp_path / "mg", fault=fault)
    return ms, tmp_path / "mg"


def test_cli_exit_status(tmp_path):
    runner = CliRunner()
    ms, mg = _checkpoints(tmp_path, "qwen35_dense_tiny", fault="a_log_not_renamed")
    failed = runner.invoke(app, ["selfcheck", "--model", "qwen35_dense_tiny", "--input", str(ms), "--converted",
                                 str(mg), "--seq", str(SEQ), "--batch", "1"])
    assert failed.exit_code == 1, failed.output
    assert "does not load strictly" in failed.output and "decoder.layers.0.self_attention.A_log" in failed.output

    usage = runner.invoke(app, ["selfcheck", "--model", "qwen35_dense_tiny", "--converted", str(mg)])
    assert usage.exit_code == 2 and "--input" in usage.output

    wrong_model = runner.invoke(app, ["selfcheck", "--model", "qwen35_moe_tiny", "--input", str(ms), "--converted",
                                      str(mg), "--seq", str(SEQ), "--batch", "1"])
    assert wrong_model.exit_code == 2 and "mlp.experts.weight1" in wrong_model.output


def _report(names, agreeing, load_errors=()):
    """A report over ``names`` where exactly the pairs in ``agreeing`` passed."""
    from crossalign.diagnose.selfcheck import ImplementationResult, OutputCheck, PairCheck, SelfcheckReport

    report = SelfcheckReport("m", (1, 1), "b", "ms", "mg", None)
    report.implementations = [ImplementationResult(n, "megatron", load_error="missing x" if n in load_errors else None)
                              for n in names]
    loaded = [n for n in names if n not in load_errors]
    for i, a in enumerate(loaded):
        for b in loaded[i + 1:]:
            passed = {a, b} in [set(pair) for pair in agreeing]
            report.pairs.append(PairCheck(a, b, [OutputCheck("lm loss", 1.0, 1.0, 0.0, 0.0, None, passed, "")]))
    return report


def test_the_odd_one_out_is_the_one_that_disagrees_with_all_others_that_agree():
    three = ["MindSpore", "PyTorch", "megatron-core"]
    assert _report(three, [("PyTorch", "megatron-core")]).odd_one_out() == "MindSpore"
    assert _report(three, [("MindSpore", "PyTorch")]).odd_one_out() == "megatron-core"
    assert _report(three, []).odd_one_out() is None  # nobody agrees: no single culprit
    assert _report(three, [("MindSpore", "PyTorch"), ("PyTorch", "megatron-core")]).odd_one_out() is None
    assert _report(three, [("MindSpore", "PyTorch")], load_errors=("megatron-core",)).odd_one_out() == "megatron-core"
    assert _report(three[:2], []).odd_one_out() is None  # two that differ: either may be wrong
    four = three + ["transformers"]
    agreeing = [("MindSpore", "PyTorch"), ("MindSpore", "transformers"), ("PyTorch", "transformers")]
    assert _report(four, agreeing).odd_one_out() == "megatron-core"
