"""A Prefect server with its own PREFECT_HOME: ``crossalign server start``, and the tests and benchmarks.

The server lives as long as the ``with`` block. Its database is SQLite in the home folder, a
PostgreSQL cluster of its own (thrown away with the block, or kept in a folder), or the site's
PostgreSQL: with several workers polling, SQLite answers some writes with "database is locked",
and Prefect's client waits 2 s, then 4 s, before it tries again, which is how a site's server
should not be run. The server is told its public address (``PREFECT_UI_API_URL``,
``PREFECT_UI_URL``), so that a browser on another machine reaches its API and alerts link to it.
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
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal

Database = Literal["sqlite", "postgres"]

START_TIMEOUT_S = 120
LOOPBACK = ("127.0.0.1", "localhost", "::1")
AUTH_ENV = "PREFECT_SERVER_API_AUTH_STRING"  # user:password the server asks for (Prefect's basic auth)
CLIENT_AUTH_ENV = "PREFECT_API_AUTH_STRING"  # the same, sent by agents and the CLI


@dataclass(frozen=True)
class LocalServer:
    api_url: str
    home: Path
    env: dict[str, str]  # the environment for processes that talk to this server (agents, CLI, clients)
    database_url: str | None = None  # the PostgreSQL database, or None for SQLite in home
    ui_url: str = ""  # the address browsers and alert links use
    process: subprocess.Popen | None = None


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


def _postgres_user() -> list[str]:
    """The command prefix that runs PostgreSQL's tools: as the ``postgres`` user for root, which PostgreSQL refuses."""
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


def stop_postgres(folder: Path) -> None:
    """Stop the cluster ``local_postgres`` keeps in ``folder`` (its ``data`` folder); raises ServerStartError with
    pg_ctl's words when it cannot."""
    bindir = postgres_bindir()
    if bindir is None:
        raise ServerStartError("PostgreSQL is not installed: no pg_ctl to stop it with")
    done = subprocess.run([*_postgres_user(), str(bindir / "pg_ctl"), "-D", str(Path(folder) / "data"), "-m", "fast",
                           "stop"], capture_output=True, text=True, cwd=folder)
    if done.returncode != 0:
        raise ServerStartError(f"pg_ctl stop failed ({done.returncode}): {(done.stderr or done.stdout).strip()}")


@contextmanager
def local_postgres(keep_in: Path | None = None) -> Iterator[str]:
    """A PostgreSQL cluster on a free loopback port; yields Prefect's connection URL for it.

    The cluster is thrown away afterwards, or kept in ``keep_in`` (created there the first time,
    started again from there later). PostgreSQL refuses to run as root, so a root caller runs it
    as the ``postgres`` user, in a folder of its own (by default under the system's temporary
    directory), which that user must be able to reach.
    """
    bindir = postgres_bindir()
    if bindir is None:
        raise ServerStartError("PostgreSQL is not installed (no pg_config, no /usr/lib/postgresql/*/bin/initdb); "
                               "on Debian: apt-get install postgresql")
    if keep_in is None:
        folder = Path(tempfile.mkdtemp(prefix="crossalign-postgres-"))
    else:
        folder = Path(keep_in).expanduser().absolute()
        folder.mkdir(parents=True, exist_ok=True)
    as_user = _postgres_user()
    if as_user:
        owner = pwd.getpwnam("postgres")
        os.chown(folder, owner.pw_uid, owner.pw_gid)
        if subprocess.run([*as_user, "test", "-w", str(folder)]).returncode != 0:
            raise ServerStartError(f"{folder}: PostgreSQL runs as user postgres, which cannot reach this folder; "
                                   "choose one below a folder every user may enter (e.g. /var/lib/crossalign)")
    port, data, log = free_port(), folder / "data", folder / "postgres.log"

    def run(*argv: str) -> None:
        done = subprocess.run([*as_user, *argv], capture_output=True, text=True, cwd=folder)
        if done.returncode != 0:
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise ServerStartError(f"{Path(argv[0]).name} failed ({done.returncode}): "
                                   f"{(done.stderr or done.stdout).strip()[-2000:]}\n{tail}")

    try:
        created = not (data / "PG_VERSION").exists()
        if created:
            run(str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "prefect", "--no-sync")
        run(str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-o",
            f"-p {port} -k {folder} -c listen_addresses=127.0.0.1", "start")
        try:
            if created:
                run(str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "prefect", "prefect")
            yield f"postgresql+asyncpg://prefect@127.0.0.1:{port}/prefect"
        finally:
            with suppress(ServerStartError):  # the stop of a cluster that is going anyway
                stop_postgres(folder)
    finally:
        if keep_in is None:
            shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def local_server(home: Path, *, scheduler: bool = False, database: Database = "sqlite", host: str = "127.0.0.1",
                 port: int | None = None, ui_url: str | None = None, database_url: str | None = None,
                 postgres_dir: Path | None = None) -> Iterator[LocalServer]:
    """``prefect server start`` on ``host:port`` (default: loopback, a free port) with ``home`` as PREFECT_HOME.

    ``scheduler`` off keeps prefect.yaml's nightly cron from starting a real nightly while the
    block runs. ``database`` is SQLite in ``home`` or PostgreSQL: the one at ``database_url``, else
    a private cluster, kept in ``postgres_dir`` if given. ``ui_url`` is the address browsers use
    (default: ``http://<host>:<port>``). $PREFECT_SERVER_API_AUTH_STRING, if set, is passed on to
    the server and, as PREFECT_API_AUTH_STRING, to the clients' environment. Raises
    ServerStartError with the end of the server log if it does not come up.
    """
    if database not in ("sqlite", "postgres"):
        raise ValueError(f"database {database!r}: sqlite or postgres")
    if database == "postgres" and database_url is None:
        cluster = local_postgres(postgres_dir)
    else:
        cluster = nullcontext(database_url)
    with cluster as url:
        with _server(home, scheduler, url, host, port or free_port(), ui_url) as server:
            yield server


@contextmanager
def _server(home: Path, scheduler: bool, database_url: str | None, host: str, port: int,
            ui_url: str | None) -> Iterator[LocalServer]:
    home.mkdir(parents=True, exist_ok=True)
    local_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    api_url = f"http://{local_host}:{port}/api"
    ui_url = (ui_url or f"http://{local_host}:{port}").rstrip("/")
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": api_url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "true" if scheduler else "false",
        "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
    }
    if os.environ.get(AUTH_ENV):
        env[CLIENT_AUTH_ENV] = os.environ[AUTH_ENV]
    # the UI in a browser elsewhere calls the API at its public address, and alerts link to the UI there;
    # SQLite on a busy 2-core machine: wait for the database lock instead of answering 503
    server_env = {**{k: v for k, v in env.items() if k != "PREFECT_API_URL"},
                  "PREFECT_UI_API_URL": f"{ui_url}/api", "PREFECT_UI_URL": ui_url,
                  "PREFECT_SERVER_DATABASE_TIMEOUT": "60", "PREFECT_SERVER_DATABASE_CONNECTION_TIMEOUT": "60"}
    if database_url is not None:
        server_env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = database_url
    log_path = home / "server.log"
    with open(log_path, "a") as log:
        proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", host,
                                 "--port", str(port)], env=server_env, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(api_url, proc, log_path)
            yield LocalServer(api_url=api_url, home=home, env=env, database_url=database_url, ui_url=ui_url,
                              process=proc)
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
