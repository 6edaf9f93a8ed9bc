"""The mindformers-msprobe-dump patch: MindFormers' pynative trainer runs each step under msprobe's
PrecisionDebugger when the step asks for a dump (CROSSALIGN_MSPROBE_CONFIG), and nothing changes when it does not.

Here: the patch fits each supported release's real trainer.py (start right after on_step_begin, stop and step right
before the step count moves on); the backend writes msprobe's config.json and names it in the run script only for
a dump; and the patch's own code, run around steps of MindFormers 2.1.0's own pynative MLP on MindSpore's CPU
(tests/helpers/mindformers_msprobe_driver.py), makes msprobe write the configured step and no other.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from crossalign.diagnose.msprobe_dump import read_dump
from crossalign.config import load_config
from crossalign.dump_settings import (CONFIG_FILE, RECORD_FILE, RECORD_TEMPLATE, DumpRecord, DumpSettings,
                                         write_msprobe_config)
from crossalign.patching import apply_patch, check_patch, load_patch
from crossalign.sides.mindformers.backend import MindFormersBackend
from helpers.mindformers_backend import FIXTURES, request_for, site_for
from helpers.mindformers_upstream import STUB, TIMEOUT_S, generated, unpacked

TRAINER = "mindformers/pynative/trainer/trainer.py"
DRIVER = Path(__file__).resolve().parent / "helpers" / "mindformers_msprobe_driver.py"
REPO = Path(__file__).resolve().parents[1]


def patched_trainer(version: str, root: Path) -> Path:
    target = root / TRAINER
    target.parent.mkdir(parents=True)
    shutil.copy(unpacked(version) / TRAINER, target)
    patch = load_patch("mindformers-msprobe-dump")
    assert check_patch(patch, root).status == "applicable"
    report = apply_patch(patch, root)
    assert report.status == "applied", report.detail
    return target


@pytest.mark.parametrize("version", ["2.0.0", "2.1.0"])
def test_the_patch_runs_each_step_of_the_training_loop_under_msprobe(version, tmp_path):
    path = patched_trainer(version, tmp_path)
    text = path.read_text()
    assert apply_patch(load_patch("mindformers-msprobe-dump"), tmp_path).status == "applied"
    assert path.read_text() == text  # a second apply changes nothing
    trainer = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    methods = {n.name: n for n in trainer.body if isinstance(n, ast.FunctionDef)}
    assert {"_crossalign_msprobe_begin", "_crossalign_msprobe_end"} <= set(methods)
    loop = ast.get_source_segment(text, methods["_inner_train_loop"])
    begin, end = loop.index("self._crossalign_msprobe_begin()"), loop.index("self._crossalign_msprobe_end()")
    assert loop.index("on_step_begin(self.config, self.state)") < begin < loop.index("self.training_step(") < end
    assert end < loop.index("self.state.global_step += 1") < loop.index("on_step_end(")
    assert loop.count("_crossalign_msprobe_begin") == loop.count("_crossalign_msprobe_end") == 1


def test_the_patch_claims_the_releases_the_backend_supports():
    patch = load_patch("mindformers-msprobe-dump")
    assert patch.needed_from == (2, 0, 0) and not patch.optional


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_backend_asks_for_the_dump_only_when_the_step_dumps(tmp_path):
    checkout = tmp_path / "mindformers-checkout"
    shutil.copytree(FIXTURES / "mindformers_tree", checkout)
    for name in ("mindformers-load-digest", "mindformers-msprobe-dump"):
        apply_patch(load_patch(name), checkout)
    request = request_for(tmp_path, "align", [])
    request.dump = DumpSettings(step=1, level="mix", task="md5")
    MindFormersBackend(site=site_for(checkout)).train(request)
    script = (request.output_dir / "run_mindformers.sh").read_text()
    assert f"export CROSSALIGN_MSPROBE_CONFIG={request.output_dir.absolute() / CONFIG_FILE}" in script
    assert f"export CROSSALIGN_MSPROBE_RECORD={request.output_dir.absolute() / RECORD_TEMPLATE}" in script
    assert "cannot import msprobe.mindspore" in script  # checked with the framework's Python before training
    config = json.loads((request.output_dir / CONFIG_FILE).read_text())
    assert (config["step"], config["level"], config["statistics"]["summary_mode"]) == ([1], "mix", "md5")
    assert config["dump_path"] == str(request.output_dir.absolute() / "msprobe_dump")
    plain = request_for(tmp_path / "plain", "align", [])
    MindFormersBackend(site=site_for(checkout)).train(plain)
    assert "msprobe" not in (plain.output_dir / "run_mindformers.sh").read_text()
    assert not (plain.output_dir / CONFIG_FILE).exists()


@pytest.mark.slow
def test_the_patched_trainer_dumps_the_configured_step_of_mindformers_own_module(tmp_path):
    """Two steps of MindFormers 2.1.0's pynative MLP under the patch's own code, msprobe configured for step 1:
    msprobe writes step1 only, with the MLP's cells forward and backward and their real statistics."""
    version = "2.1.0"
    tree = unpacked(version)
    trainer = patched_trainer(version, tmp_path / "patched")
    record = DumpRecord.of(load_config("qwen35_dense_tiny"), "mindformers", "r-3", 1)
    config = write_msprobe_config(DumpSettings(step=1), tmp_path / "step", iterations=2, record=record)
    job, result = tmp_path / "job.json", tmp_path / "result.json"
    job.write_text(json.dumps({"trainer": str(trainer), "yaml": generated(tmp_path, "qwen35_dense_tiny"),
                               "config": str(config), "record": str(config.parent / RECORD_TEMPLATE), "steps": 2,
                               "result": str(result), "log": str(tmp_path / "convert.log")}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(STUB), str(REPO)]),
           "LOG_MF_PATH": str(tmp_path / "mf_log"), "GLOG_v": "3"}
    done = subprocess.run([sys.executable, str(DRIVER), str(job)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    root = tmp_path / "step" / "msprobe_dump"
    assert [p.name for p in root.iterdir()] == ["step1"]
    dump = read_dump(root)
    (rank,) = dump.ranks.values()  # one process without communication: msprobe's proc{pid}
    assert (dump.framework, dump.step, rank.level, rank.mode) == ("mindspore", 1, "L0", "statistics")
    entries = rank.entries
    assert {"Cell.linear_fc1.Linear.forward.0", "Cell.linear_fc2.Linear.forward.0",
            "Cell.linear_fc1.Linear.backward.0"} <= set(entries)
    weight = entries["Cell.linear_fc1.Linear.forward.0"].parameters["weight"]
    assert weight.stats["Norm"] == pytest.approx(json.loads(result.read_text())["fc1_norm"], rel=1e-5)
    # beside msprobe's files (its proc{pid} folder: no communication group), the patch's record of the run
    assert DumpRecord.model_validate_json((rank.path / RECORD_FILE).read_text()) == record.model_copy(
        update={"rank": 0})


SYSTEM_PYTHON = Path("/usr/bin/python3")


def _lacks_msprobe(python: Path) -> bool:
    return python.exists() and subprocess.run([str(python), "-c", "import msprobe"], capture_output=True).returncode != 0


@pytest.mark.timeout(60)
@pytest.mark.skipif(not _lacks_msprobe(SYSTEM_PYTHON), reason=f"needs a Python without msprobe ({SYSTEM_PYTHON})")
def test_a_framework_python_without_msprobe_stops_the_dump_before_training(tmp_path):
    from crossalign.sides.launch import BackendRunError
    from crossalign.site import MindFormersSite, SiteConfig

    checkout = tmp_path / "mindformers-checkout"
    shutil.copytree(FIXTURES / "mindformers_tree", checkout)
    request = request_for(tmp_path, "align", [])
    request.dump = DumpSettings()
    site = SiteConfig(mindformers=MindFormersSite(path=checkout, python=str(SYSTEM_PYTHON), nproc_per_node=1))
    with pytest.raises(BackendRunError, match=rf"{SYSTEM_PYTHON} cannot import msprobe.mindspore .*mindstudio-probe"):
        MindFormersBackend(site=site).train(request)
