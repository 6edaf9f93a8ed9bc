"""Embedded mode end to end: `crossalign run` with Prefect's ephemeral API, a step SIGKILLed while it
writes (retried as an infrastructure failure), then re-runs that skip finished steps."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.processes import pynative_writing_pid
from crossalign.dag import STEP_NAMES
from crossalign.store import MANIFEST, RunStore, sha256_file

pytestmark = pytest.mark.slow

CROSSALIGN = str(Path(sys.executable).with_name("crossalign"))
# warmup below train_iters: Megatron's lr scheduler asserts lr_warmup_steps < lr_decay_steps (= train_iters);
# 20 steps: the fewest on which a pass can show that both runs move together (fewer is invalid)
TINY = ["--set", "training.base_train_iters=3", "--set", "training.train_iters=20", "--set", "training.lr_warmup_iters=2",
        "--set", "training.seq_length=64",
        "--set", "training.global_batch_size=2", "--set", "training.micro_batch_size=2"]
RUN_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    root = tmp_path_factory.mktemp("embedded")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(root / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1",
               CROSSALIGN_SITE=str(root / "no-site.yaml"))
    (root / "no-site.yaml").write_text("{}\n")
    return {"root": root, "store": root / "store", "env": env}


def _run(embedded, *args: str, timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([CROSSALIGN, *args], env=embedded["env"], cwd=embedded["root"], capture_output=True,
                          text=True, timeout=timeout)


def _wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"crossalign run ended ({proc.returncode}) before {what}:\n{proc.stdout.read()}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_killed_step_is_retried_and_nothing_partial_is_consumed(embedded):
    store = RunStore(embedded["store"])
    started = time.monotonic()
    proc = subprocess.Popen([CROSSALIGN, "run", "qwen35_dense_tiny", "--store", str(store.root), "--run-id", "k1",
                             "--retry-delay", "1", *TINY], env=embedded["env"], cwd=embedded["root"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_dir = store.root / "k1"

    pid = _wait_for(lambda: pynative_writing_pid(run_dir), RUN_TIMEOUT_S, "pynative-train writing its log", proc)
    os.kill(pid, signal.SIGKILL)
    output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    seconds = time.monotonic() - started
    assert proc.returncode == 0, output
    assert "pynative-train failed" in output and "killed by signal 9" in output
    assert "verdict: pass" in output and "report.html" in output

    run = store.run("k1")
    assert all(run.is_done(step) for step in STEP_NAMES)
    assert not list(run.path.glob(".*partial*")), "the killed attempt's staging folder must be gone"
    manifest = run.manifest("pynative-train")
    assert manifest["pid"] != pid, "the committed output comes from the retry, not the killed process"
    assert manifest["outputs"] and all(o["path"] != "" for o in manifest["outputs"])
    log = (run.path / "logs" / "pynative-train.log").read_text()
    assert log.count("step pynative-train done") == 1
    first = (run.step_dir("pynative-train") / "train.log").read_text().splitlines()[0]
    assert f" - mindformers{os.path.realpath(run.step_dir('pynative-train') / 'log')}[" in first, \
        "the logger prefix names the committed step folder, not its staging folder"
    summary = json.loads((run.step_dir("compare") / "summary.json").read_text())
    assert summary["verdict"] == "pass"
    # what the embedded fp32 run really achieves, not only a pass: step 1 under the gold standard,
    # a mean error under 1e-4, every one of the config's train_iters steps compared
    assert summary["gold_standard"] and summary["coverage"]["compared"] == summary["coverage"]["expected"] == 20
    for name in ("lm_loss", "mtp_1_loss"):
        assert summary["series"][name]["step1_rel_err"] < summary["criteria"]["gold_step1_rel_err_max"], name
        assert summary["series"][name]["mean_rel_err"] < 1e-4, name
    (embedded["root"] / "timings.json").write_text(json.dumps({"embedded_run_with_retry_s": round(seconds, 1)}))
    print(f"\nembedded run with one killed step: {seconds:.1f} s")


def test_same_run_id_skips_every_finished_step(embedded):
    run = RunStore(embedded["store"]).run("k1")
    if not run.is_done("compare"):
        pytest.skip("needs the finished run of the previous test")
    before = {step: run.manifest(step) for step in STEP_NAMES}
    done = _run(embedded, "run", "qwen35_dense_tiny", "--store", str(run.store.root), "--run-id", "k1", *TINY)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("already done, skipped") == 6
    assert {step: run.manifest(step) for step in STEP_NAMES} == before

    status = _run(embedded, "status", "k1", "--store", str(run.store.root), timeout=60)
    assert status.returncode == 0 and status.stdout.count(" done ") == 6 and "verdict: pass" in status.stdout
    runs = _run(embedded, "runs", "--store", str(run.store.root), timeout=60)
    assert "k1" in runs.stdout and "6/6" in runs.stdout


def test_failed_verdict_exits_1_without_retry_and_reruns_only_compare(embedded, prefect_server):
    """Also: with PREFECT_API_URL set, the embedded run is recorded on that server."""
    run = RunStore(embedded["store"]).run("k1")
    if not run.is_done("compare"):
        pytest.skip("needs the finished run of the previous test")
    gpu_log = run.step_dir("megatron-train") / "train.log"
    manifest_path = run.step_dir("megatron-train") / MANIFEST
    original, original_manifest = gpu_log.read_text(), manifest_path.read_text()
    # a Megatron log whose losses are 3% higher (what a broken conversion looks like to the comparator),
    # committed as if Megatron had written it: otherwise the rerun would see a damaged output and redo the step
    gpu_log.write_text(original.replace("lm loss: 7.", "lm loss: 7.2").replace("lm loss: 6.", "lm loss: 6.2"))
    manifest = json.loads(original_manifest)
    entry = next(o for o in manifest["outputs"] if o["path"] == "train.log")
    entry.update(size=gpu_log.stat().st_size, sha256=sha256_file(gpu_log))
    manifest_path.write_text(json.dumps(manifest))
    before = {step: run.manifest(step) for step in STEP_NAMES}
    try:
        failed = subprocess.run([CROSSALIGN, "rerun", "k1", "--step", "compare", "--store", str(run.store.root),
                                 "--retry-delay", "1"], env={**embedded["env"], "PREFECT_API_URL": prefect_server.api_url},
                                cwd=embedded["root"], capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        after = {step: run.manifest(step) for step in STEP_NAMES}
    finally:
        gpu_log.write_text(original)
        manifest_path.write_text(original_manifest)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "verdict: fail" in failed.stdout
    for step in STEP_NAMES[:-1]:
        assert after[step] == before[step], f"{step} must be skipped"
    assert run.manifest("compare")["details"]["verdict"] == "fail"
    assert (run.path / "logs" / "compare.log").read_text().count("step compare done") == 2, "no retry of a verdict"

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, TaskRunFilter, TaskRunFilterFlowRunId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}), get_client(sync_client=True) as client:
        # the rerun flow, named as the UI's rerun form names it
        flow_runs = [r for r in client.read_flow_runs(flow_run_filter=FlowRunFilter()) if r.name == "k1-rerun-compare"]
        assert flow_runs and flow_runs[0].parameters["step"] == "compare", [r.name for r in flow_runs]
        assert len(flow_runs) == 1 and flow_runs[0].state.is_failed()
        assert "verdict fail" in flow_runs[0].state.message and "lm_loss: step-1 rel err" in flow_runs[0].state.message
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterLevel

        errors = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_runs[0].id]),
                                                       level=LogFilterLevel(ge_=40)))
        assert not errors, "a failed verdict is an outcome, not an error: " + "; ".join(e.message[:200] for e in errors)
        tasks = client.read_task_runs(task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(
            any_=[flow_runs[0].id])))
        assert {t.name for t in tasks} >= {"prepare-run", "preflight", *STEP_NAMES}


def test_bad_input_exits_2(embedded):
    store = str(embedded["store"])
    unknown = _run(embedded, "run", "no_such_model", "--store", store, timeout=60)
    assert unknown.returncode == 2 and "no_such_model" in unknown.stderr
    bad_key = _run(embedded, "run", "qwen35_dense_tiny", "--store", store, "--set", "training.trian_iters=3",
                   timeout=60)
    assert bad_key.returncode == 2 and "training.trian_iters: unknown field" in bad_key.stderr
    bad_value = _run(embedded, "run", "qwen35_dense_tiny", "--store", store, "--set", "training.train_iters=0",
                     timeout=60)
    assert bad_value.returncode == 2 and "training.train_iters" in bad_value.stderr
    bad_step = _run(embedded, "rerun", "k1", "--step", "convrt", "--store", store, timeout=60)
    assert bad_step.returncode == 2 and "unknown step 'convrt'" in bad_step.stderr
    if RunStore(store).exists("k1"):
        clash = _run(embedded, "run", "qwen35_moe_tiny", "--store", store, "--run-id", "k1")
        assert clash.returncode == 2 and "exists with a different config" in clash.stderr


def test_the_flow_takes_the_request_its_caller_resolved(prefect_client_settings, tmp_path, monkeypatch):
    """The alignment flow, called as the CLI calls it, freezes the config its caller resolved into run.json without
    loading the config again (the request's dataset is missing, so the run ends right after run.json is written,
    refused as bad input)."""
    import crossalign.request
    from crossalign.flows.alignment import alignment
    from crossalign.flows.outcome import outcome_of
    from crossalign.request import RunRequest, handing_over
    from crossalign.store import StoreError

    missing = tmp_path / "no-dataset"
    resolved = RunRequest(config="qwen35_dense_tiny", run_id="handed", store=str(tmp_path / "store"),
                          mode="embedded", overrides=["training.train_iters=30"],
                          dataset_prefix=str(missing / "corpus"), tokenizer=str(missing / "tokenizer.json")).resolve()
    loads = []
    monkeypatch.setattr(crossalign.request, "load_config", lambda *args: loads.append(args))
    with handing_over(resolved):
        state = alignment(**resolved.request.form(), return_state=True)
    assert state.is_failed() and not loads, loads
    _, error = outcome_of(state)
    assert isinstance(error, StoreError) and "dataset file" in str(error), error
    run = RunStore(tmp_path / "store").run("handed")
    assert run.info["config"] == resolved.config.model_dump(mode="json") and run.config.training.train_iters == 30


def test_the_readme_commands_on_a_finished_run_run_as_written(embedded):
    """The README's commands that take a finished run, as written, in a folder whose runs/ is the store (RUN: k1):
    diagnose of its checkpoints; `rerun runs/RUN --step megatron-train --dump`, which trains megatron-core again
    under msprobe's PrecisionDebugger (the step's outputs and manifest hold the dump, the numbers are unchanged),
    the same for pynative-train; then diagnose of the two dumps. Refused: a dump of a rerun that trains nothing,
    an unknown dump task."""
    from crossalign.diagnose.msprobe_dump import read_dump
    from helpers.readme import RUN_COMMANDS

    run = RunStore(embedded["store"]).run("k1")
    if not all(run.is_done(step) for step in ("convert", "megatron-train", "pynative-train")):
        pytest.skip("needs the run of the first test")  # its compare may be stale: the commands redo it
    store = str(run.store.root)
    (embedded["root"] / "runs").unlink(missing_ok=True)
    (embedded["root"] / "runs").symlink_to(run.store.root)
    before = run.manifest("pynative-train")
    log_before = (run.step_dir("megatron-train") / "train.log").read_text()
    not_training = _run(embedded, "rerun", "runs/k1", "--step", "compare", "--dump", timeout=60)
    assert not_training.returncode == 2 and "trains neither megatron-train nor pynative-train" in not_training.stderr
    bad_task = _run(embedded, "rerun", "k1", "--step", "megatron-train", "--dump", "--dump-task", "tensors",
                    "--store", store, timeout=60)
    assert bad_task.returncode == 2 and "--dump-task: Input should be 'statistics', 'md5' or 'tensor'" in bad_task.stderr
    assert run.dump_request("megatron-train") is None  # refused: nothing recorded

    checkpoints, megatron_dump, pynative_dump, dumps = (
        _run(embedded, *shlex.split(command.replace("qwen35_dense_tiny-20261129-171129", "k1")
                                    .replace("RUN", "k1"))[1:]) for command in RUN_COMMANDS)
    assert checkpoints.returncode == 0, checkpoints.stdout[-3000:] + checkpoints.stderr
    assert megatron_dump.returncode == 0, megatron_dump.stdout + megatron_dump.stderr
    assert "megatron-train will dump iteration 0 with msprobe (L0, statistics)" in megatron_dump.stdout
    assert pynative_dump.returncode == 0, pynative_dump.stdout + pynative_dump.stderr
    assert dumps.returncode == 0, dumps.stdout[-3000:] + dumps.stderr
    assert (run.path / "diagnose" / "msprobe_summary.json").is_file(), dumps.stdout[-3000:]

    for step, framework in (("megatron-train", "pytorch"), ("pynative-train", "mindspore")):
        details = run.manifest(step)["details"]["msprobe_dump"]
        assert details["folder"] == "msprobe_dump" and details["step"] == 0 and details["rank_folders"] == ["rank0"]
        outputs = {entry["path"] for entry in run.manifest(step)["outputs"]}
        assert {"msprobe_config.json", "msprobe_dump/step0/rank0/dump.json"} <= outputs
        dump = read_dump(run.step_dir(step) / "msprobe_dump")
        assert (dump.framework, dump.step, sorted(dump.ranks)) == (framework, 0, [0])
        record = json.loads((dump.ranks[0].path / "crossalign_dump.json").read_text())  # which run wrote the dump
        side = "megatron" if framework == "pytorch" else "mindformers"
        assert (record["run_id"], record["step"], record["side"], record["rank"]) == ("k1", 0, side, 0)
        assert record["config_digest"] == run.config.digest()
    entries = read_dump(run.step_dir("megatron-train") / "msprobe_dump").ranks[0].entries
    assert any(key.startswith("Module.0.module.decoder.layers.0.") for key in entries)
    assert run.manifest("pynative-train")["pid"] != before["pid"], "redone by the second rerun"

    def losses(text: str) -> list[float]:
        return [float(part.split(" | ")[0]) for part in text.split("lm loss: ")[1:]]
    # msprobe only reads the tensors: the same losses to Megatron's print precision (one unit of %E at ~7)
    again, before_losses = losses((run.step_dir("megatron-train") / "train.log").read_text()), losses(log_before)
    assert len(again) == len(before_losses) == 20
    assert max(abs(a - b) for a, b in zip(again, before_losses)) <= 1.5e-6
