"""Distributed mode end to end: a real Prefect server, the deployments of prefect.yaml, one process
worker per pool started by ``crossalign agent start``, the tiny dense alignment through run_deployment."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from conftest import free_port, pynative_writing_pid
from crossalign.agents.server import local_agents
from crossalign.store import STEPS, RunStore

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
TINY = ["training.base_train_iters=3", "training.train_iters=5", "training.seq_length=64",
        "training.global_batch_size=2", "training.micro_batch_size=2"]
POOLS = ("orchestrator", "npu", "cpu", "gpu")
DAG_TIMEOUT_S = 420


CROSSALIGN = str(Path(sys.executable).with_name("crossalign"))


def _crossalign(*args: str, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([CROSSALIGN, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


@pytest.fixture(scope="module")
def stack(prefect_server, tmp_path_factory):
    """Pools and deployments on the server, and one worker per pool started through `crossalign agent start`."""
    root = tmp_path_factory.mktemp("distributed")
    store = root / "store"
    site = root / "site.yaml"
    site.write_text(f"store: {store}\nbackends: {{npu: local, gpu: local}}\n")
    env = {**prefect_server.env, "CROSSALIGN_SITE": str(site)}
    with local_agents(env, site, log_dir=root, pools=POOLS):  # they probe their machine while the flows deploy
        deployed = _crossalign("deploy", "--prefect-file", str(REPO / "prefect.yaml"), env=env)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        yield {"store": store, "site": site, "env": env, "root": root}


def _flow_runs_by_name(client, run_id: str) -> dict[str, object]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=run_id)))
    return {r.name: r for r in runs}


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_tiny_dense_alignment_through_the_deployments(stack, prefect_client_settings):
    """The DAG through the deployments; the npu worker's pynative-train process is SIGKILLed while it
    writes: the child crashes, the parent retries it as a new child, the run still passes."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, LogFilter, LogFilterFlowRunId
    from prefect.deployments import run_deployment

    run_id = "e2e-dense"
    started = time.monotonic()
    parent = run_deployment("alignment/dense", timeout=0, parameters={
        "config": "qwen35_dense_tiny", "run_id": run_id, "overrides": TINY, "store": str(stack["store"]),
        "poll_interval_s": 1.0, "retry_delay_s": 1.0})
    run_dir = stack["store"] / run_id

    killed = _wait_for(lambda: pynative_writing_pid(run_dir), DAG_TIMEOUT_S, "pynative-train writing its log")
    os.kill(killed, signal.SIGKILL)
    with get_client(sync_client=True) as client:
        final = _wait_for(lambda: (lambda r: r if r.state.is_final() else None)(client.read_flow_run(parent.id)),
                          DAG_TIMEOUT_S, "the parent flow run to finish")
    wall = time.monotonic() - started
    assert final.state.is_completed(), f"{final.state.name}: {final.state.message}\n" + _worker_logs(stack)

    run = RunStore(stack["store"]).run(run_id)
    assert all(run.is_done(spec.name) for spec in STEPS)
    assert not list(run.path.glob(".*partial*"))
    assert run.manifest("pynative-train")["pid"] != killed
    summary = json.loads((run.step_dir("compare") / "summary.json").read_text())
    assert summary["verdict"] == "pass"
    assert run.config.training.train_iters == 5 and run.config.training.base_train_iters == 3

    with get_client(sync_client=True) as client:
        children = _flow_runs_by_name(client, run_id)
        crashed = children[f"{run_id}-pynative-train"]
        assert crashed.state.is_crashed(), crashed.state
        retried = children[f"{run_id}-pynative-train-2"]
        assert retried.state.is_completed() and retried.idempotency_key == f"{run_id}:pynative-train:2"
        overheads, queued = {}, {}
        for spec in STEPS:
            child = retried if spec.name == "pynative-train" else children[f"{run_id}-{spec.name}"]
            assert child.state.is_completed()
            assert child.work_pool_name == spec.pool, f"{spec.name} ran on {child.work_pool_name}"
            if spec.name != "pynative-train":
                assert child.idempotency_key == f"{run_id}:{spec.name}"
            assert child.parent_task_run_id is not None, "the step is linked to the parent as a subflow"
            manifest = run.manifest(spec.name)
            overheads[spec.name] = (child.end_time - child.created).total_seconds() - manifest["seconds"]
            queued[spec.name] = (child.start_time - child.created).total_seconds()
        assert client.read_flow_run(parent.id).work_pool_name == "orchestrator"

        megatron = children[f"{run_id}-megatron-train"]
        logs = [entry.message for entry in client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[megatron.id])))]
        assert any("megatron-train iteration 5/5: lm_loss" in line for line in logs), logs[-20:]
        progress = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[
            "megatron-train-progress"])))
        assert progress and progress[-1].type == "progress" and float(progress[-1].data) == 100.0
        report = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[
            "compare-metrics", "alignment-steps"])))
        assert {a.key for a in report} == {"compare-metrics", "alignment-steps"}

    # overhead: from the child's creation to its end, less the step's own committed work (manifest seconds);
    # queued: creation to Running (worker poll, process start, imports, flow load)
    steady = {k: v for k, v in overheads.items() if k != "pynative-train"}
    report = {"dag_wall_s": round(wall, 1), "overhead_per_step_s": {k: round(v, 2) for k, v in overheads.items()},
              "queued_per_step_s": {k: round(v, 2) for k, v in queued.items()},
              "mean_overhead_s": round(sum(steady.values()) / len(steady), 2)}
    (stack["root"] / "timings.json").write_text(json.dumps(report, indent=2))
    print(f"\ndistributed DAG timings: {json.dumps(report)}")
    assert report["mean_overhead_s"] < 30, report


