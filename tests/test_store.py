"""The run store: atomic step commits, digest-checked completion, invalidation, killed writers."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from crossalign.config import load_config
from crossalign.dag import STEP_NAMES, UnknownStep, downstream, step_spec
from crossalign.data.files import DatasetFiles
from crossalign.store import (
    MANIFEST,
    RunStore,
    StaleInputs,
    StepNotReady,
    StoreError,
    dataset_fingerprint,
    is_new_run_id,
    new_run_id,
    sha256_file,
)


def _dataset(folder: Path) -> DatasetFiles:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corpus.bin").write_bytes(bytes(range(256)) * 8)
    (folder / "corpus.idx").write_bytes(b"MMIDIDX\x00\x00" + bytes(40))
    (folder / "tokenizer.json").write_text('{"model": "bpe"}')
    return DatasetFiles(prefix=folder / "corpus", tokenizer=folder / "tokenizer.json")


def _new_run(tmp_path: Path, run_id: str = "r1"):
    store = RunStore(tmp_path / "store")
    run = store.create_run(run_id, load_config("qwen35_dense_tiny"), config_source="qwen35_dense_tiny",
                           parameters={}, code_version={"crossalign": "test"})
    data = _dataset(tmp_path / "data")
    run.update_info(dataset={"prefix": str(data.prefix), "tokenizer": str(data.tokenizer),
                             "fingerprint": dataset_fingerprint(data)})
    return store, run


def _commit(run, step: str, payload: str = "weights") -> dict:
    with run.commit(step, command=f"make {step}") as out:
        (out.dir / "sub").mkdir()
        (out.dir / "sub" / "out.bin").write_text(payload)
        out.details["note"] = payload
    return run.manifest(step)


def test_dag_order_and_downstream():
    assert STEP_NAMES == ("base-train", "cast-bf16", "convert", "megatron-train", "pynative-train", "compare")
    assert [step_spec(s).pool for s in STEP_NAMES] == ["npu", "cpu", "cpu", "gpu", "npu", "cpu"]
    assert step_spec("03-convert").name == "convert"
    assert downstream("convert") == ["convert", "megatron-train", "compare"]
    assert downstream("cast-bf16") == ["cast-bf16", "convert", "megatron-train", "pynative-train", "compare"]
    assert downstream("compare") == ["compare"]
    with pytest.raises(UnknownStep, match="unknown step 'convrt'.*base-train"):
        step_spec("convrt")


def test_commit_writes_manifest_with_digests_of_every_output(tmp_path):
    store, run = _new_run(tmp_path)
    manifest = _commit(run, "base-train")
    folder = run.step_dir("base-train")
    assert folder.name == "01-base-train"
    assert manifest["status"] == "done" and manifest["command"] == "make base-train"
    assert manifest["details"] == {"note": "weights"}
    assert manifest["outputs"] == [{"path": "sub/out.bin", "size": 7, "sha256": sha256_file(folder / "sub/out.bin")}]
    assert set(manifest["inputs"]) == {"config", "dataset"}
    assert manifest["host"] and manifest["seconds"] >= 0
    assert run.is_done("base-train")
    assert not list(run.path.glob(".*partial*")), "the staging folder must be renamed into place"
    assert run.state("base-train").status == "done"


def test_failed_step_leaves_nothing_and_records_whether_to_retry(tmp_path):
    store, run = _new_run(tmp_path)
    with pytest.raises(ValueError, match="bad checkpoint"):
        with run.commit("base-train", command="x") as out:
            (out.dir / "half.bin").write_text("half")
            raise ValueError("bad checkpoint")
    assert not run.step_dir("base-train").exists()
    assert not list(run.path.glob(".01-base-train*"))
    state = run.state("base-train")
    assert state.status == "failed"
    assert state.attempt["retryable"] is False and "bad checkpoint" in state.attempt["error"]

    with pytest.raises(OSError):
        with run.commit("base-train", command="x"):
            raise OSError(28, "No space left on device")
    assert run.state("base-train").attempt["retryable"] is True


def test_step_needs_its_inputs_done(tmp_path):
    store, run = _new_run(tmp_path)
    with pytest.raises(StepNotReady, match="convert needs cast-bf16"):
        with run.commit("convert", command="x"):
            pass
    assert not run.step_dir("convert").exists()
    assert run.state("convert").status == "pending"


def test_redoing_an_upstream_step_makes_downstream_stale(tmp_path):
    store, run = _new_run(tmp_path)
    for step in ("base-train", "cast-bf16", "convert"):
        _commit(run, step)
    assert all(run.is_done(s) for s in ("base-train", "cast-bf16", "convert"))
    before = run.manifest("convert")

    _commit(run, "cast-bf16", payload="other weights")  # a new cast: its manifest digest changes
    assert run.is_done("cast-bf16")
    assert not run.is_done("convert")
    assert run.state("convert").status == "stale"
    assert run.manifest("convert") == before, "stale outputs stay until the step is redone"

    _commit(run, "convert")
    assert run.is_done("convert")


def test_damaged_output_makes_the_step_not_done_and_its_consumer_not_ready(tmp_path):
    """Sizes are checked whenever completion is asked; a same-size change only with checksums (retry, rerun)."""
    store, run = _new_run(tmp_path)
    for step in ("base-train", "cast-bf16"):
        _commit(run, step)
    output = run.step_dir("cast-bf16") / "sub" / "out.bin"
    output.write_text("WEIGHTS")  # same size, other bytes
    assert run.is_done("cast-bf16"), "sizes alone cannot see a same-size change"
    assert not run.is_done("cast-bf16", checksums=True)
    assert run.damaged_outputs("cast-bf16", checksums=True) == ["sub/out.bin: sha256 differs from the manifest"]

    output.write_text("weights, truncated later")
    assert not run.is_done("cast-bf16")
    assert run.state("cast-bf16").status == "stale"
    assert run.damaged_outputs("cast-bf16") == ["sub/out.bin: 24 bytes, the manifest says 7"]
    with pytest.raises(StepNotReady, match="convert needs cast-bf16"):
        with run.commit("convert", command="x"):
            pass
    output.unlink()
    assert run.damaged_outputs("cast-bf16") == ["sub/out.bin: missing"]


def test_changed_dataset_makes_training_steps_stale(tmp_path):
    store, run = _new_run(tmp_path)
    _commit(run, "base-train")
    data = run.dataset
    Path(str(data.prefix) + ".idx").write_bytes(b"MMIDIDX\x00\x00" + bytes(41))
    run.update_info(dataset={**run.info["dataset"], "fingerprint": dataset_fingerprint(data)})
    assert not run.is_done("base-train")


def test_input_changing_during_the_step_is_refused(tmp_path):
    store, run = _new_run(tmp_path)
    _commit(run, "base-train")
    _commit(run, "cast-bf16")
    with pytest.raises(StaleInputs, match="changed while it ran"):
        with run.commit("convert", command="x") as out:
            (out.dir / "a").write_text("a")
            _commit(run, "cast-bf16", payload="redone meanwhile")
    assert not run.step_dir("convert").exists()


def test_invalidate_removes_the_step_and_everything_downstream(tmp_path):
    store, run = _new_run(tmp_path)
    for step in STEP_NAMES:
        _commit(run, step)
    removed = run.invalidate("convert")
    assert removed == ["convert", "megatron-train", "compare"]
    assert [s.status for s in run.states()] == ["done", "done", "pending", "pending", "done", "pending"]
    assert not list(run.path.glob(".*trash*"))


def test_killed_writer_leaves_no_complete_step_and_is_cleaned_up(tmp_path):
    """SIGKILL in the middle of writing outputs: the step is not done, and the next attempt starts clean."""
    store, run = _new_run(tmp_path)
    _commit(run, "base-train")
    script = textwrap.dedent(f"""
        import os, signal
        from crossalign.store import RunStore
        run = RunStore({str(store.root)!r}).run("r1")
        with run.commit("cast-bf16", command="killed") as out:
            (out.dir / "checkpoint.bin").write_bytes(b"x" * 1000)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    partials = list(run.path.glob(".02-cast-bf16.partial-*"))
    assert len(partials) == 1 and (partials[0] / "checkpoint.bin").exists()
    assert not run.is_done("cast-bf16")
    assert run.state("cast-bf16").status == "interrupted"

    _commit(run, "cast-bf16")
    assert run.is_done("cast-bf16")
    assert not list(run.path.glob(".02-cast-bf16.partial-*")), "the killed attempt's staging folder is removed"


