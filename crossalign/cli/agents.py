"""Distributed mode's machinery: ``agent start``, ``server start``, ``deploy``, ``serve``, ``automations install``.

Prefect, the probes and the site config (pydantic) are imported inside the commands, so that
``crossalign --help`` stays fast.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit

import typer
from rich.table import Table

from crossalign.cli.common import console, err_console, user_errors
from crossalign.cli.prefect_env import EXIT_INVALID, quiet_prefect, server_url
from crossalign.cli.runs import store_root

agent_app = typer.Typer(name="agent", help="Run this machine as a worker of a pool (npu, cpu, gpu, orchestrator).",
                        no_args_is_help=True)
server_app = typer.Typer(name="server", help="The Prefect server the agents and the UI talk to.",
                         no_args_is_help=True)
automations_app = typer.Typer(name="automations", help="Server-side automations (zombie runs, nightly alerts).",
                              no_args_is_help=True)


def register(app: typer.Typer) -> None:
    """Add this area's commands to app."""
    app.add_typer(agent_app, name="agent")
    app.command("deploy")(deploy_command)
    app.add_typer(server_app, name="server")
    app.command("serve")(serve_command)
    app.add_typer(automations_app, name="automations")
    app.command("down")(down_command)


def is_loopback_url(url: str) -> bool:
    """Whether the host of ``url`` is, or resolves to, a loopback address (a name that does not resolve is not)."""
    host = urlsplit(url).hostname or ""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


@agent_app.command("start")
def agent_start(
    pool: str = typer.Option(..., "--pool", help="orchestrator, npu, cpu or gpu"),
    site_file: Optional[Path] = typer.Option(None, "--site", help="the site config (default: $CROSSALIGN_SITE "
                                             "or ./crossalign.site.yaml)"),
    name: Optional[str] = typer.Option(None, "--name", help="worker name (default: <host>-<pool>)"),
    limit: Optional[int] = typer.Option(None, "--limit", help="flow runs at once on this worker"),
    probe_only: bool = typer.Option(False, "--probe-only", help="probe the machine and stop"),
    no_patch: bool = typer.Option(False, "--no-patch", help="check the framework patches, do not apply them"),
) -> None:
    """Probe this machine for POOL, create the pool if missing, and start a Prefect process worker."""
    # imported when run: keeps crossalign --help fast
    from crossalign.agents.pools import POOLS
    from crossalign.agents.probe import missing, probe_pool
    from crossalign.agents.processes import forget, record_this_process
    from crossalign.patching import PatchError
    from crossalign.agents.worker import (AgentAlreadyRunning, default_worker_name, ensure_pool, hold_worker_lock,
                                          run_worker, worker_environment)
    from crossalign.site import SiteError, load_site, site_path

    if pool not in POOLS:
        err_console.print(f"[bold red]error:[/] --pool {pool!r} is not one of {', '.join(POOLS)}")
        raise typer.Exit(EXIT_INVALID)

    with user_errors(SiteError, PatchError, AgentAlreadyRunning):
        site_file = site_file or site_path()
        site = load_site(site_file)
        name = name or default_worker_name(pool)
        # before anything slow: a second worker of this name would double the pool
        lock_fd = hold_worker_lock(pool, name, server_url(required=False, site_file=site_file) or "")
        with console.status(f"probing this machine for the {pool} pool ..."):
            checks = probe_pool(pool, site, apply_patches=not no_patch)
    table = Table("check", "found", "detail", title=f"pool {pool} on this machine", title_justify="left")
    for check in checks:
        mark = "[green]yes[/]" if check.ok else ("[red]NO[/]" if check.required else "[yellow]no[/]")
        table.add_row(check.name + ("" if check.required else " (optional)"), mark, check.detail)
    console.print(table)
    absent = missing(checks)
    if absent:
        err_console.print(f"[bold red]error:[/] this machine cannot serve the {pool} pool: missing "
                          + "; ".join(f"{c.name} ({c.detail})" for c in absent), highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_INVALID)
    if probe_only:
        return
    server_url(required=True, site_file=site_file)
    quiet_prefect(verbose=True)
    created = ensure_pool(pool)
    env = worker_environment(site, site_file)
    console.print(f"pool {pool}: {'created' if created else 'exists'}; store {env['CROSSALIGN_STORE']}; "
                  "starting the worker", highlight=False)
    record = record_this_process(site_file, f"agent-{name}", "agent", pool=pool, name=name)
    try:
        code = run_worker(pool, env, name=name, limit=limit, lock_fd=lock_fd)
    finally:
        forget(record)
    raise typer.Exit(code)


