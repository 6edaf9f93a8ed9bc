"""The report server: the run store read-only over HTTP (uvicorn + Starlette), nothing outside it."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crossalign.agents.server import free_port, stop_process
from crossalign.report.serve import store_url

CROSSALIGN = str(Path(sys.executable).with_name("crossalign"))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`crossalign serve` on a store with one report, a secret beside the store and symlinks out of it."""
    root = tmp_path_factory.mktemp("served")
    store = root / "store"
    (store / "r1" / "06-compare").mkdir(parents=True)
    (store / "r1" / "06-compare" / "report.html").write_text("<h1>verdict: pass</h1>")
    runs = (("old-run", "2026-11-01T10:00:00", "fail"), ("new-run", "2026-11-02T10:00:00", "pass"),
            ("running", "2026-11-03T10:00:00", None))
    for run_id, created, verdict in runs:
        (store / run_id).mkdir()
        (store / run_id / "run.json").write_text(json.dumps({"run_id": run_id, "created": created}))
        if verdict:
            (store / run_id / "06-compare").mkdir()
            (store / run_id / "06-compare" / "manifest.json").write_text("{}")
            (store / run_id / "06-compare" / "summary.json").write_text(json.dumps({"verdict": verdict}))
            (store / run_id / "06-compare" / "report.html").write_text("<p>report</p>")
    (store / "new-run" / "logs").mkdir()
    (store / "new-run" / "logs" / "compare.log").write_text("step compare done\n")
    (store / "new-run" / "06-compare" / "report.md").write_text("# crossalign comparison: PASS\n")
    (store / "new-run" / "06-compare" / "steps.csv").write_text("step,lm_loss\n1,7.0\n")
    (root / "secret.txt").write_text("secret")
    (store / "r1" / "out.txt").symlink_to(root / "secret.txt")
    (store / "r1" / "outside").symlink_to(root)
    port = free_port()
    proc = subprocess.Popen([CROSSALIGN, "serve", "--store", str(store), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while _get(port, "/r1/06-compare/report.html")[0] != 200:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.2)
        yield port
    finally:
        stop_process(proc)


def _get(port: int, path: str, method: str = "GET", headers: bool = False):
    """A request with the path sent exactly as given (no client-side normalisation of .. or %2e)."""
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        connection.request(method, path)
        response = connection.getresponse()
        answer = response.status, response.read()
        return (*answer, response.headers) if headers else answer
    except OSError:
        return (0, b"", {}) if headers else (0, b"")


def test_the_root_lists_the_runs_newest_first_with_verdicts_and_reports(served):
    status, body = _get(served, "/")
    page = body.decode()
    assert status == 200
    assert page.index("running") < page.index("new-run") < page.index("old-run"), page
    assert "href='/new-run/06-compare/report.html'" in page and ">pass<" in page and ">fail<" in page
    assert "not compared yet" in page


def test_a_run_folder_is_listed_and_text_files_are_shown_as_text(served):
    status, body = _get(served, "/new-run/")
    assert status == 200 and "href='/new-run/logs/'" in body.decode() and "href='/new-run/06-compare/'" in body.decode()
    status, body = _get(served, "/new-run/06-compare")
    assert status == 200 and "href='/new-run/06-compare/steps.csv'" in body.decode()
    for path, text in (("/new-run/logs/compare.log", b"step compare done"), ("/new-run/06-compare/report.md", b"# "),
                       ("/new-run/06-compare/steps.csv", b"step,"), ("/new-run/06-compare/summary.json", b"{")):
        status, body, headers = _get(served, path, headers=True)
        assert status == 200 and body.startswith(text) and headers["content-type"] == "text/plain; charset=utf-8", path
    status, body = _get(served, "/r1/")
    assert status == 200 and b"out.txt" not in body and b"outside" not in body, "links out of the store are not listed"


def test_the_store_is_served_read_only(served):
    assert _get(served, "/r1/06-compare/report.html") == (200, b"<h1>verdict: pass</h1>")
    assert _get(served, "/r1/06-compare/report.html", "PUT")[0] == 405
    assert _get(served, "/r1/06-compare/report.html", "DELETE")[0] == 405


@pytest.mark.parametrize("path", ["/../secret.txt", "/r1/../../secret.txt", "/%2e%2e/secret.txt",
                                  "/r1/%2E%2E/%2e%2e/secret.txt", "/r1/..%2f..%2fsecret.txt", "/r1/out.txt",
                                  "/r1/outside/secret.txt", "//etc/passwd", "/%2fetc/passwd"])
def test_nothing_outside_the_store_whatever_the_url(served, path):
    status, body = _get(served, path)
    assert status == 404 and b"secret" not in body and b"root:" not in body, (path, status, body[:80])


def test_report_server_listens_on_loopback_only(served):
    import psutil

    listening = [c.laddr for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == served]
    assert listening and {address.ip for address in listening} == {"127.0.0.1"}


def test_store_url_of_a_file_in_the_store(tmp_path):
    assert store_url("http://reports:8080/", tmp_path, tmp_path / "r 1" / "loss.png") == "http://reports:8080/r%201/loss.png"
    assert store_url(None, tmp_path, tmp_path / "r1" / "loss.png") is None
    assert store_url("http://reports:8080", tmp_path / "store", tmp_path / "elsewhere.png") is None
