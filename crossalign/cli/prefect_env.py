"""How the CLI's commands reach Prefect: the server they talk to, and the settings Prefect reads when imported.

Prefect itself (and pydantic, which the site config and the run request are made of) is imported only
inside the commands that need it, so that ``crossalign --help`` stays fast.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import typer

from crossalign.cli.common import err_console, user_errors

EXIT_INVALID = 2
HEARTBEAT_S = "30"  # as in prefect.yaml (Prefect's least); the zombie automation waits three times as long
API_WAIT_S = 120  # a server started a moment ago (`crossalign server start &`) needs this long on a busy machine


def server_url(required: bool, site_file: Path | None = None) -> str | None:
    """The Prefect API to use: $PREFECT_API_URL, else the site's ``prefect_api_url`` (exported for Prefect).

    Where it is required, waits for the server to answer, so that commands pasted right after
    ``crossalign server start &`` find it up.
    """
    from crossalign.site import SiteError, load_site

    if not os.environ.get("PREFECT_API_URL"):
        with user_errors(SiteError):
            url = load_site(site_file).prefect_api_url
        if url:
            os.environ["PREFECT_API_URL"] = url
    url = os.environ.get("PREFECT_API_URL")
    if required and not url:
        err_console.print("[bold red]error:[/] no Prefect server: set PREFECT_API_URL (e.g. http://HOST:4200/api) "
                          "or prefect_api_url in the site config")
        raise typer.Exit(EXIT_INVALID)
    if required and not api_answers(url, API_WAIT_S):
        err_console.print(f"[bold red]error:[/] the Prefect server at {url} did not answer within {API_WAIT_S} s",
                          highlight=False)
        raise typer.Exit(EXIT_INVALID)
    return url


def api_answers(url: str, within_s: float) -> bool:
    """Whether ``<url>/health`` answers (it needs no credentials) within ``within_s`` seconds."""
    import urllib.request  # imported here: it costs `crossalign --help` a tenth of its start-up

    deadline = time.monotonic() + within_s
    while True:
        try:
            with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=5) as response:
                if response.status == 200:
                    return True
        except OSError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(1)


def quiet_prefect(verbose: bool) -> None:
    """Settings read when Prefect is first imported: a patient ephemeral server, no telemetry, quiet console.

    Without ``verbose`` the run display and the final message say what happened; Prefect's own
    console lines (and its tracebacks of an expected failure such as a failed verdict) stay in
    the run's logs on the API.
    """
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", HEARTBEAT_S)
    if not verbose:
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")
