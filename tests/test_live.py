"""Live alignment while both sides train, and fail-fast.

Unit level: a growing log is read line by line (never half a line) wherever its step moves it;
the decision rules on logs written by ``crossalign.logs.synthetic``. End to end with the embedded
backends: a conversion fault stops a 200-step run within its first steps (both processes gone, the
logs kept, the report says why); a good run's live artifact is updated in place while both train.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from crossalign.logs import parse_log_text
from crossalign.logs.synthetic import megatron_lines, mindformers_lines
from crossalign.report.compare import CompareOptions, build_summary
from crossalign.report.live import GrowingLog, decide
from helpers.faulty_runs import FAULT, RUN_TIMEOUT_S, TINY, faulty_run

CROSSALIGN = str(Path(sys.executable).with_name("crossalign"))
OPTIONS = CompareOptions(megatron_core_version="0.16.1", log_interval=1, mtp_expected=True, plot=False)


def test_growing_log_reads_complete_lines_follows_the_commit_and_restarts_on_another_attempt(tmp_path):
    staging = tmp_path / ".04-megatron-train.partial-host-1-abcd"
    staging.mkdir()
    log, growing = staging / "train.log", GrowingLog()
    log.write_text("line 1\nline 2 is being wri")
    assert growing.read(log) and growing.text == "line 1\n", "half a line is never read"
    assert not growing.read(log), "nothing new"
    with open(log, "a") as fh:
        fh.write("tten\nline 3\n")
    assert growing.read(log) and growing.text == "line 1\nline 2 is being written\nline 3\n"
    committed = tmp_path / "04-megatron-train"
    os.replace(staging, committed)  # the step commits: same file, another folder
    with open(committed / "train.log", "a") as fh:
        fh.write("line 4\n")
    assert not growing.read(log), "the staging path is gone"
    assert growing.read(committed / "train.log") and growing.text.splitlines() == [
        "line 1", "line 2 is being written", "line 3", "line 4"], "read on where it stopped, nothing twice"
    (committed / "train.log").write_text("another attempt\n")
    assert growing.read(committed / "train.log") and growing.text == "another attempt\n"


def _summary(npu_lm, gpu_lm, npu_mtp, gpu_mtp):
    npu = parse_log_text(Path("npu.log"), "\n".join(mindformers_lines(npu_lm, mtp=[npu_mtp])) + "\n")
    gpu = parse_log_text(Path("gpu.log"), "\n".join(megatron_lines(gpu_lm, mtp=[gpu_mtp])) + "\n")
    return build_summary(npu, gpu, OPTIONS)[0]


def _curve(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return 7.0 * np.exp(-np.arange(n) / 40) + 3.0 + rng.normal(0, 0.02, n)


def test_step1_off_on_every_series_is_decided_at_step_1():
    gpu = _curve(1)
    decision = decide(_summary(gpu * 1.03, gpu, gpu * 1.02, gpu), total=200, mtp_expected=True)
    assert decision is not None and decision.rule == "step1" and decision.step == 1
    assert "lm_loss 3%" in decision.reason and "mtp_1_loss 2%" in decision.reason


def test_step1_off_on_one_series_only_is_left_open():
    gpu = _curve(3)
    assert decide(_summary(gpu * 1.03, gpu, gpu, gpu), total=200, mtp_expected=True) is None
    # the model has MTP: the lm loss alone, before any MTP loss is compared, decides nothing either
    lm_only = build_summary(parse_log_text(Path("n"), "\n".join(mindformers_lines(gpu * 1.03)) + "\n"),
                            parse_log_text(Path("g"), "\n".join(megatron_lines(gpu)) + "\n"), OPTIONS)[0]
    assert decide(lm_only, total=200, mtp_expected=True) is None


def test_nan_on_one_side_is_decided():
    gpu = _curve(4)
    npu = gpu.copy()
    npu[2] = np.nan
    decision = decide(_summary(npu, gpu, gpu, gpu), total=200, mtp_expected=True)
    assert decision is not None and decision.rule == "nan" and "npu (pynative-train) at step 3" in decision.reason


def test_mean_is_decided_once_no_remaining_step_can_bring_it_back():
    """Step 1 within its limit, then 5% per step; over 50 steps the mean reaches 1% for certain once
    0.4% + 5% x (k - 1) >= 50 x 1%, at k = 11 and not before."""
    gpu = _curve(11)
    factors = np.array([1.004] + [1.05] * 10)
    mtp = gpu * 1.0001
    assert decide(_summary(gpu[:10] * factors[:10], gpu[:10], mtp[:10], gpu[:10]), total=50,
                  mtp_expected=True) is None
    decision = decide(_summary(gpu * factors, gpu, mtp, gpu), total=50, mtp_expected=True)
    assert decision is not None and decision.rule == "mean" and decision.step == 11
    assert "lm_loss" in decision.reason and "over all 50 steps" in decision.reason


# ---- end to end, embedded ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedded(tmp_path_factory, prefect_server):
    """The embedded CLI's environment, recording its flow runs on the session's Prefect server."""
    root = tmp_path_factory.mktemp("live")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(root / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1",
               CROSSALIGN_SITE=str(root / "no-site.yaml"), PREFECT_API_URL=prefect_server.api_url)
    (root / "no-site.yaml").write_text("{}\n")
    return {"root": root, "store": root / "store", "env": env}


def _sets(overrides: list[str]) -> list[str]:
    return [arg for override in overrides for arg in ("--set", override)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")


def _flow_run_of(prefect_server, run_id: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}), get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=run_id)))
        return next((r for r in runs if r.name == run_id), None)


def _artifacts(prefect_server, flow_run_id) -> dict[str, object]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}), get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
            any_=[flow_run_id])))
    keys = [a.key for a in found if a.key]
    assert len(keys) == len(set(keys)), f"one artifact per key, updated in place: {keys}"
    return {a.key: a for a in found}


@pytest.mark.slow
def test_a_conversion_fault_stops_a_200_step_run_within_its_first_steps(embedded, prefect_server):
    from crossalign.stop import kept_log_path, read_stop

    overrides = [*TINY, "training.train_iters=200"]
    run = faulty_run(embedded, "fault", overrides, FAULT, RUN_TIMEOUT_S)
    started = time.monotonic()
    proc = subprocess.Popen([CROSSALIGN, "run", "qwen35_dense_tiny", "--store", str(run.store.root), "--run-id",
                             "fault", *_sets(overrides)], env=embedded["env"], cwd=embedded["root"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pids: set[int] = set()
    while proc.poll() is None and time.monotonic() - started < RUN_TIMEOUT_S:
        for step in ("megatron-train", "pynative-train"):
            attempt = run.attempt(step)
            if attempt and attempt.get("status") == "running":
                pids.add(int(attempt["pid"]))
        time.sleep(0.1)
    output, _ = proc.communicate(timeout=60)
    seconds = time.monotonic() - started

    assert proc.returncode == 1, output
    assert "verdict: fail" in output and "stopped early at step 1 of 200" in output, output
    assert "step-1 relative error >= 0.5% on every series" in output
    assert len(pids) == 2 and not [pid for pid in pids if _alive(pid)], "both training processes ended"
    stop = read_stop(run)
    trained = {step: s["trained_steps"] for step, s in stop["stopped"].items()}
    assert all(1 <= n <= 10 for n in trained.values()), trained
    assert stop["steps_saved"] == 400 - sum(trained.values()) and stop["card_hours_saved"] > 0
    for step, n in trained.items():  # what each side logged is kept, where the report links it
        kept = kept_log_path(run, step).read_text()
        assert kept.count("lm loss:" if step == "megatron-train" else "mtp_1_loss") == n, step
        assert not run.is_done(step) and run.attempt(step)["status"] == "failed"
        assert "stopped early" in run.attempt(step)["error"]
    assert not run.is_done("compare")
    summary = json.loads((run.path / "live" / "summary.json").read_text())
    assert summary["verdict"] == "fail" and summary["reasons"][0].startswith("stopped early at step 1 of 200")
    report = (run.path / "live" / "report.md").read_text()
    assert "stopped early" in report and "megatron-train.log" in report
    assert list(run.path.glob(".*partial*")) == [], "no staging folder left behind"

    parent = _flow_run_of(prefect_server, "fault")
    assert parent.state.is_failed() and "stopped early" in parent.state.message
    live = _artifacts(prefect_server, parent.id)["live-alignment"]
    assert "cannot pass" in live.data and "| lm_loss | 1 |" in live.data
    print(f"\nfail-fast: stopped after {trained} steps, {stop['stopped_in_s']} s after the stop request; "
          f"the whole CLI run took {seconds:.0f} s")


@pytest.mark.slow
def test_the_live_artifact_is_updated_in_place_while_both_sides_train(embedded, prefect_server):
    """A good run: the artifact appears once both logged step 1 and changes while the trainings still go on."""
    from crossalign.store import RunStore

    overrides = [*TINY, "training.train_iters=16"]
    store = RunStore(embedded["store"])
    proc = subprocess.Popen([CROSSALIGN, "run", "qwen35_dense_tiny", "--store", str(store.root), "--run-id", "good",
                             *_sets(overrides)], env=embedded["env"], cwd=embedded["root"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen_while_training: list[str] = []
    parent = None
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline:
        training = store.exists("good") and any(
            (store.run("good").attempt(step) or {}).get("status") == "running"
            for step in ("megatron-train", "pynative-train"))
        parent = parent or _flow_run_of(prefect_server, "good")
        if training and parent is not None:
            live = _artifacts(prefect_server, parent.id).get("live-alignment")
            if live is not None and (not seen_while_training or seen_while_training[-1] != live.data):
                seen_while_training.append(live.data)
        time.sleep(0.3)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode in (0, 1, 2) and "stopped early" not in output, output
    assert store.run("good").is_done("compare"), output
    assert len(seen_while_training) >= 2, seen_while_training
    final = _artifacts(prefect_server, parent.id)["live-alignment"]
    assert "steps 1-16 of 16 compared" in final.data and final.updated > final.created
