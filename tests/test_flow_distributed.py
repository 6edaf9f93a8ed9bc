"""Distributed mode end to end: a real Prefect server, the deployments of prefect.yaml, one process
worker per pool started by ``crossalign agent start``, the report server (``crossalign serve``), the tiny
dense alignment through the ``dense-tiny`` deployment (its gpu machine dies during megatron-train and the
run recovers as the README says), the live alignment artifact while both sides train, a run that fail-fast
stops, their artifacts and reports in headless Chromium, a run from the form retried as the UI's Retry does it
(the same run resumed, a damaged output redone), one step redone through the ``rerun`` deployment, the nightly
alert."""

from __future__ import annotations

import contextvars
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from crossalign.agents.server import free_port, stop_process
from helpers.processes import training_processes, training_writing_pid
from helpers.faulty_runs import FAULT, RUN_TIMEOUT_S as LIVE_RUN_TIMEOUT_S, TINY as LIVE_TINY, faulty_run
from crossalign.agents.server import local_agents
from crossalign.dag import STEPS
from crossalign.site import machine_timezone
from crossalign.store import RunStore

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
TINY = ["training.base_train_iters=3", "training.train_iters=20", "training.seq_length=64",
        "training.global_batch_size=2", "training.micro_batch_size=2", "training.lr_warmup_iters=2"]
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
    store.mkdir()
    site = root / "site.yaml"
    report_url = f"http://127.0.0.1:{free_port()}/"
    site.write_text(f"store: {store}\nbackends: {{npu: local, gpu: local}}\nreport_url: {report_url}\n")
    env = {**prefect_server.env, "CROSSALIGN_SITE": str(site)}
    with open(root / "serve.log", "w") as log:
        reports = subprocess.Popen([CROSSALIGN, "serve", "--port", report_url.rsplit(":", 1)[1].rstrip("/")],
                                   env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        # they probe their machine while the flows deploy; a test may replace one (the list is what is stopped)
        with local_agents(env, site, log_dir=root, pools=POOLS) as agents:
            deployed = _crossalign("deploy", "--prefect-file", str(REPO / "prefect.yaml"), env=env, timeout=600)
            assert deployed.returncode == 0, deployed.stdout + deployed.stderr
            said = deployed.stdout + deployed.stderr
            assert len(said.splitlines()) <= 6 and "prefect worker start" not in said, said
            assert "crossalign agent start --pool" in said and "marked Crashed" in said, said
            yield {"store": store, "site": site, "env": env, "root": root, "report_url": report_url,
                   "ui_url": prefect_server.ui_url, "agents": agents}
    finally:
        stop_process(reports)


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


# the training step each machine's pool runs, which a test kills with the machine
TRAINING_OF_POOL = {"gpu": "megatron-train", "npu": "pynative-train"}


def _second_agent_is_refused(stack, pool: str) -> None:
    """A second agent of the same name beside the live one is refused, naming the one that runs."""
    second = _crossalign("agent", "start", "--pool", pool, "--site", str(stack["site"]), "--name", f"local-{pool}",
                         env=stack["env"], timeout=60)
    assert second.returncode == 2 and "already running" in second.stderr, second.stdout + second.stderr


def _machine_dies(stack, run_dir: Path, pool: str) -> tuple[list[int], float]:
    """While the training step of ``pool`` writes its log, its machine dies as the README's recipe shows it: the
    agent is SIGKILLed (its worker must die with it), then the training processes (the step's flow run process
    and the rank processes it started, if any). Nothing is left to report the flow run's end, only its missing
    heartbeats. Returns the killed pids and when they were killed."""
    import psutil

    step = TRAINING_OF_POOL[pool]
    pid = _wait_for(lambda: training_writing_pid(run_dir, step), DAG_TIMEOUT_S, f"{step} writing its log")
    training = training_processes(pid)
    agent = stack["agents"][POOLS.index(pool)]
    worker = psutil.Process(agent.pid).children()[0]
    os.kill(agent.pid, signal.SIGKILL)
    agent.wait(timeout=10)
    _wait_for(lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE, 10,
              "the worker to die with its agent")
    for process in training:  # psutil.NoSuchProcess here: the step ended before its machine died
        process.kill()
    return [process.pid for process in training], time.monotonic()


def _restart_agent_as_the_readme_says(stack, pool: str) -> None:
    """The README's line for a machine that died: `crossalign agent start --pool gpu > agent-gpu.log 2>&1 &`
    (its default name; the site file as every agent of the test has it, $CROSSALIGN_SITE)."""
    with open(stack["root"] / f"agent-{pool}.log", "w") as log:
        stack["agents"][POOLS.index(pool)] = subprocess.Popen(
            [CROSSALIGN, "agent", "start", "--pool", pool], env=stack["env"], stdout=log, stderr=subprocess.STDOUT,
            cwd=stack["root"])


class _ArtifactVersions:
    """Each version of the parent's artifact ``key`` (updated in place, so the server keeps only the last) as a
    poller sees it while the run goes on: (when the server says it was updated, its data)."""

    def __init__(self, flow_run_id, key: str, every_s: float = 0.2):
        self.flow_run_id, self.key, self.every_s = flow_run_id, key, every_s
        self.seen: list[tuple[object, str]] = []
        self._stop = threading.Event()
        # the thread sees the test's Prefect settings (the session server)
        self._thread = threading.Thread(target=contextvars.copy_context().run, args=(self._poll,), daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=30)

    def _poll(self) -> None:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

        with get_client(sync_client=True) as client:
            while not self._stop.is_set():
                try:
                    found = client.read_artifacts(artifact_filter=ArtifactFilter(
                        key=ArtifactFilterKey(any_=[self.key]), flow_run_id=ArtifactFilterFlowRunId(
                            any_=[self.flow_run_id])))
                except Exception:  # an API call lost under load: the next look sees the same or a later version
                    found = []
                for artifact in found:
                    if not self.seen or self.seen[-1][1] != artifact.data:
                        self.seen.append((artifact.updated, artifact.data))
                self._stop.wait(self.every_s)


@pytest.mark.timeout(1800)  # the DAG, plus the 90 s in which a dead machine is noticed, on 2 busy cores
def test_tiny_dense_alignment_through_the_deployments(stack, prefect_client_settings):
    """The DAG through the deployments (crash detection as `crossalign deploy` set it up); the gpu machine
    dies while megatron-train writes (agent, then training processes, SIGKILL): the child is marked Crashed
    within the default detection time, the parent retries it as a new child, which the agent restarted as
    the README says runs, compare follows it, and the run still passes. The live comparison is shown, and
    updated, while both trainings run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey, LogFilter,
                                                LogFilterFlowRunId, TaskRunFilter, TaskRunFilterFlowRunId)
    from prefect.deployments import run_deployment

    from crossalign.agents.automation import DEFAULT_ZOMBIE_AFTER_S

    run_id = "e2e-dense"
    started = time.monotonic()
    parent = run_deployment("alignment/dense-tiny", timeout=0, parameters={  # its config: qwen35_dense_tiny
        "run_id": run_id, "overrides": TINY, "store": str(stack["store"]), "poll_interval_s": 1.0,
        "retry_delay_s": 1.0})
    run_dir = stack["store"] / run_id

    with _ArtifactVersions(parent.id, "live-alignment") as live_versions:
        _second_agent_is_refused(stack, "gpu")
        killed, killed_at = _machine_dies(stack, run_dir, "gpu")
        with get_client(sync_client=True) as client:
            crashed = _wait_for(lambda: next((r for r in _flow_runs_by_name(client, run_id).values()
                                              if r.name == f"{run_id}-megatron-train" and r.state.is_crashed()),
                                             None),
                                DEFAULT_ZOMBIE_AFTER_S + 120, "the dead machine's flow run to be marked Crashed")
            detected_s = time.monotonic() - killed_at
            print(f"\ndead gpu machine detected after {detected_s:.0f} s")
            # the README: "the step is marked Crashed within two minutes"
            assert detected_s <= DEFAULT_ZOMBIE_AFTER_S + 30, detected_s
            assert "No heartbeat for 90 s" in crashed.state.message
            _restart_agent_as_the_readme_says(stack, "gpu")
            final = _wait_for(lambda: (lambda r: r if r.state.is_final() else None)(client.read_flow_run(parent.id)),
                              DAG_TIMEOUT_S, "the parent flow run to finish")
    wall = time.monotonic() - started
    assert final.state.is_completed(), f"{final.state.name}: {final.state.message}\n" + _worker_logs(stack)
    assert final.name == run_id, "the parent is named after the store's run id"
    report_link = f"{stack['report_url']}{run_id}/06-compare/report.html"
    assert final.state.message == f"run {run_id}: verdict pass; report {report_link} (judged lm_loss, mtp_1_loss)"

    run = RunStore(stack["store"]).run(run_id)
    assert all(run.is_done(spec.name) for spec in STEPS)
    assert not list(run.path.glob(".*partial*"))
    assert run.manifest("megatron-train")["pid"] not in killed
    summary = json.loads((run.step_dir("compare") / "summary.json").read_text())
    assert summary["verdict"] == "pass"
    assert run.config.training.train_iters == 20 and run.config.training.base_train_iters == 3

    with get_client(sync_client=True) as client:
        children = _flow_runs_by_name(client, run_id)
        crashed = children[f"{run_id}-megatron-train"]
        assert crashed.state.is_crashed(), crashed.state
        retried = children[f"{run_id}-megatron-train-2"]
        assert retried.state.is_completed() and retried.idempotency_key == f"{run_id}:megatron-train:2"
        assert set(children) == {run_id, *(f"{run_id}-{spec.name}" for spec in STEPS), retried.name}, \
            "only megatron-train is retried"
        overheads, queued = {}, {}
        for spec in STEPS:
            child = retried if spec.name == "megatron-train" else children[f"{run_id}-{spec.name}"]
            assert child.state.is_completed()
            assert child.work_pool_name == spec.pool, f"{spec.name} ran on {child.work_pool_name}"
            if spec.name != "megatron-train":
                assert child.idempotency_key == f"{run_id}:{spec.name}"
            assert child.parent_task_run_id is not None, "the step is linked to the parent as a subflow"
            manifest = run.manifest(spec.name)
            overheads[spec.name] = (child.end_time - child.created).total_seconds() - manifest["seconds"]
            queued[spec.name] = (child.start_time - child.created).total_seconds()
        assert client.read_flow_run(parent.id).work_pool_name == "orchestrator"
        task_runs = client.read_task_runs(task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(
            any_=[parent.id])))
        names = {t.name for t in task_runs}
        assert names >= {"prepare-run", "preflight", *(spec.name for spec in STEPS)}, names
        host = run.manifest("compare")["host"]
        tracking = {t.name for t in task_runs if t.name.endswith(f", host {host}")}
        assert tracking == {f"{spec.name} on {spec.pool}, host {host}" for spec in STEPS}, names

        # what follows megatron-train is done after its retry, by the restarted gpu agent's worker
        compare = children[f"{run_id}-compare"]
        assert compare.start_time > retried.end_time, (compare.start_time, retried.end_time)
        assert retried.start_time > crashed.end_time
        megatron, pynative = retried, children[f"{run_id}-pynative-train"]
        logs = [entry.message for entry in client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[megatron.id])))]
        assert any("megatron-train iteration 20/20: lm_loss" in line for line in logs), logs[-20:]
        progress = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[
            "megatron-train-progress"]), flow_run_id=ArtifactFilterFlowRunId(any_=[megatron.id])))
        assert progress and progress[-1].type == "progress" and float(progress[-1].data) == 100.0
        report = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[
            "compare-metrics", "alignment-steps", "compare-report-link", "compare-loss-plot"]),
            flow_run_id=ArtifactFilterFlowRunId(any_=[parent.id])))  # the session's server holds other tests' too
        assert sorted(a.key for a in report) == ["alignment-steps", "compare-loss-plot", "compare-metrics",
                                                 "compare-report-link"], "each made once"
        assert {a.flow_run_id for a in report} == {parent.id}, "the parent shows them"
        live = [a for a in client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[
            "live-alignment"]))) if a.flow_run_id == parent.id]
        # the live comparison: one artifact, shown while the trainings still ran, updated in place to step 20.
        # "Still ran" is before the last of them ended: megatron-train's retry, started once the killed attempt
        # is marked Crashed, can train all its 20 tiny steps before the parent's next look at the logs, while
        # pynative-train, held at step 1 until the other side logs it, trains its 19 more steps after that.
        last_end = max(megatron.end_time, pynative.end_time)
        assert len(live) == 1 and "steps 1-20 of 20 compared" in live[0].data, live
        assert live[0].created < last_end and live[0].updated > live[0].created
        # what the poller saw while the run went on: the first version, shown while a training ran, already
        # compares step 1; it was updated again before the last training ended
        seen_at = [when for when, _ in live_versions.seen]
        assert seen_at and seen_at[0] < last_end, (seen_at, megatron.end_time, pynative.end_time)
        first = live_versions.seen[0][1]
        assert re.search(r"steps 1-\d+ of 20 compared", first), first
        assert re.search(r"\| lm_loss \| \d+ \| [0-9.e+-]+% \|", first), first
        assert len([when for when in seen_at if when < last_end]) >= 2, (seen_at, megatron.end_time, pynative.end_time)
        assert live_versions.seen[-1][1] == live[0].data
        shown = {a.key: a for a in report}
        rows = json.loads(shown["alignment-steps"].data)
        assert [row["step"] for row in rows] == [spec.dirname for spec in STEPS]
        assert all(row["time"].endswith((" s", " min")) and row["size"].endswith(("B", "KB", "MB")) for row in rows)
        assert shown["compare-loss-plot"].type == "image"
        assert shown["compare-loss-plot"].data == f"{stack['report_url']}{run_id}/06-compare/loss.png"
        assert report_link in shown["compare-report-link"].data

    # overhead: from the child's creation to its end, less the step's own committed work (manifest seconds);
    # queued: creation to Running (worker poll, process start, imports, flow load)
    steady = {k: v for k, v in overheads.items() if k != "megatron-train"}
    report = {"dag_wall_s": round(wall, 1), "dead_machine_detected_s": round(detected_s, 1),
              "live_versions_seen": len(live_versions.seen),
              "overhead_per_step_s": {k: round(v, 2) for k, v in overheads.items()},
              "queued_per_step_s": {k: round(v, 2) for k, v in queued.items()},
              "mean_overhead_s": round(sum(steady.values()) / len(steady), 2)}
    (stack["root"] / "timings.json").write_text(json.dumps(report, indent=2))
    print(f"\ndistributed DAG timings: {json.dumps(report)}")
    assert report["mean_overhead_s"] < 30, report


@pytest.mark.slow
def test_fail_fast_through_the_deployments(stack, prefect_client_settings):
    """Distributed: the trainings run as flow runs on the npu and gpu workers and stop on the request in the
    shared store; the parent ends Failed with the reason, the children end without completing. (Before the
    browser test, which shows this run.)"""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    from crossalign.stop import read_stop

    overrides = [*LIVE_TINY, "training.train_iters=200"]
    run = faulty_run({"store": stack["store"], "env": stack["env"]}, "fault-dist", overrides, FAULT, LIVE_RUN_TIMEOUT_S)
    parent = run_deployment("alignment/dense-tiny", timeout=0, parameters={
        "run_id": "fault-dist", "overrides": overrides, "store": str(stack["store"]), "poll_interval_s": 0.5})
    with get_client(sync_client=True) as client:
        deadline = time.monotonic() + LIVE_RUN_TIMEOUT_S
        while not (final := client.read_flow_run(parent.id)).state.is_final() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert final.state.is_failed() and "stopped early at step 1 of 200" in final.state.message, final.state
        children = {r.name: r for r in client.read_flow_runs() if r.name.startswith("fault-dist-")}
    for step in ("megatron-train", "pynative-train"):
        child = children[f"fault-dist-{step}"]
        assert child.state.is_final() and not child.state.is_completed(), child.state
        assert not run.is_done(step) and "stopped early" in run.attempt(step)["error"]
    trained = {step: s["trained_steps"] for step, s in read_stop(run)["stopped"].items()}
    assert all(1 <= n <= 10 for n in trained.values()), trained
    assert (run.path / "live" / "report.html").exists() and "live/report.html" in final.state.message


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _browse(url: str, out: Path, *, screenshot: bool = False) -> str:
    """The page's DOM after its scripts ran (up to 30 s of page time) in headless Chromium; a screenshot beside it."""
    base = [_chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", f"--user-data-dir={out.with_suffix('.profile')}", "--virtual-time-budget=30000",
            "--window-size=1400,1800"]
    if screenshot:
        subprocess.run([*base, f"--screenshot={out}", url], capture_output=True, timeout=180)
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=180).stdout
    out.with_suffix(".html").write_text(dom)  # what the assertions read, kept for a failure's reader
    return dom


