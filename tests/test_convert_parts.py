"""The torch_dist convert step spread over the cpu pool.

The step function finishes the parts it finds in the run's parts folder (written by the part
function, in any order) and converts alone without them, into the same checkpoint. End to end: a
real Prefect server, prefect.yaml's deployments, two workers of the cpu pool started by
``crossalign agent start`` (separate processes sharing the run store); the convert step's flow run
starts the parts (``convert-part`` flow runs, a range of layers each), which run at the same time on
the pool's workers and write their own data files; then it writes the index and commits the
checkpoint, which holds the same tensors, index and chunks as the one-process conversion.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from crossalign.agents.server import stop_process
from crossalign.store import RunStore

REPO = Path(__file__).resolve().parent.parent
CROSSALIGN = str(Path(sys.executable).with_name("crossalign"))
OVERRIDES = ["training.megatron_ckpt_format=torch_dist", "training.base_train_iters=2", "training.train_iters=3",
             "training.lr_warmup_iters=1", "training.seq_length=32", "training.global_batch_size=2",
             "training.micro_batch_size=2"]


def _index_and_tensors(folder: Path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    index = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    tensors = {}
    for key, entry in index.items():
        if isinstance(entry, TensorStorageMetadata):
            tensors[key] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
            dcp.load({key: tensors[key]}, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
    return index, tensors


def _run_with_a_bf16_checkpoint(store: Path):
    """A torch_dist run whose steps 1 and 2 are committed with a real bf16 MindFormers checkpoint (the convert step's
    input), through the store's own commits."""
    from crossalign.models.layout import random_mindformers_state
    from crossalign.request import RunRequest
    from crossalign.sides.mindformers.checkpoint import default_common, write_mindformers_checkpoint
    from crossalign.tasks.prepare import prepare_run

    run = prepare_run(RunRequest(config="qwen35_moe_tiny", run_id="parts", store=str(store), mode="embedded",
                                 overrides=OVERRIDES).resolve())
    state = {key: value.bfloat16() for key, value in random_mindformers_state(run.config.model, seed=5).items()}
    for step in ("base-train", "cast-bf16"):
        with run.commit(step, command="written by the test") as out:
            write_mindformers_checkpoint(out.dir / "checkpoint", 2, state, None, default_common(2, 2))
    return run


def test_the_step_finishes_parts_it_finds_and_converts_alone_without_them(tmp_path):
    from crossalign.site import SiteConfig
    from crossalign.tasks.convert import convert, convert_part, parts_dir

    run = _run_with_a_bf16_checkpoint(tmp_path / "store")
    spec, site = run.spec("convert"), SiteConfig(store=tmp_path / "store", convert_parts=2)
    alone = convert(run, spec, site)  # no parts written: the whole conversion in the step's process
    assert "parts" not in alone["details"] and alone["details"]["format"] == "torch_dist"
    one_process = _index_and_tensors(next((run.step_dir("convert") / "checkpoint").glob("iter_*")))
    run.invalidate("convert")
    for part in (1, 0):
        convert_part(run, spec, part, 2)
    assert sorted(p.name for p in parts_dir(run, spec).glob("iter_*/*")) == [
        "__0.metadata", "__0_0.distcp", "__1.metadata", "__1_0.distcp"]
    finished = convert(run, spec, site)
    assert finished["details"]["parts"] == 2 and not parts_dir(run, spec).exists()
    folder = next((run.step_dir("convert") / "checkpoint").glob("iter_*"))
    assert sorted(p.name for p in folder.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    (index, tensors), (one_index, one_tensors) = _index_and_tensors(folder), one_process
    assert index == one_index and all(torch.equal(tensors[key], one_tensors[key]) for key in one_tensors)


@pytest.mark.slow
def test_the_convert_step_writes_its_parts_at_the_same_time_on_two_cpu_workers(prefect_server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from crossalign.checkpoint.convert import convert_checkpoint
    from crossalign.flows.launch import execute_deployment
    from crossalign.flows.reporting import StepReporter
    from crossalign.request import RunRequest
    from crossalign.tasks.prepare import prepare_run

    store = tmp_path / "store"
    store.mkdir()
    site = tmp_path / "site.yaml"
    site.write_text(f"store: {store}\nbackends: {{npu: local, gpu: local}}\nconvert_parts: 2\n")
    env = {**prefect_server.env, "CROSSALIGN_SITE": str(site)}
    run = prepare_run(RunRequest(config="qwen35_moe_tiny", run_id="parts", store=str(store), mode="distributed",
                                 overrides=OVERRIDES).resolve())
    for step in ("base-train", "cast-bf16"):  # the convert step's inputs, made by the real steps
        subprocess.run([sys.executable, "-m", "crossalign.tasks", "--store", str(store), "--run", run.run_id,
                        "--step", step, "--embedded", "--site", str(site)], check=True, capture_output=True,
                       timeout=900)
    agents = []
    try:
        for name in ("cpu-a", "cpu-b"):
            with open(tmp_path / f"agent-{name}.log", "w") as log:
                agents.append(subprocess.Popen([CROSSALIGN, "agent", "start", "--pool", "cpu", "--site", str(site),
                                                "--name", name], env=env, stdout=log, stderr=subprocess.STDOUT,
                                               cwd=tmp_path))
        deployed = subprocess.run([CROSSALIGN, "deploy", "--prefect-file", str(REPO / "prefect.yaml")], env=env,
                                  capture_output=True, text=True, timeout=600, cwd=REPO)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
            manifest = execute_deployment(run, "convert", StepReporter("convert", run.run_id,
                                                                       logging.getLogger("test")), timeout_s=900)
            with get_client(sync_client=True) as client:
                parts = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                    name=FlowRunFilterName(like_=f"{run.run_id}-convert-part-")))
    finally:
        for agent in agents:
            stop_process(agent)
    assert manifest["details"]["parts"] == 2 and manifest["details"]["format"] == "torch_dist"
    assert sorted(part.name for part in parts) == ["parts-convert-part-0-of-2", "parts-convert-part-1-of-2"]
    assert all(part.state.is_completed() for part in parts)
    first, second = sorted(parts, key=lambda part: part.start_time)
    assert second.start_time < first.end_time, "the parts ran one after the other"
    assert len({part.infrastructure_pid for part in parts}) == 2  # a process each
    folder = next((RunStore(store).run(run.run_id).step_dir("convert") / "checkpoint").glob("iter_*"))
    assert sorted(p.name for p in folder.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not list(run.path.glob(".03-convert.parts-*"))
    one = tmp_path / "one-process"
    convert_checkpoint(run.config.model, "ms2mg", run.step_dir("cast-bf16") / "checkpoint", one,
                       ckpt_format="torch_dist")
    (index, tensors), (one_index, one_tensors) = _index_and_tensors(folder), _index_and_tensors(one / folder.name)
    assert index == one_index
    assert tensors.keys() == one_tensors.keys() and all(torch.equal(tensors[k], one_tensors[k]) for k in tensors)