def test_rerun_of_one_step_creates_one_new_child(stack, prefect_client_settings):
    """A second parent with rerun=[compare] on the finished run: only compare runs again, as attempt 2."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    run_id = "e2e-dense"
    run = RunStore(stack["store"]).run(run_id)
    if not run.is_done("compare"):
        pytest.skip("needs the finished run of the previous test")
    before = {spec.name: run.manifest(spec.name) for spec in STEPS}
    parent = run_deployment("alignment/dense", timeout=DAG_TIMEOUT_S, poll_interval=2, parameters={
        "config": None, "run_id": run_id, "rerun": ["compare"], "store": str(stack["store"]),
        "poll_interval_s": 1.0})
    assert parent.state.is_completed(), f"{parent.state.name}: {parent.state.message}"
    for spec in STEPS[:-1]:
        assert run.manifest(spec.name) == before[spec.name], f"{spec.name} must be skipped"
    assert run.manifest("compare")["finished"] >= before["compare"]["finished"]
    assert run.manifest("compare")["pid"] != before["compare"]["pid"]
    with get_client(sync_client=True) as client:
        children = _flow_runs_by_name(client, f"{run_id}-compare")
        assert set(children) == {f"{run_id}-compare", f"{run_id}-compare-2"}
        assert children[f"{run_id}-compare-2"].idempotency_key == f"{run_id}:compare:2"


class _Hook(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        _Hook.received.append(json.loads(body or b"{}"))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_automations_are_created_and_the_nightly_failure_alert_fires(stack, prefect_client_settings):
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    port = free_port()
    hook = HTTPServer(("127.0.0.1", port), _Hook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    try:
        installed = _crossalign("automations", "install", "--webhook", f"http://127.0.0.1:{port}/hook",
                                "--zombie-after", "90", env=stack["env"])
        assert installed.returncode == 0, installed.stdout + installed.stderr
        with get_client(sync_client=True) as client:
            zombie = client.read_automations_by_name("crossalign-crash-zombie-flow-runs")
            nightly = client.read_automations_by_name("crossalign-nightly-failed")
            deployment = client.read_deployment_by_name("nightly/nightly")
        assert len(zombie) == 1 and len(nightly) == 1
        assert zombie[0].trigger.posture == "Proactive" and zombie[0].trigger.within.total_seconds() == 90
        assert zombie[0].actions[0].type == "change-flow-run-state"
        related = nightly[0].trigger.match_related["prefect.resource.id"]
        assert related in (f"prefect.deployment.{deployment.id}", [f"prefect.deployment.{deployment.id}"])
        assert deployment.schedules and deployment.schedules[0].schedule.cron == "0 2 * * *"

        again = _crossalign("automations", "install", "--webhook", f"http://127.0.0.1:{port}/hook",
                            env=stack["env"])
        assert again.returncode == 0
        with get_client(sync_client=True) as client:
            assert len(client.read_automations_by_name("crossalign-nightly-failed")) == 1, "install is idempotent"

        # tonight's run is the finished e2e run (same config): the nightly's alignment skips every step;
        # a previous night with far smaller errors makes tonight a regression, which must alert
        night = "2026-11-02"
        source = stack["store"] / "e2e-dense"
        if not (source / "06-compare").exists():
            pytest.skip("needs the finished run of the first test")
        shutil.copytree(source, stack["store"] / "nightly-20261102-qwen35_dense_tiny")
        history = stack["store"] / "nightly" / "history.json"
        history.parent.mkdir(parents=True, exist_ok=True)
        history.write_text(json.dumps([{"date": "2026-11-01", "model": "qwen35_dense_tiny", "run_id": "old",
                                        "verdict": "pass", "error": None,
                                        "series": {"lm_loss": {"step1_rel_err": 1e-12, "mean_rel_err": 1e-12},
                                                   "mtp_1_loss": {"step1_rel_err": 1e-12, "mean_rel_err": 1e-12}}}]))
        failed = run_deployment("nightly/nightly", timeout=300, poll_interval=1, parameters={
            "configs": ["qwen35_dense_tiny"], "overrides": TINY, "store": str(stack["store"]), "night": night,
            "floor": 1e-12})
        assert failed.state.is_failed(), failed.state
        assert "qwen35_dense_tiny: lm_loss" in (failed.state.message or "")
        entries = json.loads(history.read_text())
        assert [(e["date"], e["verdict"]) for e in entries] == [("2026-11-01", "pass"), (night, "pass")]
        assert (history.parent / "trend.png").read_bytes()[:4] == b"\x89PNG"
        deadline = time.monotonic() + 60
        while not _Hook.received and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _Hook.received, "the webhook was not called"
        assert failed.name in _Hook.received[0]["text"] and "Failed" in _Hook.received[0]["text"]
    finally:
        hook.shutdown()


def _worker_logs(stack) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(stack["root"].glob("worker-*.log")))