def _parent_and_artifacts(client, run_id: str):
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterName

    parent = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[run_id])))[0]
    return parent, {a.key: a for a in client.read_artifacts(
        artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[parent.id])))}


def _fetch(url: str) -> tuple[str, bytes]:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200, url
        return response.headers["content-type"], response.read()


def test_artifacts_and_report_open_in_a_browser(stack, prefect_client_settings):
    """What a user sees in headless Chromium: the parent run's artifacts in the Prefect UI show the verdict
    and the plot from the report server, the plot loads, the report link opens over HTTP; the live alignment
    artifact shows the comparison of both trainings and its plot; the run page links the report. The run
    that fail-fast stopped shows Failed, why, and the live report of what both sides logged."""
    if _chromium() is None:
        pytest.skip("headless Chromium is not installed (scripts/setup.sh --dev installs it)")
    from prefect.client.orchestration import get_client

    run_id, ui, served, root = "e2e-dense", stack["ui_url"], stack["report_url"], stack["root"]
    if not (stack["store"] / run_id / "06-compare").exists():
        pytest.skip("needs the finished run of the first test")
    with get_client(sync_client=True) as client:
        parent, artifacts = _parent_and_artifacts(client, run_id)
    plot = f"{served}{run_id}/06-compare/loss.png"
    report = f"{served}{run_id}/06-compare/report.html"
    page = _browse(f"{ui}/artifacts/artifact/{artifacts['compare-loss-plot'].id}", root / "plot-artifact.png",
                   screenshot=True)
    assert "verdict: pass" in page and f'<img src="{plot}">' in page, page[-3000:]
    assert f"run {run_id}: verdict pass; report" in page, "the run's final message is shown beside it"
    assert (root / "plot-artifact.png").stat().st_size > 0
    kind, data = _fetch(plot)
    assert kind == "image/png" and data[:4] == b"\x89PNG"
    page = _browse(f"{ui}/artifacts/artifact/{artifacts['compare-report-link'].id}", root / "link-artifact.png")
    assert f'href="{report}"' in page, page[-3000:]
    # the state message is plain text wherever Prefect shows it; the parent's log line of it links the report
    page = _browse(f"{ui}/runs/flow-run/{parent.id}", root / "run.png", screenshot=True)
    assert f'href="{report}"' in page, "the run page links the report (its log line of the final message)"
    assert f'href="{report}\'' not in page, "no link takes the quote of the engine's Completed('...') line"

    # the live comparison as it was last updated: both sides' errors so far, the decision, its plot
    page = _browse(f"{ui}/artifacts/artifact/{artifacts['live-alignment'].id}", root / "live-artifact.png",
                   screenshot=True)
    assert "Live alignment: steps 1-20 of 20 compared" in page, page[-3000:]
    assert all(column in page for column in ("step1_rel_err", "mean_rel_err_so_far", "comove_so_far")), page[-3000:]
    assert "lm_loss" in page and "Outcome: open" in page
    live_plot = f"{served}{run_id}/live/loss.png?step=20"
    assert f'src="{live_plot}"' in page, page[-3000:]
    kind, data = _fetch(live_plot)
    assert kind == "image/png" and data[:4] == b"\x89PNG"

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("alignment/dense-tiny")
    form = _browse(f"{ui}/deployments/deployment/{deployment.id}/run", root / "form.png", screenshot=True)
    for shown in ("MODEL-YYYYMMDD-HHMMSS-XXXX", "one KEY=VALUE per item", "qwen35_moe_tiny) or"):
        assert shown in form, f"the run form shows {shown!r} as written"
    assert "str | str" not in form
    page = _browse(report, root / "report.png", screenshot=True)
    assert "class=\"verdict\">PASS<" in page, page[:2000]
    assert f"<h1>run {run_id}</h1>" in page, "the report names its run"
    assert f'href="{ui}/runs/flow-run/{parent.id}"' in page, "and links back to it in Prefect"
    assert (root / "report.png").stat().st_size > 0

    # the run fail-fast stopped (test_fail_fast_through_the_deployments)
    stopped_id = "fault-dist"
    if not (stack["store"] / stopped_id / "live" / "report.html").exists():
        pytest.skip("needs the stopped run of the fail-fast test")
    with get_client(sync_client=True) as client:
        stopped, stopped_artifacts = _parent_and_artifacts(client, stopped_id)
    live_report = f"{served}{stopped_id}/live/report.html"
    page = _browse(f"{ui}/runs/flow-run/{stopped.id}", root / "stopped-run.png", screenshot=True)
    assert "Failed" in page and f"run {stopped_id}: verdict fail, stopped early at step 1 of 200" in page, page[-3000:]
    assert f'href="{live_report}"' in page, "the run page links the live report (its log line of the final message)"
    assert f'href="{live_report}\'' not in page, "no link takes the quote of the engine's Failed('...') line"
    page = _browse(f"{ui}/artifacts/artifact/{stopped_artifacts['live-alignment'].id}",
                   root / "stopped-live-artifact.png", screenshot=True)
    assert "Outcome decided at step 1: the run cannot pass." in page, page[-3000:]
    assert "both trainings are stopped" in page, page[-3000:]
    assert "verdict fail, stopped early at step 1 of 200" in page, "the run's final message is shown beside it"
    page = _browse(live_report, root / "stopped-report.png", screenshot=True)
    assert "class=\"verdict\">FAIL<" in page and "stopped early at step 1 of 200" in page, page[:3000]
    assert f'href="{ui}/runs/flow-run/{stopped.id}"' in page, "the live report links back to its run"


