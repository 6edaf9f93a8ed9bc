"""Start a machine's Prefect worker: make sure its pool exists, then run a process worker of it as
the agent's child (so that the agent can bound how long stopping takes).

The worker gets the site's store and site file through its environment (``CROSSALIGN_STORE``,
``CROSSALIGN_SITE``, absolute paths), and every flow run it starts inherits them, whatever its
working directory.

Flow runs start as ``python3 -m prefect.engine`` (prefect.yaml's ``job_variables.command``): one
process that imports Prefect once. Without a command, Prefect 3's process worker first starts a
workspace supervisor process that imports Prefect too, then execs the engine, which costs every
step about 2 s more. The worker's PATH starts with this interpreter's folder, so ``python3`` is
the interpreter crossalign is installed in.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from crossalign.agents.pools import POOLS
from crossalign.site import SITE_ENV, STORE_ENV, SiteConfig
from crossalign.agents.automation import install_automations


def ensure_pool(name: str) -> bool:
    """Create the process work pool ``name`` if the server has none; True if it was created."""
    # Prefect loads in seconds: imported only where its API is called
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
            return False
        except ObjectNotFound:
            pass
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type="process",
                                                   base_job_template=ProcessWorker.get_default_base_job_template()))
        except ObjectAlreadyExists:  # another agent created it meanwhile
            return False
        return True


# Prefect's default worker poll (10 s) would be most of a step's hand-over time; a handful of
# workers polling every second cost the server nothing. An explicit setting in the environment wins.
WORKER_QUERY_SECONDS = "1"


def flow_run_path() -> str:
    """PATH for the worker and its flow runs: this interpreter's folder first, then the inherited PATH."""
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", os.defpath)])


def worker_environment(site: SiteConfig, site_file: Path | None) -> dict[str, str]:
    env = {STORE_ENV: str(Path(site.store).expanduser().absolute()), "PATH": flow_run_path(),
           "PREFECT_WORKER_QUERY_SECONDS": os.environ.get("PREFECT_WORKER_QUERY_SECONDS", WORKER_QUERY_SECONDS)}
    if site_file is not None:
        env[SITE_ENV] = str(Path(site_file).absolute())
    return env


def default_worker_name(pool: str) -> str:
    return f"{socket.gethostname()}-{pool}"


def worker_argv(pool: str, name: str | None = None, limit: int | None = None) -> list[str]:
    argv = [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process",
            "--name", name or default_worker_name(pool)]
    if limit is not None:
        argv += ["--limit", str(limit)]
    return argv


LOCK_DIR_ENV = "CROSSALIGN_AGENT_LOCKS"  # where the agents of this machine keep their lock files


class AgentAlreadyRunning(RuntimeError):
    """A worker of the same name, pool and server is alive on this machine: a second one would double the pool."""


def lock_path(pool: str, name: str, api_url: str) -> Path:
    """The lock file of the worker ``name`` of ``pool`` on the server at ``api_url``, on this machine."""
    folder = Path(os.environ.get(LOCK_DIR_ENV) or Path.home() / ".crossalign" / "agents")
    server = hashlib.sha256(api_url.rstrip("/").encode()).hexdigest()[:12]
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{pool}-{name}")
    return folder / f"{safe}-{server}.lock"


def hold_worker_lock(pool: str, name: str, api_url: str) -> int:
    """Lock the worker's name on this machine for as long as this agent or its worker lives; returns the descriptor.

    The lock is an flock, which the kernel drops when the last process holding the descriptor
    ends, so a dead agent leaves no stale lock, while a worker that outlived its agent (it holds
    the descriptor too, see ``run_worker``) still counts. Raises AgentAlreadyRunning otherwise.
    """
    path = lock_path(pool, name, api_url)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holders = path.read_text().strip().replace("\n", ", ") or "unknown pids"
        os.close(fd)
        raise AgentAlreadyRunning(f"a worker named {name!r} of pool {pool} for {api_url} is already running on this "
                                  f"machine ({holders}; lock {path}): stop it first, or give this one another --name")
    os.ftruncate(fd, 0)
    os.write(fd, f"agent pid {os.getpid()}\n".encode())
    return fd


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent_pid: int, prctl) -> Callable[[], None]:
    """``preexec_fn`` of the worker: the kernel kills it (SIGKILL) when the agent that started it dies.

    Without it, an agent killed with SIGKILL leaves its worker polling the pool, re-parented to
    PID 1, and a restarted agent adds a second worker. SIGKILL, because a worker started from a
    non-interactive shell ignores SIGINT and turns SIGTERM into SIGINT (prefect.md, worker signals).
    """
    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the agent died before the line above took effect
            os._exit(1)
    return preexec


