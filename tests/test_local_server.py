"""`crossalign server start`: the Prefect server on PostgreSQL with basic auth, and agents that stop on SIGTERM."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from crossalign.agents.server import free_port, local_server, postgres_bindir, stop_process

CROSSALIGN = str(Path(sys.executable).with_name("crossalign"))

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(postgres_bindir() is None, reason="PostgreSQL is not installed (scripts/setup.sh --dev)")]


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _wait(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
            raise AssertionError(f"{what}: not within {timeout} s" + (f"\n{log.read_text()[-3000:]}" if log else ""))
        time.sleep(0.5)


def _start_server(args: list[str], env: dict[str, str], log: Path, port: int) -> subprocess.Popen:
    """`crossalign server start` in the background, once it says it is up (and is)."""
    ups = log.read_text().count("Prefect server up") if log.exists() else 0
    with open(log, "a") as out:
        proc = subprocess.Popen([CROSSALIGN, "server", "start", *args], env=env, stdout=out, stderr=subprocess.STDOUT)
    _wait(lambda: log.read_text().count("Prefect server up") > ups and _healthy(port), 180,
          "crossalign server start", proc, log)
    return proc


def test_server_start_refuses_to_listen_beyond_loopback_without_basic_auth(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    done = subprocess.run([CROSSALIGN, "server", "start", "--host", "0.0.0.0", "--port", str(free_port()),
                           "--data", str(tmp_path / "server")], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "PREFECT_SERVER_API_AUTH_STRING" in done.stderr and "--insecure" in done.stderr
    assert not (tmp_path / "server").exists(), "nothing is started or written"


def test_server_start_beyond_loopback_refuses_to_hand_out_a_loopback_address(tmp_path):
    """Agents on other machines would be sent to themselves: an explicit loopback --url, or this host's
    name where it resolves to loopback, is refused with the advice to pass --url; nothing is started."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    port = free_port()
    base = [CROSSALIGN, "server", "start", "--host", "0.0.0.0", "--port", str(port), "--insecure",
            "--data", str(tmp_path / "server")]
    given = subprocess.run([*base, "--url", f"http://localhost:{port}"], env=env, capture_output=True, text=True,
                           timeout=120)
    assert given.returncode == 2, given.stdout + given.stderr
    assert "loopback" in given.stderr and "--url http://ADDRESS" in given.stderr
    assert "PREFECT_API_URL" not in given.stdout and not (tmp_path / "server").exists() and not _port_open(port)
    fqdn = socket.getfqdn()
    if all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(fqdn, None)):
        derived = subprocess.run(base, env=env, capture_output=True, text=True, timeout=120)
        assert derived.returncode == 2 and f"http://{fqdn}:{port}" in derived.stderr, derived.stdout + derived.stderr