def _retry_as_the_ui_does(api_url: str, flow_run_id) -> None:
    """The request of the Retry button on a failed flow run in Prefect 3.9.1's UI at the run's page
    (/runs/flow-run/ID, which the report and the alerts link), as headless Chromium sent it: the flow run's state
    set to Scheduled "AwaitingRetry", not forced, so Prefect's orchestration rules decide (prefect-ui-library's
    retryFlowRun; the newer UI at /v2 sends the same state forced)."""
    import httpx

    response = httpx.post(f"{api_url}/flow_runs/{flow_run_id}/set_state", json={
        "state": {"name": "AwaitingRetry", "message": "Retry from the UI", "type": "SCHEDULED"}, "force": False},
        timeout=30)
    assert response.status_code == 201 and response.json()["status"] == "ACCEPT", response.text


@pytest.mark.timeout(1800)
def test_retry_from_the_ui_resumes_the_run_its_first_attempt_started(stack, prefect_client_settings):
    """A run started from the form as a user starts it (no run_id; retries 0: the parent does not retry a step).
    Its gpu agent is SIGKILLed while megatron-train trains, and the step's process ended: the step ends Crashed
    and the parent fails. Meanwhile the converted checkpoint is damaged (same size). The agent is restarted as the README says and
    the parent retried as the UI's Retry button does it: the same flow run resumes the run id its first attempt
    made; base-train and cast-bf16 are not run again, convert (whose sha256, checked on a Retry, no longer matches),
    megatron-train and compare are, and the run passes. No second run is started in the store."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    from crossalign.store import is_new_run_id

    store = stack["store"]
    runs_before = set(store.glob("*/run.json"))
    parent = run_deployment("alignment/dense-tiny", timeout=0, parameters={
        "overrides": TINY, "store": str(store), "retries": 0, "poll_interval_s": 1.0})
    with get_client(sync_client=True) as client:
        try:
            run_id = _wait_for(lambda: (lambda name: name if is_new_run_id(name) else None)(
                client.read_flow_run(parent.id).name), DAG_TIMEOUT_S, "the parent to be named after its new run id")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {client.read_flow_run(parent.id)}\n{_worker_logs(stack)}") from None
        run_dir = store / run_id
        step = _wait_for(lambda: training_writing_pid(run_dir, "megatron-train"), DAG_TIMEOUT_S,
                         "megatron-train writing its log")
        agent = stack["agents"][POOLS.index("gpu")]
        os.kill(agent.pid, signal.SIGKILL)  # a user's kill -9 of the gpu agent: its worker dies with it
        agent.wait(timeout=10)
        # the step's flow run then may or may not crash by itself (Prefect's engine writes to its dead worker);
        # it is ended as a machine going down ends it, so that Prefect's engine reports it Crashed at once
        os.kill(step, signal.SIGTERM)
        failed = _wait_for(lambda: (lambda r: r if r.state.is_final() else None)(client.read_flow_run(parent.id)),
                           DAG_TIMEOUT_S, "the parent to fail")
        assert failed.state.is_failed() and "megatron-train" in failed.state.message, failed.state
        run = RunStore(store).run(run_id)
        assert run.is_done("convert") and not run.is_done("megatron-train")
        kept = {name: run.manifest(name) for name in ("base-train", "cast-bf16")}
        converted = run.manifest("convert")
        checkpoint = next(run.step_dir("convert").rglob("model_optim_rng.pt"))
        size = checkpoint.stat().st_size
        with open(checkpoint, "r+b") as handle:  # the zip directory at its end: unreadable, same size
            handle.seek(size - 64)
            handle.write(bytes(64))

        _restart_agent_as_the_readme_says(stack, "gpu")
        _retry_as_the_ui_does(stack["env"]["PREFECT_API_URL"], parent.id)
        final = _wait_for(lambda: (lambda r: r if r.state.is_final() else None)(client.read_flow_run(parent.id)),
                          DAG_TIMEOUT_S, "the retried parent to finish")
        children = _flow_runs_by_name(client, run_id)
    assert final.state.is_completed(), f"{final.state.name}: {final.state.message}\n" + _worker_logs(stack)
    assert final.run_count == 2 and final.name == run_id, (final.run_count, final.name)
    assert final.state.message.startswith(f"run {run_id}: verdict pass"), final.state.message
    assert set(store.glob("*/run.json")) - runs_before == {run_dir / "run.json"}, "the Retry made no second run"
    assert {name: run.manifest(name) for name in kept} == kept, "base-train and cast-bf16 are not run again"
    assert not {f"{run_id}-base-train-2", f"{run_id}-cast-bf16-2"} & set(children), sorted(children)
    assert run.is_done("convert", checksums=True) and run.manifest("convert")["pid"] != converted["pid"]
    assert {f"{run_id}-convert-2", f"{run_id}-megatron-train-2"} <= set(children), sorted(children)
    assert all(run.is_done(spec.name) for spec in STEPS)


def test_rerun_deployment_redoes_one_step_and_its_downstream(stack, prefect_client_settings):
    """The `rerun` deployment with run_id and step=megatron-train on the finished run, with the dump's step and task
    as `rerun --dump --dump-step 1 --dump-task md5` takes them: megatron-train (dumping that iteration with msprobe)
    and compare run again as new children; the other steps are skipped."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    run_id = "e2e-dense"
    run = RunStore(stack["store"]).run(run_id)
    if not run.is_done("compare"):
        pytest.skip("needs the finished run of the previous test")
    before = {spec.name: run.manifest(spec.name) for spec in STEPS}
    with get_client(sync_client=True) as client:
        children_before = set(_flow_runs_by_name(client, run_id))
    parent = run_deployment("rerun/rerun", timeout=DAG_TIMEOUT_S, poll_interval=2, parameters={
        "run_id": run_id, "step": "megatron-train", "store": str(stack["store"]), "poll_interval_s": 1.0,
        "dump": True, "dump_step": 1, "dump_task": "md5"})
    assert parent.state.is_completed(), f"{parent.state.name}: {parent.state.message}"
    assert parent.name == f"{run_id}-rerun-megatron-train" and "verdict pass" in parent.state.message
    dumped = run.manifest("megatron-train")["details"]["msprobe_dump"]
    assert (dumped["step"], dumped["level"], dumped["task"], dumped["rank_folders"]) == (1, "L0", "md5", ["rank0"])
    redone = ("megatron-train", "compare")
    for spec in STEPS:
        if spec.name in redone:
            assert run.manifest(spec.name)["finished"] >= before[spec.name]["finished"]
            assert run.manifest(spec.name)["pid"] != before[spec.name]["pid"], f"{spec.name} must be redone"
        else:
            assert run.manifest(spec.name) == before[spec.name], f"{spec.name} must be skipped"
    with get_client(sync_client=True) as client:
        new_children = set(_flow_runs_by_name(client, run_id)) - children_before - {parent.name}
    assert len(new_children) == len(redone), new_children
    assert all(any(name.startswith(f"{run_id}-{step}-") for name in new_children) for step in redone), new_children


