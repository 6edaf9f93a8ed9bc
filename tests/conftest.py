"""Shared fixtures: a real Prefect server on a free loopback port, and process helpers."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

SERVER_START_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pynative_writing_pid(run_dir: Path) -> int | None:
    """The pid of the pynative-train step while it is writing its log into its staging folder, else None."""
    partials = list(run_dir.glob(".05-pynative-train.partial-*"))
    attempt = run_dir / ".attempts" / "pynative-train.json"
    if partials and (partials[0] / "train.log").exists() and (partials[0] / "train.log").stat().st_size \
            and attempt.exists():
        return json.loads(attempt.read_text())["pid"]
    return None


def stop_process(proc: subprocess.Popen, timeout: float = 20) -> None:
    """SIGTERM, then SIGKILL if it does not exit in time."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


@dataclass
class PrefectServer:
    api_url: str
    home: Path
    env: dict[str, str]  # environment for processes that talk to this server (workers, CLI)


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """``prefect server start`` on a free loopback port with its own PREFECT_HOME; no telemetry, 1 s worker polls."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": api_url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        # prefect.yaml's nightly cron must not start a real nightly in the middle of a test run
        # (it did, at 02:00 Asia/Shanghai, and held the nightly's only concurrency slot)
        "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false",
        "PREFECT_WORKER_PREFETCH_SECONDS": "1",
        "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
    }
    log = open(home / "server.log", "w")
    # SQLite on a busy 2-core machine: wait for the database lock instead of answering 503
    server_env = {**{k: v for k, v in env.items() if k != "PREFECT_API_URL"},
                  "PREFECT_SERVER_DATABASE_TIMEOUT": "60", "PREFECT_SERVER_DATABASE_CONNECTION_TIMEOUT": "60"}
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                             "--port", str(port)], env=server_env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc)
            pytest.fail(f"prefect server did not start; log:\n{(home / 'server.log').read_text()[-3000:]}")
        time.sleep(0.5)
    try:
        yield PrefectServer(api_url=api_url, home=home, env=env)
    finally:
        stop_process(proc)
        log.close()


@pytest.fixture
def prefect_client_settings(prefect_server):
    """Point this test process's Prefect client at the session server."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        yield prefect_server
