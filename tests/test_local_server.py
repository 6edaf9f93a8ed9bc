"""The throwaway Prefect server of the tests and benchmarks, on PostgreSQL as a site's server should be."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from crossalign.agents.server import local_server, postgres_bindir

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(postgres_bindir() is None, reason="PostgreSQL is not installed (scripts/setup.sh --dev)")]


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_server_on_a_private_postgres_cluster_keeps_its_data_there(tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with local_server(tmp_path / "home", database="postgres") as server:
        assert server.database_url and server.database_url.startswith("postgresql+asyncpg://prefect@127.0.0.1:")
        port = int(server.database_url.rsplit(":", 1)[1].split("/")[0])
        with temporary_settings({PREFECT_API_URL: server.api_url}), get_client(sync_client=True) as client:
            client.create_work_pool(WorkPoolCreate(name="written-to-postgres", type="process"))
        rows = subprocess.run([str(postgres_bindir() / "psql"), "-h", "127.0.0.1", "-p", str(port), "-U", "prefect",
                               "-d", "prefect", "-At", "-c", "select name from work_pool"],
                              capture_output=True, text=True, check=True).stdout.split()
        assert "written-to-postgres" in rows
        assert not list(Path(server.home).glob("*.db")), "nothing went to SQLite"
    assert not _port_open(port), "the cluster stops with the server"


def test_an_unknown_database_is_refused(tmp_path):
    with pytest.raises(ValueError, match="sqlite or postgres"):
        with local_server(tmp_path, database="mysql"):  # type: ignore[arg-type]
            pass