# Prefect's worker answers SIGTERM by stopping its poll loop, then waits for its API calls and its
# client's background threads, which after a server restart can take minutes; it gets this long.
STOP_GRACE_S = 4.0


def run_worker(pool: str, env: dict[str, str], name: str | None = None, limit: int | None = None,
               lock_fd: int | None = None) -> int:
    """Run the worker as a child of this agent until it exits; returns its exit code.

    SIGTERM or SIGINT to the agent is passed on to the worker as SIGTERM; a worker still there
    ``STOP_GRACE_S`` later is killed, so the agent and its worker are gone within ten seconds.
    An agent killed outright takes its worker with it (Linux: the parent-death signal). The
    worker keeps ``lock_fd`` (``hold_worker_lock``) open for as long as it lives. Flow runs the
    worker started keep running; the server notices the ones that die (zombie automation).
    """
    preexec = None
    if sys.platform.startswith("linux"):
        # looked up here: the child between fork and exec should do as little as it can
        preexec = _die_with_parent(os.getpid(), ctypes.CDLL(None, use_errno=True).prctl)
    worker = subprocess.Popen(worker_argv(pool, name, limit), env={**os.environ, **env}, preexec_fn=preexec,
                              pass_fds=() if lock_fd is None else (lock_fd,))
    if lock_fd is not None:
        os.write(lock_fd, f"worker pid {worker.pid}\n".encode())
    stop_requested: list[tuple[int, float]] = []

    def stop(signum: int, _frame) -> None:  # only notes the request: the loop below does the waiting
        if not stop_requested:
            stop_requested.append((signum, time.monotonic()))
            worker.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        try:
            code = worker.wait(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            if stop_requested and time.monotonic() - stop_requested[0][1] > STOP_GRACE_S:
                worker.kill()
    if not stop_requested:
        return code
    signum = stop_requested[0][0]
    print(f"agent: worker stopped after {signal.Signals(signum).name}", flush=True)
    # nothing of the agent's own is left to save; Prefect's exit handlers in this process (its
    # client's background threads) could otherwise hold the exit for many seconds
    os._exit(128 + signum)


class DeployError(RuntimeError):
    """``prefect deploy`` refused the deployments file; carries the end of its output."""


NIGHTLY_TIMEZONE_ENV = "CROSSALIGN_NIGHTLY_TIMEZONE"  # prefect.yaml's {{ CROSSALIGN_NIGHTLY_TIMEZONE }}


def deploy(prefect_file: Path, nightly_timezone: str) -> dict[str, str]:
    """Create the four pools if missing, ``prefect deploy --all`` from the file's folder, then install crash detection.

    The nightly's schedule (and its description) take ``nightly_timezone``: prefect.yaml names it as
    ``{{ CROSSALIGN_NIGHTLY_TIMEZONE }}``, which ``prefect deploy`` fills in from the environment. Prefect's own
    output (a page of advice per deployment to start ``prefect worker start``, which ``crossalign agent start``
    does) is shown only when it fails. Returns the installed automations, {name: id}: a deployed DAG without the
    zombie-run automation would wait forever on a step whose machine died.
    """
    if not prefect_file.exists():
        raise FileNotFoundError(f"{prefect_file}: no such prefect.yaml")
    for pool in POOLS:
        ensure_pool(pool)
    done = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all", "--prefect-file",
                           str(prefect_file.absolute())], cwd=prefect_file.absolute().parent, capture_output=True,
                          text=True, env={**os.environ, NIGHTLY_TIMEZONE_ENV: nightly_timezone})
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-40:])
        raise DeployError(f"prefect deploy of {prefect_file} failed ({done.returncode}):\n{tail}")
    return install_automations()
