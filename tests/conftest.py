"""Shared fixtures: a real Prefect server on a free loopback port, and process helpers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# pytest-xdist starts its workers with COLUMNS=80, which rich takes as a fixed width when the CLI's console is
# made; the CLI tests give their own width (CliRunner(env={"COLUMNS": ...})), as a terminal of that size would.
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)

from crossalign.agents.server import (ServerStartError, free_port, local_server, postgres_bindir,  # noqa: F401,E402
                                     stop_process)


def pynative_writing_pid(run_dir: Path) -> int | None:
    """The pid of the pynative-train step while it is writing its log into its staging folder, else None."""
    partials = list(run_dir.glob(".05-pynative-train.partial-*"))
    attempt = run_dir / ".attempts" / "pynative-train.json"
    if partials and (partials[0] / "train.log").exists() and (partials[0] / "train.log").stat().st_size \
            and attempt.exists():
        return json.loads(attempt.read_text())["pid"]
    return None


def training_writing_pid(run_dir: Path, step: str) -> int | None:
    """The pid of ``step``'s running attempt (the process that runs the step: in distributed mode, its flow run's
    process) once the training writes its log into that attempt's staging folder, else None."""
    from crossalign.dag import step_spec

    attempt_file = run_dir / ".attempts" / f"{step}.json"
    if not attempt_file.exists():
        return None
    attempt = json.loads(attempt_file.read_text())
    if attempt.get("status") != "running":
        return None
    staging = f".{step_spec(step).dirname}.partial-{attempt['host']}-{attempt['pid']}-*"
    if any((folder / "train.log").is_file() and (folder / "train.log").stat().st_size
           for folder in run_dir.glob(staging)):
        return int(attempt["pid"])
    return None


def training_processes(pid: int) -> list:
    """The process ``pid`` and every process it started (psutil.Process): a training of several ranks runs one
    process per rank beside the step's own (crossalign/sides/megatron/embedded/trainer.py, ``_train_ranks``)."""
    import psutil

    step = psutil.Process(pid)
    return [step, *step.children(recursive=True)]


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """A real ``prefect server`` on a free loopback port, without the scheduler, on PostgreSQL where it is
    installed as a site's server would be (else SQLite); see crossalign.agents.server."""
    database = "postgres" if postgres_bindir() is not None else "sqlite"
    try:
        with local_server(tmp_path_factory.mktemp("prefect-home"), database=database) as server:
            yield server
    except ServerStartError as exc:
        pytest.fail(str(exc))


@pytest.fixture
def prefect_client_settings(prefect_server):
    """Point this test process's Prefect client at the session server."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        yield prefect_server


@pytest.fixture(scope="module")
def one_torch_thread():
    """The test machine's cores are shared: one intra-op thread avoids OpenMP oversubscription stalls."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
