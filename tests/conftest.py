"""Shared fixtures: a real Prefect server on a free loopback port, and process helpers."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

# pytest-xdist starts its workers with COLUMNS=80, which rich takes as a fixed width when the CLI's console is
# made; the CLI tests give their own width (CliRunner(env={"COLUMNS": ...})), as a terminal of that size would.
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)
# what the servers and agents the tests start record about themselves (crossalign down) stays out of the machine's
# own /var/lib/crossalign or ~/.crossalign; PostgreSQL's user must reach a server's data there when run as root
os.environ["CROSSALIGN_HOME"] = tempfile.mkdtemp(prefix="crossalign-home-")
os.chmod(os.environ["CROSSALIGN_HOME"], 0o755)
atexit.register(shutil.rmtree, os.environ["CROSSALIGN_HOME"], True)

from crossalign.agents.server import ServerStartError, local_server, postgres_bindir  # noqa: E402


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