def deploy_command(prefect_file: Path = typer.Option(Path("prefect.yaml"), "--prefect-file",
                                                     help="the deployments file"),
                   site_file: Optional[Path] = typer.Option(None, "--site", help="the site config, for its "
                                                            "prefect_api_url (default: $CROSSALIGN_SITE or "
                                                            "./crossalign.site.yaml)")) -> None:
    """Create the orchestrator/npu/cpu/gpu pools if missing, deploy every flow of prefect.yaml and turn on
    the detection of flow runs whose machine died."""
    # imported when run: keeps crossalign --help fast
    import yaml

    from crossalign.agents.automation import DEFAULT_ZOMBIE_AFTER_S
    from crossalign.agents.worker import DeployError, deploy
    from crossalign.site import SiteError, load_site, machine_timezone, site_path

    site_file = site_file or site_path()
    url = server_url(required=True, site_file=site_file)
    quiet_prefect(verbose=True)
    from crossalign.flows.launch import missing_step_deployments  # with Prefect, once its settings are made

    deployments = (yaml.safe_load(prefect_file.read_text()).get("deployments") or []) if prefect_file.exists() else []
    with user_errors(FileNotFoundError, DeployError, SiteError):
        nightly = load_site(site_file).nightly
        timezone = nightly.timezone or machine_timezone()
        missing = missing_step_deployments(deployments)
        if missing:  # every run would fail at a step without its deployment
            raise DeployError(f"{prefect_file} lacks deployments the step table (crossalign/dag.py) needs: "
                              + "; ".join(missing))
        deploy(prefect_file, nightly_timezone=timezone)
    ui = url.rstrip("/").removesuffix("/api")
    console.print(f"deployed {len(deployments)} deployments of {prefect_file} to {ui}; a flow run silent for "
                  f"{DEFAULT_ZOMBIE_AFTER_S} s (its machine died) is marked Crashed and its step retried",
                  highlight=False, soft_wrap=True)
    configs_from = "the site's nightly.configs" if "configs" in nightly.model_fields_set else \
        "the tiny configs: the site names no nightly.configs"
    zone_from = "the site's nightly.timezone" if nightly.timezone else "this machine's zone"
    console.print(f"nightly/nightly aligns {', '.join(nightly.configs)} ({configs_from}) every night at 02:00 "
                  f"{timezone} ({zone_from}), from tonight; pause it under the deployment's Schedules",
                  highlight=False, soft_wrap=True)
    console.print("next, on each machine, for its pools: crossalign agent start --pool orchestrator|npu|cpu|gpu",
                  highlight=False, soft_wrap=True)
    console.print(f"then: crossalign run qwen35_dense_tiny --distributed, or in the UI ({ui}): Deployments, "
                  "alignment/dense-tiny, Run", highlight=False, soft_wrap=True)


@server_app.command("start")
def server_start(
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on (0.0.0.0: every interface)"),
    port: int = typer.Option(4200, "--port", help="port of the UI and the API"),
    url: Optional[str] = typer.Option(None, "--url", help="the address browsers and agents use "
                                      "(default: http://<this host's name>:PORT when listening beyond loopback)"),
    data: Optional[Path] = typer.Option(None, "--data", help="server home and its PostgreSQL cluster, kept "
                                        "between starts (default: the site's server_data, else server/ in the "
                                        "site's folder on this machine: one per site file, or per working "
                                        "directory without one)"),
    insecure: bool = typer.Option(False, "--insecure", help="listen beyond loopback without basic auth"),
    site_file: Optional[Path] = typer.Option(None, "--site", help="the site config (default: $CROSSALIGN_SITE "
                                             "or ./crossalign.site.yaml)"),
) -> None:
    """Run the Prefect server on PostgreSQL until stopped (Ctrl-C, SIGTERM).

    The database is $PREFECT_SERVER_DATABASE_CONNECTION_URL if set, else a PostgreSQL cluster of
    its own in --data. Beyond loopback anyone who reaches the port could start runs on the GPU
    and NPU machines, so it needs $PREFECT_SERVER_API_AUTH_STRING (user:password) unless --insecure.
    """
    # imported when run: keeps crossalign --help fast
    from crossalign.agents.processes import forget, record_this_process
    from crossalign.agents.server import AUTH_ENV, CLIENT_AUTH_ENV, LOOPBACK, ServerStartError, local_server
    from crossalign.site import SiteError, load_site, site_home, site_path

    beyond_loopback = host not in LOOPBACK
    if beyond_loopback and not os.environ.get(AUTH_ENV) and not insecure:
        err_console.print(f"[bold red]error:[/] --host {host} lets other machines start runs: set {AUTH_ENV}="
                          "user:password (agents and the CLI then need the same value in "
                          f"{CLIENT_AUTH_ENV}), or pass --insecure", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_INVALID)
    if url is None and beyond_loopback:
        url = f"http://{socket.getfqdn()}:{port}"
    if beyond_loopback and is_loopback_url(url):
        err_console.print(f"[bold red]error:[/] --host {host} serves other machines, but {url} is this machine's "
                          "loopback address, which would send their agents and browsers to themselves: pass "
                          f"--url http://ADDRESS:{port} with the name or address they reach this machine by",
                          highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_INVALID)
    with user_errors(SiteError):
        site_file = site_file or site_path()
        data = (data or load_site(site_file).server_data or site_home(site_file) / "server").expanduser().absolute()
    database_url = os.environ.get("PREFECT_SERVER_DATABASE_CONNECTION_URL")
    postgres = None if database_url else data / "postgres"
    # Ctrl-C and SIGTERM leave the block below, which stops the server and then PostgreSQL
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    record = None
    try:
        with local_server(data / "prefect", scheduler=True, database="postgres", host=host, port=port,
                          ui_url=url, database_url=database_url, postgres_dir=postgres) as server:
            record = record_this_process(site_file, "server", "Prefect server", url=server.ui_url, data=str(data),
                                         postgres=None if postgres is None else str(postgres))
            console.print(f"Prefect server up: UI {server.ui_url}  (data {data}; log {server.home / 'server.log'}; "
                          "`crossalign down` ends it)", highlight=False, soft_wrap=True)
            console.print("on every machine that runs crossalign:", highlight=False)
            console.print(f"  export PREFECT_API_URL={server.ui_url}/api", highlight=False)
            if os.environ.get(AUTH_ENV):
                console.print(f"  export {CLIENT_AUTH_ENV}=...   (the user:password of {AUTH_ENV})",
                              highlight=False)
            code = server.process.wait()
            err_console.print(f"[bold red]error:[/] the Prefect server exited ({code}); see "
                              f"{server.home / 'server.log'}", highlight=False)
            raise typer.Exit(1)
    except ServerStartError as exc:
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        pass
    finally:
        if record is not None:
            forget(record)


