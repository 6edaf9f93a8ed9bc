"""A Prefect server on a free loopback port with its own PREFECT_HOME: for tests and benchmarks of distributed mode.

A site runs its own server (``prefect server start`` on PostgreSQL, or Prefect Cloud); this one
lives as long as the ``with`` block and leaves nothing behind but its home folder. Its database is
SQLite in the home folder, or a private PostgreSQL cluster: with several workers polling, SQLite
answers some writes with "database is locked", and Prefect's client waits 2 s, then 4 s, before it
tries again, which is how a site's server should not be run.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal

Database = Literal["sqlite", "postgres"]

START_TIMEOUT_S = 120


@dataclass(frozen=True)
class LocalServer:
    api_url: str
    home: Path
    env: dict[str, str]  # the environment for processes that talk to this server (agents, CLI, clients)
    database_url: str | None = None  # the PostgreSQL database, or None for SQLite in home


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


class ServerStartError(RuntimeError):
    pass


def postgres_bindir() -> Path | None:
    """The folder of PostgreSQL's initdb/pg_ctl/createdb (``pg_config --bindir``, else the newest Debian one)."""
    pg_config = shutil.which("pg_config")
    if pg_config:
        found = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True)
        if found.returncode == 0 and (Path(found.stdout.strip()) / "initdb").exists():
            return Path(found.stdout.strip())
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name)
                      if p.parent.parent.name.isdigit() else 0)
    return versions[-1].parent if versions else None


@contextmanager
def local_postgres() -> Iterator[str]:
    """A throwaway PostgreSQL cluster on a free loopback port; yields Prefect's connection URL for it.

    PostgreSQL refuses to run as root, so a root caller runs it as the ``postgres`` user, in a
    folder of its own under the system's temporary directory.
    """
    bindir = postgres_bindir()
    if bindir is None:
        raise ServerStartError("PostgreSQL is not installed (no pg_config, no /usr/lib/postgresql/*/bin/initdb); "
                               "on Debian: apt-get install postgresql")
    folder = Path(tempfile.mkdtemp(prefix="crossalign-postgres-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        owner = pwd.getpwnam("postgres")
        os.chown(folder, owner.pw_uid, owner.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    port, data, log = free_port(), folder / "data", folder / "postgres.log"

    def run(*argv: str) -> None:
        done = subprocess.run([*as_user, *argv], capture_output=True, text=True, cwd=folder)
        if done.returncode != 0:
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise ServerStartError(f"{Path(argv[0]).name} failed ({done.returncode}): "
                                   f"{(done.stderr or done.stdout).strip()[-2000:]}\n{tail}")

    try:
        run(str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "prefect", "--no-sync")
        run(str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-o",
            f"-p {port} -k {folder} -c listen_addresses=127.0.0.1", "start")
        try:
            run(str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "prefect", "prefect")
            yield f"postgresql+asyncpg://prefect@127.0.0.1:{port}/prefect"
        finally:
            subprocess.run([*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "stop"],
                           capture_output=True, cwd=folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def local_server(home: Path, *, scheduler: bool = False, database: Database = "sqlite") -> Iterator[LocalServer]:
    """``prefect server start`` on 127.0.0.1 with ``home`` as PREFECT_HOME, without telemetry.

    ``scheduler`` off keeps prefect.yaml's nightly cron from starting a real nightly while the
    block runs; ``database`` is SQLite in ``home`` or a private PostgreSQL cluster. Raises
    ServerStartError with the end of the server log if it does not come up.
    """
    if database not in ("sqlite", "postgres"):
        raise ValueError(f"database {database!r}: sqlite or postgres")
    with (local_postgres() if database == "postgres" else nullcontext(None)) as database_url:
        with _server(home, scheduler, database_url) as server:
            yield server


@contextmanager
def _server(home: Path, scheduler: bool, database_url: str | None) -> Iterator[LocalServer]:
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": api_url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "true" if scheduler else "false",
        "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
    }
    # SQLite on a busy 2-core machine: wait for the database lock instead of answering 503
    server_env = {**{k: v for k, v in env.items() if k != "PREFECT_API_URL"},
                  "PREFECT_SERVER_DATABASE_TIMEOUT": "60", "PREFECT_SERVER_DATABASE_CONNECTION_TIMEOUT": "60"}
    if database_url is not None:
        server_env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = database_url
    log_path = home / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                 "--port", str(port)], env=server_env, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(api_url, proc, log_path)
            yield LocalServer(api_url=api_url, home=home, env=env, database_url=database_url)
        finally:
            stop_process(proc)


def _wait_healthy(api_url: str, proc: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise ServerStartError(f"prefect server at {api_url} did not start; end of {log_path}:\n"
                                   f"{log_path.read_text()[-3000:]}")
        time.sleep(0.5)


@contextmanager
def local_agents(env: dict[str, str], site_file: Path, log_dir: Path,
                 pools: tuple[str, ...] = ("orchestrator", "npu", "cpu", "gpu")) -> Iterator[list[subprocess.Popen]]:
    """One ``crossalign agent start --pool P`` per pool on this machine, logging to ``log_dir/worker-P.log``.

    The agents go (SIGTERM, then SIGKILL) when the block ends; stop them before the server.
    """
    crossalign = str(Path(sys.executable).with_name("crossalign"))
    log_dir.mkdir(parents=True, exist_ok=True)
    agents: list[subprocess.Popen] = []
    try:
        for pool in pools:
            with open(log_dir / f"worker-{pool}.log", "w") as log:  # the child keeps its own descriptor
                agents.append(subprocess.Popen(
                    [crossalign, "agent", "start", "--pool", pool, "--site", str(site_file), "--name", f"local-{pool}"],
                    env=env, stdout=log, stderr=subprocess.STDOUT, cwd=log_dir))
        yield agents
    finally:
        for agent in agents:
            stop_process(agent)
