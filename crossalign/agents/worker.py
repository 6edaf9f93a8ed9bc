"""Start a machine's Prefect worker: make sure its pool exists, then become a process worker of it.

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
import socket
import subprocess
import sys
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


def exec_worker(pool: str, env: dict[str, str], name: str | None = None, limit: int | None = None) -> None:
    """Replace this process with the worker, so that signals (systemd, Ctrl-C) reach it directly."""
    argv = worker_argv(pool, name, limit)
    os.execve(argv[0], argv, {**os.environ, **env})


def deploy(prefect_file: Path) -> None:
    """Create the four pools if missing, then ``prefect deploy --all`` from the file's folder."""
    if not prefect_file.exists():
        raise FileNotFoundError(f"{prefect_file}: no such prefect.yaml")
    for pool in POOLS:
        ensure_pool(pool)
    subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all", "--prefect-file",
                    str(prefect_file.absolute())], cwd=prefect_file.absolute().parent, check=True)