def serve_command(
    store: Optional[Path] = typer.Option(None, "--store", help="the run store (default: the site's store)"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on (0.0.0.0: every interface)"),
    port: int = typer.Option(8080, "--port", help="port to listen on"),
) -> None:
    """Serve the run store read-only over HTTP: the reports and plots the Prefect UI links to."""
    # imported when run: keeps crossalign --help fast
    from crossalign.agents.processes import forget, record_this_process
    from crossalign.report.serve import serve, store_app
    from crossalign.site import SiteError, site_path

    with user_errors(SiteError, FileNotFoundError):
        root = store_root(store).expanduser().absolute()
        served = store_app(root)
    shown = host if host in ("127.0.0.1", "localhost") else "<this host>"
    console.print(f"serving {root} read-only on {host}:{port}; the site config's report_url: "
                  f"http://{shown}:{port}/", highlight=False)
    record = record_this_process(site_path(), "report-server", "report server", url=f"http://{shown}:{port}/")
    try:
        serve(served, host, port)
    finally:
        forget(record)


def down_command(site_file: Optional[Path] = typer.Option(None, "--site", help="the site config (default: "
                                                          "$CROSSALIGN_SITE or ./crossalign.site.yaml)")) -> None:
    """End what this site runs on this machine (its agents and their workers, the report server, the Prefect
    server and its PostgreSQL), as `agent start`, `serve` and `server start` recorded it, and say what was ended.
    The server's data stays for the next `server start`."""
    from crossalign.agents.processes import end_recorded  # imported when run: keeps crossalign --help fast
    from crossalign.site import site_home, site_path

    site_file = site_file or site_path()
    ended = end_recorded(site_file)
    where = f"site {site_file}" if site_file is not None else f"working directory {Path.cwd()} (no site file)"
    if not ended:
        console.print(f"nothing of the {where} runs on this machine ({site_home(site_file)})", highlight=False,
                      soft_wrap=True)
    for line in ended:
        console.print(line, highlight=False, soft_wrap=True)


@automations_app.command("install")
def automations_install(
    webhook: Optional[str] = typer.Option(None, "--webhook", help="URL to call when a nightly run fails"),
    zombie_after: int = typer.Option(90, "--zombie-after", help="seconds without heartbeat before a flow "
                                     "run counts as crashed (as `crossalign deploy` sets it); keep it well "
                                     "above the heartbeat interval of every flow on the server (crossalign's "
                                     "30 s, Prefect's default 180 s)"),
) -> None:
    """Create (or replace) crossalign's automations on the Prefect server in PREFECT_API_URL."""
    # imported when run: keeps crossalign --help fast
    from crossalign.agents.automation import AutomationError, install_automations

    server_url(required=True)
    quiet_prefect(verbose=True)
    with user_errors(AutomationError):
        installed = install_automations(webhook, zombie_after)
    for name, automation_id in installed.items():
        console.print(f"automation {name}: {automation_id}", highlight=False)
    if webhook is None:
        console.print("no --webhook: the nightly failure alert was not installed", highlight=False)