def test_server_start_with_basic_auth_survives_a_restart_and_crossalign_down_ends_what_the_site_started(tmp_path):
    """`crossalign server start` on its own PostgreSQL cluster, kept in the site's folder on this machine (no
    --data), with basic auth and a public UI address; an agent that finds the server through its site file; the
    server restarted (its data kept); the report server started; then `crossalign down` ends the agent and its
    worker (within 10 s), the report server, the server and its PostgreSQL, and says so; the data stays."""
    import psutil
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from crossalign.site import site_home

    port, auth = free_port(), "admin:s3cret"
    site = tmp_path / "checkout" / "crossalign.site.yaml"
    site.parent.mkdir()
    (tmp_path / "store").mkdir()
    site.write_text(f"store: {tmp_path / 'store'}\nprefect_api_url: http://127.0.0.1:{port}/api\n")
    data = site_home(site) / "server"  # CROSSALIGN_HOME: the tests' own (conftest.py)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    server_args = ["--port", str(port), "--site", str(site), "--url", f"http://localhost:{port}"]
    server_env = {**env, "PREFECT_SERVER_API_AUTH_STRING": auth}
    server = _start_server(server_args, server_env, tmp_path / "server.out", port)
    agent = reports = None
    try:
        printed = (tmp_path / "server.out").read_text()
        assert f"export PREFECT_API_URL=http://localhost:{port}/api" in printed, printed
        assert f"data {data};" in printed and "`crossalign down` ends it" in printed, printed
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ui-settings", timeout=10) as response:
            ui = json.loads(response.read())
        assert ui["api_url"] == f"http://localhost:{port}/api" and ui["auth"] == "BASIC"
        request = urllib.request.Request(f"http://127.0.0.1:{port}/api/work_pools/filter", data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 401, "a request without credentials is refused"
        assert (data / "postgres" / "data" / "PG_VERSION").is_file() and not list(data.rglob("*.db")), \
            "the database is PostgreSQL, not SQLite, in the site's folder"

        with open(tmp_path / "agent.out", "w") as out:  # no PREFECT_API_URL: the site file names the server
            agent = subprocess.Popen([CROSSALIGN, "agent", "start", "--pool", "cpu", "--site", str(site),
                                      "--name", "restart-cpu"], env={**env, "PREFECT_API_AUTH_STRING": auth},
                                     stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
        settings = {PREFECT_API_URL: f"http://127.0.0.1:{port}/api", PREFECT_API_AUTH_STRING: auth}

        def worker_registered() -> bool:
            with temporary_settings(settings), get_client(sync_client=True) as client:
                try:
                    return any(w.name == "restart-cpu" for w in client.read_workers_for_work_pool("cpu"))
                except Exception:
                    return False

        _wait(worker_registered, 180, "the agent's worker", agent, tmp_path / "agent.out")
        worker = psutil.Process(agent.pid).children()
        assert len(worker) == 1 and "worker" in worker[0].cmdline(), [w.cmdline() for w in worker]

        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 128 + signal.SIGTERM
        assert not _port_open(port) and not (data / "postgres" / "data" / "postmaster.pid").exists()
        server = _start_server(server_args, server_env, tmp_path / "server.out", port)
        with temporary_settings(settings), get_client(sync_client=True) as client:
            assert client.read_work_pool("cpu").name == "cpu", "the data survives the restart"
        report_port = free_port()
        with open(tmp_path / "serve.out", "w") as out:  # in the checkout, as the recipe runs it
            reports = subprocess.Popen([CROSSALIGN, "serve", "--port", str(report_port)], env=env, stdout=out,
                                       stderr=subprocess.STDOUT, cwd=site.parent)
        _wait(lambda: _port_open(report_port), 120, "crossalign serve", reports, tmp_path / "serve.out")
        time.sleep(3)  # the worker polls the restarted server

        started = time.monotonic()
        down = subprocess.Popen([CROSSALIGN, "down"], env=env, cwd=site.parent, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        agent.wait(timeout=60)  # the agent goes first
        stopped_in = time.monotonic() - started  # the start of `crossalign down` included
        out, err = down.communicate(timeout=180)
        assert down.returncode == 0, out + err
        assert stopped_in < 10, f"the agent took {stopped_in:.1f} s to stop"
        said = out.splitlines()
        assert len(said) == 3 and said[0].startswith(f"ended agent cpu (pid {agent.pid})"), said
        assert "with what it had started (pid" in said[0] and str(worker[0].pid) in said[0], said
        assert said[1].startswith(f"ended the report server (pid {reports.pid}, http://127.0.0.1:{report_port}/)")
        assert said[2].startswith(f"ended the Prefect server (pid {server.pid}, http://localhost:{port})"), said
        assert said[2].endswith(f"its PostgreSQL ({data / 'postgres'}) is stopped"), said
        assert agent.returncode == 128 + signal.SIGTERM
        assert not worker[0].is_running() or worker[0].status() == psutil.STATUS_ZOMBIE, "the worker is gone too"
        assert reports.wait(timeout=5) is not None and server.wait(timeout=5) == 128 + signal.SIGTERM
        assert not _port_open(port) and not _port_open(report_port)
        assert not (data / "postgres" / "data" / "postmaster.pid").exists() and \
            (data / "postgres" / "data" / "PG_VERSION").is_file(), "PostgreSQL is stopped, its data kept"
        again = subprocess.run([CROSSALIGN, "down", "--site", str(site)], env=env, capture_output=True, text=True,
                               timeout=60)
        assert again.returncode == 0 and again.stdout.startswith(f"nothing of the site {site} runs"), again.stdout
    finally:
        for process in (agent, reports):
            if process is not None:
                stop_process(process)
        stop_process(server, timeout=60)


def test_an_unknown_database_is_refused(tmp_path):
    with pytest.raises(ValueError, match="sqlite or postgres"):
        with local_server(tmp_path, database="mysql"):  # type: ignore[arg-type]
            pass
