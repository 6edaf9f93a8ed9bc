"""Distributed mode end to end: a real Prefect server, the deployments of prefect.yaml, one process
worker per pool started by ``crossalign agent start``, the tiny dense alignment through run_deployment."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from conftest import free_port, stop_process
from crossalign.store import STEPS, RunStore

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
TINY = ["training.base_train_iters=3", "training.train_iters=5"]
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
    deployed = _crossalign("deploy", "--prefect-file", str(REPO / "prefect.yaml"), env=env)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    workers, logs = [], []
    try:
        for pool in POOLS:
            log = open(root / f"worker-{pool}.log", "w")
            logs.append(log)
            workers.append(subprocess.Popen(
                [CROSSALIGN, "agent", "start", "--pool", pool,
                 "--site", str(site), "--name", f"test-{pool}"],
                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root))
        yield {"store": store, "site": site, "env": env, "root": root}
    finally:
        for worker in workers:  # workers go before the server
            stop_process(worker)
        for log in logs:
            log.close()


def _flow_runs_by_name(client, run_id: str) -> dict[str, object]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=run_id)))
    return {r.name: r for r in runs}


def test_tiny_dense_alignment_through_the_deployments(stack, prefect_client_settings):
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    run_id = "e2e-dense"
    started = time.monotonic()
    parent = run_deployment("alignment/dense", timeout=DAG_TIMEOUT_S, poll_interval=2, parameters={
        "config": "qwen35_dense_tiny", "run_id": run_id, "overrides": TINY, "store": str(stack["store"]),
        "poll_interval_s": 1.0})
    wall = time.monotonic() - started
    assert parent.state.is_completed(), f"{parent.state.name}: {parent.state.message}\n" + _worker_logs(stack)

    run = RunStore(stack["store"]).run(run_id)
    assert all(run.is_done(spec.name) for spec in STEPS)
    summary = json.loads((run.step_dir("compare") / "summary.json").read_text())
    assert summary["verdict"] == "pass"
    assert run.config.training.train_iters == 5 and run.config.training.base_train_iters == 3
    assert len((run.step_dir("megatron-train") / "train.log").read_text().splitlines()) >= 5

    with get_client(sync_client=True) as client:
        children = _flow_runs_by_name(client, run_id)
        overheads, queued = {}, {}
        for spec in STEPS:
            child = children[f"{run_id}-{spec.name}"]
            assert child.state.is_completed()
            assert child.work_pool_name == spec.pool, f"{spec.name} ran on {child.work_pool_name}"
            assert child.idempotency_key == f"{run_id}:{spec.name}"
            assert child.parent_task_run_id is not None, "the step is linked to the parent as a subflow"
            manifest = run.manifest(spec.name)
            overheads[spec.name] = (child.end_time - child.created).total_seconds() - manifest["seconds"]
            queued[spec.name] = (child.start_time - child.created).total_seconds()
        assert client.read_flow_run(parent.id).work_pool_name == "orchestrator"
    # overhead: from the child's creation to its end, less the step's own committed work (manifest seconds);
    # queued: creation to Running (worker poll, process start, imports, flow load)
    report = {"dag_wall_s": round(wall, 1), "overhead_per_step_s": {k: round(v, 2) for k, v in overheads.items()},
              "queued_per_step_s": {k: round(v, 2) for k, v in queued.items()},
              "mean_overhead_s": round(sum(overheads.values()) / len(overheads), 2)}
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

        failed = run_deployment("nightly/nightly", timeout=120, poll_interval=1, parameters={
            "configs": ["no_such_model"], "store": str(stack["store"])})
        assert failed.state.is_failed()
        deadline = time.monotonic() + 60
        while not _Hook.received and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _Hook.received, "the webhook was not called"
        assert failed.name in _Hook.received[0]["text"] and "Failed" in _Hook.received[0]["text"]
    finally:
        hook.shutdown()


def _worker_logs(stack) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(stack["root"].glob("worker-*.log")))
