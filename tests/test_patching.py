"""Framework patches: check states, idempotent apply, conflicts named, version ranges, CLI."""

from __future__ import annotations

import ast
import importlib.util
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from crossalign.cli import app
from crossalign.patching import PatchError, apply_patch, check_patch, load_patch, load_patches
from crossalign.versions import version_tuple

FIXTURES = Path(__file__).parent / "fixtures"
QWEN35_CLASSES = ("PyNativeQwen35ForCausalLM", "PyNativeQwen35MoeForCausalLM")  # the fixture fork's classes
# the installed megatron-core's version file, found without importing megatron.core (slow, noisy)
INSTALLED_PACKAGE_INFO = Path(importlib.util.find_spec("megatron").submodule_search_locations[0]) / "core" / "package_info.py"


@pytest.fixture
def megatron_tree(tmp_path: Path) -> Path:
    """The fixture tree plus the real megatron/core/package_info.py of the installed megatron-core."""
    root = tmp_path / "Megatron-LM"
    shutil.copytree(FIXTURES / "megatron_tree", root)
    (root / "megatron" / "core").mkdir(parents=True)
    shutil.copy(INSTALLED_PACKAGE_INFO, root / "megatron" / "core" / "package_info.py")
    return root


@pytest.fixture
def mindformers_tree(tmp_path: Path) -> Path:
    root = tmp_path / "mindformers-checkout"
    shutil.copytree(FIXTURES / "mindformers_tree", root)
    return root


def set_minor(root: Path, minor: int) -> None:
    info = root / "megatron" / "core" / "package_info.py"
    info.write_text(re.sub(r"^MINOR = \d+", f"MINOR = {minor}", info.read_text(), flags=re.MULTILINE))


def load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shipped_patches_parse_with_their_version_ranges():
    names = {p.name for p in load_patches()}
    assert names == {"megatron-mtp-gdn", "megatron-weights-only", "mindformers-qwen35-loss-logging",
                     "mindformers-load-digest", "mindformers-msprobe-dump"}
    mtp = load_patch("megatron-mtp-gdn")
    assert (mtp.needed_from, mtp.needed_before) == ((0, 16, 0), (0, 19, 0))
    assert mtp.needed_for((0, 16, 1)) and mtp.needed_for((0, 18, 2))
    assert not mtp.needed_for((0, 15, 3)) and not mtp.needed_for((0, 19, 0))
    assert load_patch("megatron-weights-only").optional
    assert version_tuple("0.17.0rc0") == (0, 17, 0)
    with pytest.raises(PatchError, match="no patch named"):
        load_patch("nope")


def test_mtp_gdn_patch_changes_which_layer_the_mtp_block_gets(megatron_tree: Path):
    patch = load_patch("megatron-mtp-gdn")
    args = SimpleNamespace(block_spec=SimpleNamespace(layer_specs=["gdn", "gdn", "gdn", "attention"]),
                           standard_layer_specs=["standard"], single_layer_spec="single",
                           mtp_num_layers=1, experimental_attention_variant="gated_delta_net")
    before = load_module(megatron_tree / "gpt_builders.py", "builders_before")
    assert before.gpt_builder(args, True, True)[1] == ("mtp", "standard")

    report = check_patch(patch, megatron_tree)
    assert report.status == "applicable" and report.version == (0, 16, 1)
    assert apply_patch(patch, megatron_tree).status == "applied"

    after = load_module(megatron_tree / "gpt_builders.py", "builders_after")
    assert after.gpt_builder(args, True, True)[1] == ("mtp", "attention")
    args.experimental_attention_variant = None
    assert after.gpt_builder(args, True, True)[1] == ("mtp", "standard")


def test_apply_twice_is_a_noop(megatron_tree: Path, mindformers_tree: Path):
    for patch, root, path in ((load_patch("megatron-mtp-gdn"), megatron_tree, megatron_tree / "gpt_builders.py"),
                              (load_patch("mindformers-qwen35-loss-logging"), mindformers_tree,
                               mindformers_tree / "mindformers/models/qwen3_5/modeling_qwen3_5_train_pynative.py")):
        apply_patch(patch, root, QWEN35_CLASSES)
        text, mtime = path.read_text(), path.stat().st_mtime_ns
        report = apply_patch(patch, root, QWEN35_CLASSES)
        assert report.status == "applied"
        assert path.read_text() == text and path.stat().st_mtime_ns == mtime