def test_create_run_refuses_the_same_id_with_another_config(tmp_path):
    store, run = _new_run(tmp_path)
    assert store.create_run("r1", load_config("qwen35_dense_tiny"), config_source="x", parameters={},
                            code_version={}).run_id == "r1"
    with pytest.raises(StoreError, match="exists with a different config"):
        store.create_run("r1", load_config("qwen35_moe_tiny"), config_source="x", parameters={}, code_version={})
    assert [r.run_id for r in store.runs()] == ["r1"]
    info = json.loads((run.path / "run.json").read_text())
    assert info["config"]["model"]["name"] == "qwen35_dense_tiny" and info["code_version"] == {"crossalign": "test"}


@pytest.mark.parametrize("bad", ["", "../x", "a/b", ".hidden", "datasets", "with space"])
def test_bad_run_ids_are_refused(tmp_path, bad):
    with pytest.raises(StoreError, match="run id"):
        RunStore(tmp_path).create_run(bad, load_config("qwen35_dense_tiny"), config_source="x", parameters={},
                                      code_version={})


def test_missing_run_names_the_store(tmp_path):
    with pytest.raises(StoreError, match=f"no run 'nope' in {tmp_path}"):
        RunStore(tmp_path).run("nope")


def test_manifest_is_the_last_thing_written(tmp_path):
    """A step folder without manifest (e.g. copied by hand) is not done."""
    store, run = _new_run(tmp_path)
    _commit(run, "base-train")
    (run.step_dir("base-train") / MANIFEST).unlink()
    assert not run.is_done("base-train")
    assert os.path.isdir(run.step_dir("base-train"))