def test_flow_parameters_are_validated_like_set(stack, prefect_client_settings):
    """A deployment run with an unknown override key or a config that is neither shipped nor a valid file
    fails before any step, naming the key or the file."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterLevel
    from prefect.deployments import run_deployment

    # typed in the form's list with quotes, which the list keeps; no run_id: a new run's id is made
    bad_key = run_deployment("alignment/dense-tiny", timeout=DAG_TIMEOUT_S, poll_interval=1, parameters={
        "overrides": ['"training.trian_iters=3"'], "store": str(stack["store"])})
    assert bad_key.state.is_failed() and "training.trian_iters: unknown field" in bad_key.state.message
    assert "overrides" in bad_key.state.message and "--set" not in bad_key.state.message, bad_key.state.message
    assert re.fullmatch(r"qwen35_dense_tiny-\d{8}-\d{6}-[0-9a-f]{4}", bad_key.name), bad_key.name
    with get_client(sync_client=True) as client:
        errors = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[bad_key.id]),
                                                       level=LogFilterLevel(ge_=40)))
    assert not errors, [e.message[:200] for e in errors]
    not_a_config = stack["root"] / "not-a-config.yaml"
    not_a_config.write_text("model: {name: x}\n")
    bad_file = run_deployment("alignment/dense-tiny", timeout=DAG_TIMEOUT_S, poll_interval=1, parameters={
        "config": str(not_a_config), "run_id": "bad-file", "store": str(stack["store"])})
    assert bad_file.state.is_failed() and f"{not_a_config}: invalid config" in bad_file.state.message
    assert not (stack["store"] / bad_key.name).exists() and not (stack["store"] / "bad-file").exists()


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
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterKey, LogFilter, LogFilterFlowRunId,
                                                LogFilterLevel)
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
        # the zone `crossalign deploy` gave it: the site names none, so this machine's, which the description states
        assert deployment.schedules[0].schedule.timezone == machine_timezone()
        assert f"at 02:00 {machine_timezone()};" in deployment.description, deployment.description

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
        with get_client(sync_client=True) as client:  # a regression is an outcome, not a crash of the flow
            errors = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[failed.id]),
                                                           level=LogFilterLevel(ge_=40)))
        assert not errors, [e.message[:200] for e in errors]
        entries = json.loads(history.read_text())
        assert [(e["date"], e["verdict"]) for e in entries] == [("2026-11-01", "pass"), (night, "pass")]
        assert (history.parent / "trend.png").read_bytes()[:4] == b"\x89PNG"
        deadline = time.monotonic() + 60
        while not _Hook.received and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _Hook.received, "the webhook was not called"
        text = _Hook.received[0]["text"]
        assert failed.name == "nightly-20261102" and failed.name in text and "Failed" in text
        assert f"{stack['ui_url']}/runs/flow-run/{failed.id}" in text, "the alert links the run in the UI"
        trend = f"{stack['report_url']}nightly/trend.png"
        assert f"(trend: {trend})" in text, "and the trend plot on the report server"
        import urllib.request

        with urllib.request.urlopen(trend, timeout=30) as response:
            assert response.status == 200 and response.read()[:4] == b"\x89PNG"
        with get_client(sync_client=True) as client:
            image = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["nightly-trend"])))
        assert [(a.type, a.data, a.flow_run_id) for a in image] == [("image", trend, failed.id)]
    finally:
        hook.shutdown()


def _worker_logs(stack) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(stack["root"].glob("worker-*.log"))
                     + sorted(stack["root"].glob("agent-*.log")))
