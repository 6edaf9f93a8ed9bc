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

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from crossalign.agents.probe import POOLS
from crossalign.site import SITE_ENV, STORE_ENV, SiteConfig


def ensure_pool(name: str) -> bool:
    """Create the process work pool ``name`` if the server has none; True if it was created."""
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
FLOW_RUN_PYTHON = "python3"  # the interpreter named by prefect.yaml's job_variables.command


def flow_run_path() -> str:
    """PATH for the worker and its flow runs: this interpreter's folder first, then the inherited PATH."""
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", os.defpath)])


def worker_environment(site: SiteConfig, site_file: Path | None) -> dict[str, str]:
    env = {STORE_ENV: str(Path(site.store).expanduser().absolute()), "PATH": flow_run_path(),
           "PREFECT_WORKER_QUERY_SECONDS": os.environ.get("PREFECT_WORKER_QUERY_SECONDS", WORKER_QUERY_SECONDS)}
    if site_file is not None:
        env[SITE_ENV] = str(Path(site_file).absolute())
    return env


def worker_argv(pool: str, name: str | None = None, limit: int | None = None) -> list[str]:
    argv = [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process",
            "--name", name or f"{socket.gethostname()}-{pool}"]
    if limit is not None:
        argv += ["--limit", str(limit)]
    return argv


# Prefect's worker answers SIGTERM by stopping its poll loop, then waits for its API calls and its
# client's background threads, which after a server restart can take minutes; it gets this long.
STOP_GRACE_S = 4.0


def run_worker(pool: str, env: dict[str, str], name: str | None = None, limit: int | None = None) -> int:
    """Run the worker as a child of this agent until it exits; returns its exit code.

    SIGTERM or SIGINT to the agent is passed on to the worker as SIGTERM; a worker still there
    ``STOP_GRACE_S`` later is killed, so the agent and its worker are gone within ten seconds.
    Flow runs the worker started keep running; the server notices the ones that die (zombie
    automation).
    """
    worker = subprocess.Popen(worker_argv(pool, name, limit), env={**os.environ, **env})
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


def deploy(prefect_file: Path) -> None:
    """Create the four pools if missing, then ``prefect deploy --all`` from the file's folder."""
    if not prefect_file.exists():
        raise FileNotFoundError(f"{prefect_file}: no such prefect.yaml")
    for pool in POOLS:
        ensure_pool(pool)
    subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all", "--prefect-file",
                    str(prefect_file.absolute())], cwd=prefect_file.absolute().parent, check=True)