def test_weights_only_patch_touches_only_the_legacy_loader(megatron_tree: Path):
    path = megatron_tree / "megatron/training/checkpointing.py"
    apply_patch(load_patch("megatron-weights-only"), megatron_tree)
    tree = ast.parse(path.read_text())
    calls = {f.name: [ast.unparse(c) for c in ast.walk(f) if isinstance(c, ast.Call) and ast.unparse(c.func) == "torch.load"]
             for f in tree.body if isinstance(f, ast.FunctionDef)}
    assert calls["_load_base_checkpoint"] == ["torch.load(checkpoint_name, map_location='cpu', weights_only=False)"] * 2
    assert calls["load_unrelated_checkpoint"] == ["torch.load(checkpoint_name, map_location='cpu')"]


def test_conflict_names_file_and_edit_and_writes_nothing(megatron_tree: Path):
    path = megatron_tree / "gpt_builders.py"
    path.write_text(path.read_text().replace("decoder_layer_specs[-1]", "decoder_layer_specs[-2]"))
    original = path.read_text()
    report = check_patch(load_patch("megatron-mtp-gdn"), megatron_tree)
    assert report.status == "conflict"
    assert "gpt_builders.py, edit 1 (in gpt_builder)" in report.detail
    with pytest.raises(PatchError, match=r"gpt_builders.py, edit 1 \(in gpt_builder\).*transformer_layer_spec_for_mtp"):
        apply_patch(load_patch("megatron-mtp-gdn"), megatron_tree)
    assert path.read_text() == original


def test_too_many_occurrences_is_a_conflict(megatron_tree: Path):
    path = megatron_tree / "megatron/training/checkpointing.py"
    line = "        state_dict = torch.load(checkpoint_name, map_location='cpu')\n"
    path.write_text(path.read_text().replace("    return state_dict\n", line + "    return state_dict\n", 1))
    report = check_patch(load_patch("megatron-weights-only"), megatron_tree)
    assert report.status == "conflict" and "expected 1..2 occurrences" in report.detail


@pytest.mark.parametrize("minor", [15, 19])
def test_versions_outside_the_range_do_not_need_the_mtp_patch(megatron_tree: Path, minor: int):
    set_minor(megatron_tree, minor)
    before = (megatron_tree / "gpt_builders.py").read_text()
    report = apply_patch(load_patch("megatron-mtp-gdn"), megatron_tree)
    assert report.status == "not-needed" and f"0.{minor}." in report.detail
    assert (megatron_tree / "gpt_builders.py").read_text() == before


def test_loss_logging_patch_adds_the_methods_loss_callback_calls(mindformers_tree: Path):
    # LossCallback calls these on the top model (loss_callback.py, r2.0.0 lines 160-201)
    patch = load_patch("mindformers-qwen35-loss-logging")
    report = check_patch(patch, mindformers_tree, QWEN35_CLASSES)
    assert report.status == "applicable"
    assert "PyNativeQwen35ForCausalLM" in report.detail and "PyNativeQwen35MoeForCausalLM" in report.detail
    other = (mindformers_tree / "mindformers/models/other/modeling_other.py").read_text()
    apply_patch(patch, mindformers_tree, QWEN35_CLASSES)
    module = load_module(mindformers_tree / "mindformers/models/qwen3_5/modeling_qwen3_5_train_pynative.py", "qwen35")
    dense, moe = module.PyNativeQwen35ForCausalLM(), module.PyNativeQwen35MoeForCausalLM()
    assert dense.get_mtp_loss("group", 2) == [3.0]
    assert moe.get_load_balancing_loss("group", 2, "pp", 1, has_last=True) == 1.25
    assert dense.get_load_balancing_loss("group", 2, "pp", 1, has_last=True) is None  # dense: no aux loss
    moe.reset_model_temporary_tensors()
    assert moe.model.resets == 1
    for method in ("get_mtp_loss", "get_load_balancing_loss", "reset_model_temporary_tensors"):
        assert method in vars(module.PyNativeQwen35MoeForCausalLM), method
    assert (mindformers_tree / "mindformers/models/other/modeling_other.py").read_text() == other