def _crossalign_in_a_terminal(args: list[str], columns: int) -> str:
    """What ``crossalign ARGS`` prints to a terminal of ``columns`` columns (a pseudo-terminal), its styles left out."""
    import fcntl
    import pty
    import re
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE")}
    process = subprocess.Popen([str(Path(sys.executable).with_name("crossalign")), *args], stdout=follower,
                               stderr=subprocess.PIPE, env={**env, "TERM": "xterm"})
    os.close(follower)
    output = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal's other end closed
            break
        if not chunk:
            break
        output += chunk
    assert process.wait(timeout=120) == 0, process.stderr.read()
    os.close(leader)
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", output.decode()).replace("\r", "")


def test_run_ids_started_in_the_same_second_differ_and_crossalign_runs_shows_them_whole(tmp_path):
    """Two runs started in the same second get their own ids (and folders); `crossalign runs` prints every id whole:
    in an 80-column terminal as a table, and to a pipe as one tab-separated line per run under a header line,
    nothing else."""
    import re

    config = load_config("qwen35_moe_tiny")
    ids = {new_run_id(config.model.name) for _ in range(50)}
    assert len(ids) == 50
    assert all(re.fullmatch(r"qwen35_moe_tiny-\d{8}-\d{6}-[0-9a-f]{4}", run_id) for run_id in ids), ids
    assert all(is_new_run_id(run_id) for run_id in ids) and not is_new_run_id("e2e-dense")
    store = RunStore(tmp_path / "store")
    shown = sorted(ids)[:3]
    for run_id in shown:
        store.create_run(run_id, config, config_source="qwen35_moe_tiny", parameters={}, code_version={})
    title, *table = _crossalign_in_a_terminal(["runs", "--store", str(store.root)], columns=80).splitlines()
    assert title == f"runs in {store.root}", "the store's path is printed whole (the terminal wraps it)"
    assert max(len(line) for line in table) <= 80
    assert all(any(run_id in line for line in table) for run_id in shown), table

    piped = subprocess.run([str(Path(sys.executable).with_name("crossalign")), "runs", "--store", str(store.root)],
                           capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0, piped.stderr
    header, *lines = piped.stdout.splitlines()
    assert header.split("\t") == ["run", "model", "created", "steps done", "state", "verdict"]
    assert [line.split("\t")[:2] for line in lines] == [[run_id, "qwen35_moe_tiny"] for run_id in shown], lines
    assert all(len(line.split("\t")) == 6 for line in lines)


def test_a_command_takes_a_run_by_its_id_or_by_its_folder(tmp_path, monkeypatch):
    """`status`, `rerun`, `rehearse`, `diagnose --run` and `run --run-id` take the run id (in --store, else the
    site's store) and the run's folder alike; a folder that is no run, or one outside the --store given, is refused
    naming it (exit 2)."""
    from typer.testing import CliRunner

    from crossalign.cli import app
    from crossalign.cli.runs import located_run, run_location

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CROSSALIGN_SITE", raising=False)
    monkeypatch.delenv("CROSSALIGN_STORE", raising=False)
    store = RunStore(tmp_path / "runs")
    config = load_config("qwen35_dense_tiny")
    store.create_run("r1", config, config_source="qwen35_dense_tiny", parameters={}, code_version={})
    assert located_run("r1", None).path == located_run("runs/r1", None).path == located_run(
        str(tmp_path / "runs" / "r1"), tmp_path / "runs").path == store.root / "r1"
    assert run_location("elsewhere/new-run", None) == (tmp_path / "elsewhere", "new-run"), "a new run's folder"
    runner = CliRunner()
    by_id, by_folder = (runner.invoke(app, ["status", run], env={"COLUMNS": "200"}) for run in ("r1", "runs/r1"))
    assert by_id.exit_code == by_folder.exit_code == 0 and by_id.output == by_folder.output, by_folder.output
    for args, said in ((["status", "runs/nope"], "no run 'nope' in"), (["status", "r1/"], "no run 'r1' in"),
                       (["status", "runs/r1", "--store", str(tmp_path / "other")], "is a run of the store"),
                       (["rerun", "runs/nope", "--step", "compare"], "no run 'nope' in"),
                       (["rehearse", "runs/nope", "--megatron", str(tmp_path)], "no run 'nope' in"),
                       (["diagnose", "--run", "nope"], "no run 'nope' in")):
        refused = runner.invoke(app, args, env={"COLUMNS": "200"})
        assert refused.exit_code == 2 and said in refused.output, (args, refused.output)
