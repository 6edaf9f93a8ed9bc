"""A run started from Hugging Face weights: step 1 imports them on the cpu pool, the run store records the start,
and an embedded `crossalign run --from-hf` passes with everything downstream unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers.hf_tiny import make_hf_checkpoint

from crossalign.checkpoint.hf import read_hf_checkpoint
from crossalign.sides.mindformers.checkpoint import read_mindformers_checkpoint
from crossalign.config import load_config
from crossalign.flows.launch import deployment_name
from crossalign.request import hf_start
from crossalign.store import RunStore, StoreError
from crossalign.tasks.prepare import code_version

REPO = Path(__file__).resolve().parent.parent
CROSSALIGN = str(Path(sys.executable).with_name("crossalign"))
TINY = ["--set", "training.train_iters=20", "--set", "training.lr_warmup_iters=2", "--set", "training.seq_length=32",
        "--set", "training.global_batch_size=2",
        "--set", "training.micro_batch_size=2"]


@pytest.fixture(scope="module")
def hf_dense(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("hf") / "dense", "dense")


def test_the_start_is_recorded_and_routes_step_1_to_the_cpu_pool(hf_dense, tmp_path):
    store, config = RunStore(tmp_path / "store"), load_config("qwen35_dense_tiny")
    start = hf_start(hf_dense)
    run = store.create_run("r1", config, config_source="x", parameters={}, code_version=code_version(), start=start)
    assert run.start == start and start["path"] == str(hf_dense.absolute())
    assert run.pool("base-train") == "cpu" and run.pool("pynative-train") == "npu"
    assert run.spec("base-train").function == "crossalign.tasks.import_hf:import_hf"
    assert deployment_name(run.spec("base-train")) == "step/import-hf"
    plain = store.create_run("r2", config, config_source="x", parameters={}, code_version=code_version())
    assert plain.start == {"from": "base-train"} and deployment_name(plain.spec("base-train")) == "step/base-train"
    with pytest.raises(StoreError, match="was started from"):
        store.create_run("r2", config, config_source="x", parameters={}, code_version=code_version(), start=start)
    deployments = {(entry["entrypoint"], entry["name"]): entry
                   for entry in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]}
    entry = deployments[("crossalign.flows.steps:step_flow", "import-hf")]
    assert entry["work_pool"]["name"] == "cpu" and entry["parameters"] == {"step": "base-train"}
    with pytest.raises(StoreError, match="no config.json"):
        hf_start(tmp_path)


@pytest.mark.slow
def test_embedded_run_from_hf_weights_passes(hf_dense, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1",
               CROSSALIGN_SITE=str(tmp_path / "no-site.yaml"))
    (tmp_path / "no-site.yaml").write_text("{}\n")
    store = tmp_path / "store"
    result = subprocess.run([CROSSALIGN, "run", "qwen35_dense_tiny", "--from-hf", str(hf_dense), "--store", str(store),
                             "--run-id", "from-hf", *TINY], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    run = RunStore(store).run("from-hf")
    assert run.start["from"] == "huggingface"
    assert json.loads((run.step_dir("compare") / "summary.json").read_text())["verdict"] == "pass"
    details = run.manifest("base-train")["details"]
    assert details["start"] == "huggingface" and details["iteration"] == 0
    # step 2 casts the imported plain gammas 1 + w (computed in fp32) to bf16
    hf_norm = read_hf_checkpoint(hf_dense).tensor("model.norm.weight")
    cast = read_mindformers_checkpoint(run.step_dir("cast-bf16") / "checkpoint").model_state()
    assert torch.equal(cast["decoder.final_layernorm.weight"], (hf_norm.float() + 1).bfloat16())