def test_loss_logging_patch_targets_only_the_classes_the_site_names(mindformers_tree: Path):
    patch = load_patch("mindformers-qwen35-loss-logging")
    with pytest.raises(PatchError, match="targets the Qwen3.5 model classes of your MindFormers fork.*"
                                         "mindformers.qwen35_class"):
        check_patch(patch, mindformers_tree)
    apply_patch(patch, mindformers_tree, ["PyNativeQwen35MoeForCausalLM"])
    module = load_module(mindformers_tree / "mindformers/models/qwen3_5/modeling_qwen3_5_train_pynative.py", "only")
    assert "get_mtp_loss" in vars(module.PyNativeQwen35MoeForCausalLM)
    assert "get_mtp_loss" not in vars(module.PyNativeQwen35ForCausalLM)
    shutil.rmtree(mindformers_tree / "mindformers/models/qwen3_5")
    report = check_patch(patch, mindformers_tree, QWEN35_CLASSES)
    assert report.status == "conflict" and "no class matching" in report.detail


def test_npu_probe_says_when_the_checkout_has_no_qwen35_model(mindformers_tree: Path, monkeypatch):
    from crossalign.agents.probe import probe_pool
    from crossalign.site import SiteConfig

    monkeypatch.setenv("ASCEND_HOME_PATH", str(mindformers_tree))

    def probe(**mindformers):
        site = SiteConfig.model_validate({"backends": {"npu": "mindformers"}, "mindformers": {
            "path": str(mindformers_tree), "python": "/opt/none/python", **mindformers}})
        return {c.name: c for c in probe_pool("npu", site)}

    unset = probe()["MindFormers Qwen3.5 model"]
    assert not unset.ok and "mindformers.qwen35_class is not set" in unset.detail
    wrong = probe(qwen35_class="PyNativeQwen3ForCausalLM")
    assert not wrong["MindFormers Qwen3.5 model"].ok
    assert wrong["MindFormers Qwen3.5 model"].detail.startswith("this MindFormers checkout has no Qwen3.5 model: "
                                                                "no class PyNativeQwen3ForCausalLM")
    assert not [name for name in wrong if name.startswith("patch ")]  # no patch conflict on top of it
    fork = probe(qwen35_class="PyNativeQwen35ForCausalLM", qwen35_moe_class="PyNativeQwen35MoeForCausalLM")
    assert fork["MindFormers Qwen3.5 model"].ok
    assert fork["patch mindformers-qwen35-loss-logging"].ok  # applied by the probe
    assert fork["patch mindformers-qwen35-loss-logging"].detail.startswith("applied")


def test_cli_check_and_apply(megatron_tree: Path, mindformers_tree: Path):
    runner = CliRunner()
    classes = [arg for name in QWEN35_CLASSES for arg in ("--qwen35-class", name)]
    result = runner.invoke(app, ["patch", "check", "--megatron", str(megatron_tree), "--mindformers", str(mindformers_tree),
                                 *classes], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert result.output.count("applicable") == 5
    result = runner.invoke(app, ["patch", "check", "--mindformers", str(mindformers_tree)], env={"COLUMNS": "250"})
    assert result.exit_code == 2 and "mindformers.qwen35_class" in result.output
    result = runner.invoke(app, ["patch", "apply", "--megatron", str(megatron_tree), "--mindformers", str(mindformers_tree),
                                 *classes], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert check_patch(load_patch("megatron-mtp-gdn"), megatron_tree).status == "applied"
    assert check_patch(load_patch("megatron-weights-only"), megatron_tree).status == "applicable"  # optional: opt-in
    result = runner.invoke(app, ["patch", "apply", "--megatron", str(megatron_tree), "--patch", "megatron-weights-only"])
    assert result.exit_code == 0, result.output
    assert check_patch(load_patch("megatron-weights-only"), megatron_tree).status == "applied"

    (megatron_tree / "gpt_builders.py").write_text("def gpt_builder(args):\n    return None\n")
    result = runner.invoke(app, ["patch", "check", "--megatron", str(megatron_tree)], env={"COLUMNS": "250"})
    assert result.exit_code == 1 and "conflict" in result.output
