"""Running the DAG: ``run``, ``rerun``, ``runs``, ``status``, ``agent start``, ``automations install``."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Optional

import typer

from crossalign.cli.common import console, err_console, user_errors
from crossalign.report.units import duration_text, size_text

STATE_STYLES = {"done": "green", "skipped": "green", "stale": "yellow", "running": "cyan", "started": "cyan",
                "interrupted": "red", "failed": "red", "pending": "dim"}
EXIT_PASS, EXIT_FAIL, EXIT_INVALID = 0, 1, 2
HEARTBEAT_S = "30"  # as in prefect.yaml (Prefect's least); the zombie automation waits three times as long


API_WAIT_S = 120  # a server started a moment ago (`crossalign server start &`) needs this long on a busy machine


def _server_url(required: bool, site_file: Path | None = None) -> str | None:
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
    if required and not _api_answers(url, API_WAIT_S):
        err_console.print(f"[bold red]error:[/] the Prefect server at {url} did not answer within {API_WAIT_S} s",
                          highlight=False)
        raise typer.Exit(EXIT_INVALID)
    return url


def _api_answers(url: str, within_s: float) -> bool:
    """Whether ``<url>/health`` answers (it needs no credentials) within ``within_s`` seconds."""
    import urllib.request

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


def _is_loopback_url(url: str) -> bool:
    """Whether the host of ``url`` is, or resolves to, a loopback address (a name that does not resolve is not)."""
    import ipaddress
    import socket
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname or ""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def _store_root(store: Optional[Path]) -> Path:
    from crossalign.site import load_site

    return Path(store) if store is not None else load_site().store


def _quiet_prefect(verbose: bool) -> None:
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


def _styled(state: str) -> str:
    style = STATE_STYLES.get(state)
    return f"[{style}]{state}[/]" if style else state


def _metrics_text(metrics: dict[str, Any]) -> str:
    shown = [(k, v) for k, v in metrics.items() if k in ("lm_loss", "mtp_1_loss", "aux_loss", "loss", "grad_norm")]
    return "  ".join(f"{k} {v:.4f}" for k, v in shown if isinstance(v, (int, float)))


class RunDisplay:
    """Per-step state, host, duration and training progress; every iteration's metrics as a line."""

    def __init__(self, run_id: str):
        from crossalign.store import STEPS

        self.run_id = run_id
        self.rows = {s.name: {"spec": s, "state": "pending", "host": "", "seconds": None, "done": 0, "total": 0,
                              "metrics": {}, "started": None} for s in STEPS}
        self.alignment = None  # the latest live comparison of steps 4 and 5
        self.live = None

    def handle(self, event) -> None:
        if event.kind == "alignment":
            from crossalign.cli.live import alignment_line

            self.alignment = event
            self._say(alignment_line(event))
        row = self.rows.get(event.step)
        if row is None:
            return
        if event.kind == "started":
            row.update(state="running", started=time.monotonic(), done=0, total=0)
            self._say(f"[cyan]{event.step}[/] started")
        elif event.kind == "skipped":
            row.update(state="skipped", host=event.host, seconds=event.seconds)
            self._say(f"[green]{event.step}[/] already done, skipped")
        elif event.kind == "progress":
            row.update(done=event.done, total=event.total, metrics=event.metrics)
            self._say(f"  {event.step} {event.done:>4}/{event.total}  {_metrics_text(event.metrics)}")
        elif event.kind == "done":
            row.update(state="done", host=event.host, seconds=event.seconds)
            self._say(f"[green]{event.step}[/] done in {duration_text(event.seconds)} on {event.host}")
        elif event.kind == "failed":
            row.update(state="failed")
            self._say(f"[red]{event.step} failed:[/] {event.message}")
        if self.live is not None:
            self.live.update(self.render())

    def _say(self, text: str) -> None:
        console.print(text, highlight=False)

    def render(self):
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        table = Table(title=f"run {self.run_id}", title_justify="left")
        for column in ("#", "step", "pool", "state", "host", "time", "progress"):
            table.add_column(column)
        for row in self.rows.values():
            spec, state = row["spec"], row["state"]
            seconds = row["seconds"]
            if state == "running" and row["started"] is not None:
                seconds = time.monotonic() - row["started"]
            progress = ""
            if row["total"]:
                progress = ProgressBar(total=row["total"], completed=row["done"], width=24)
            table.add_row(str(spec.index), spec.name, spec.pool,
                          _styled(state), row["host"], duration_text(seconds), progress)
        if self.alignment is None:
            return table
        from rich.console import Group

        from crossalign.cli.live import alignment_table

        return Group(table, alignment_table(self.alignment))

    def __enter__(self) -> "RunDisplay":
        if console.is_terminal:
            from rich.live import Live

            self.live = Live(self.render(), console=console, refresh_per_second=4, get_renderable=self.render,
                             transient=True)
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)
            self.live = None


def _status_table(run):
    from rich.table import Table

    table = Table(title=f"run {run.run_id}  ({run.path})", title_justify="left")
    for column in ("#", "step", "pool", "state", "host", "duration", "outputs"):
        table.add_column(column)
    for state in run.states():
        outputs = (state.manifest or {}).get("outputs", [])
        shown = f"{len(outputs)} file{'' if len(outputs) == 1 else 's'}, {size_text(sum(o['size'] for o in outputs))}" if outputs else ""
        if state.status == "failed":
            shown = (state.attempt or {}).get("error", "")[:80]
        table.add_row(str(state.spec.index), state.spec.name, run.pool(state.spec.name),
                      _styled(state.status), state.host,
                      duration_text(state.seconds), shown)
    return table


def _verdict(run) -> tuple[str | None, str | None]:
    """The verdict of a run's compare step and where its report is (on the report server, else the file)."""
    from crossalign.report.serve import store_url
    from crossalign.site import load_site
    from crossalign.store import read_json
    from crossalign.tasks.compare import SUMMARY

    if not run.is_done("compare"):
        from crossalign.stop import stopped_report

        stopped = stopped_report(run)  # fail-fast ended the run before step 6
        if stopped is None:
            return None, None
        return "fail", store_url(load_site().report_url, run.store.root, stopped) or str(stopped)
    folder = run.step_dir("compare")
    summary = read_json(folder / SUMMARY)
    reports = sorted(folder.rglob("report.html")) or sorted(folder.rglob("report.md")) or [folder / SUMMARY]
    return summary.get("verdict"), store_url(load_site().report_url, run.store.root, reports[0]) or str(reports[0])


def _finish(run_id: str, root: Path, state) -> int:
    """Print the outcome of a flow run and choose the exit code: 0 pass, 1 fail, 2 invalid or bad input."""
    from crossalign.config import ConfigError
    from crossalign.store import RunStore, StoreError
    from crossalign.tasks.errors import PreflightFailed

    store = RunStore(root)
    run = store.run(run_id) if store.exists(run_id) else None
    # a failed verdict ends the flow Failed with a RunOutcome as data: an outcome, not an error
    from crossalign.flows.outcome import RunOutcome

    error = None if state.is_completed() else state.result(raise_on_failure=False)
    if isinstance(error, RunOutcome):
        error = error.cause  # None for a verdict: an outcome, told by the run's summary
    elif not isinstance(error, BaseException):
        error = None
    if isinstance(error, (ConfigError, StoreError, PreflightFailed)):
        err_console.print(f"[bold red]run {run_id}: invalid input:[/] {error}", highlight=False, soft_wrap=True)
        return EXIT_INVALID
    if run is not None:
        console.print(_status_table(run))
    verdict, report = _verdict(run) if run is not None else (None, None)
    if verdict is not None and error is None:
        style = "green" if verdict == "pass" else "red"
        console.print(f"verdict: [bold {style}]{verdict}[/]    report: {report}", highlight=False)
        if not run.is_done("compare"):  # stopped early: say why and what it saved
            console.print(state.message or "", highlight=False, soft_wrap=True)
        return {"pass": EXIT_PASS, "fail": EXIT_FAIL}.get(verdict, EXIT_INVALID)
    message = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else (state.message or "")
    err_console.print(f"[bold red]run {run_id} failed:[/] {message}", highlight=False, soft_wrap=True)
    if run is not None:
        import shlex

        parameters = run.info["parameters"]
        command = ["crossalign", "run", parameters["config"], "--run-id", run_id, "--store", str(root)]
        for override in parameters.get("overrides", []):
            command += ["--set", override]
        if parameters.get("mode") == "distributed":
            command.append("--distributed")
        err_console.print(f"resume with: {shlex.join(command)}", highlight=False, soft_wrap=True)
    return EXIT_FAIL


def _run_flow(*, config: str | None, run_id: str, root: Path, overrides: list[str], rerun: list[str],
              distributed: bool, retries: int, retry_delay: float, verbose: bool, from_hf: Path | None = None,
              fail_fast: bool = True) -> int:
    _server_url(required=distributed)
    _quiet_prefect(verbose)
    from crossalign.flows.alignment import alignment
    from crossalign.flows.events import listening

    mode = "distributed" if distributed else "embedded"
    console.print(f"run [bold]{run_id}[/] ({mode}) in {root}", highlight=False)
    with RunDisplay(run_id) as display, listening(display.handle):
        state = alignment(config=config, run_id=run_id, overrides=overrides, store=str(root), rerun=rerun,
                          mode=mode, retries=retries, retry_delay_s=retry_delay, return_state=True,
                          from_hf=None if from_hf is None else str(from_hf.absolute()), fail_fast=fail_fast)
    return _finish(run_id, root, state)


def register(app: typer.Typer) -> None:
    """Add this area's commands to app."""

    @app.command("run")
    def run_command(
        config: str = typer.Argument(..., help="a shipped config name (qwen35_dense_tiny) or a YAML file"),
        store: Optional[Path] = typer.Option(None, "--store", help="the run store (default: the site's store, ./runs)"),
        run_id: Optional[str] = typer.Option(None, "--run-id", help="resume this run (finished steps are skipped)"),
        overrides: list[str] = typer.Option([], "--set", help="override a config value: training.train_iters=10"),
        distributed: bool = typer.Option(False, "--distributed",
                                         help="dispatch the steps to the npu/cpu/gpu pools' workers"),
        retries: int = typer.Option(2, help="attempts after an infrastructure failure (never after a bad input)"),
        retry_delay: float = typer.Option(10.0, help="seconds before the first retry (tripled each time)"),
        verbose: bool = typer.Option(False, "--verbose", "-v", help="show Prefect's own log lines"),
        from_hf: Optional[Path] = typer.Option(None, "--from-hf", help="start from this Hugging Face checkpoint: "
                                               "step 1 imports it (cpu) instead of base training"),
        fail_fast: bool = typer.Option(True, "--fail-fast/--no-fail-fast", help="stop both trainings as soon as "
                                       "what they logged cannot pass any more (the site's fail_fast: false too)"),
    ) -> None:
        """Run the six-step alignment; prints the verdict. Exit 0 pass, 1 fail, 2 invalid or bad input."""
        from crossalign.config import ConfigError
        from crossalign.site import SiteError
        from crossalign.store import RunStore, StoreError, check_run_id
        from crossalign.tasks.prepare import default_run_id, resolve_config

        with user_errors(ConfigError, SiteError, StoreError):
            resolved, _ = resolve_config(config, overrides)
            root = _store_root(store)
            run_id = check_run_id(run_id or default_run_id(resolved))
            if RunStore(root).exists(run_id):
                RunStore(root).run(run_id).check_config(resolved)
            if from_hf is not None:  # not a Hugging Face folder: said here, before any flow starts
                from crossalign.tasks.prepare import hf_start

                hf_start(from_hf)
        raise typer.Exit(_run_flow(config=config, run_id=run_id, root=root, overrides=overrides, rerun=[],
                                   distributed=distributed, retries=retries, retry_delay=retry_delay,
                                   verbose=verbose, from_hf=from_hf, fail_fast=fail_fast))

    @app.command("rerun")
    def rerun_command(
        run_id: str = typer.Argument(..., help="the run to redo part of"),
        step: str = typer.Option(..., "--step", help="the step to redo; everything downstream is redone too"),
        store: Optional[Path] = typer.Option(None, "--store", help="the run store (default: the site's store)"),
        distributed: Optional[bool] = typer.Option(None, "--distributed/--embedded",
                                                   help="dispatch the steps to the pools' workers, or run them "
                                                   "here (default: as the run was started)"),
        retries: int = typer.Option(2, help="attempts after an infrastructure failure"),
        retry_delay: float = typer.Option(10.0, help="seconds before the first retry"),
        verbose: bool = typer.Option(False, "--verbose", "-v", help="show Prefect's own log lines"),
    ) -> None:
        """Invalidate STEP and everything downstream of it, then run the flow again (finished upstream steps are skipped)."""
        from crossalign.site import SiteError
        from crossalign.store import RunStore, StoreError, downstream

        with user_errors(SiteError, StoreError):
            root = _store_root(store)
            run = RunStore(root).run(run_id)
            affected = downstream(step)
        if distributed is None:
            distributed = run.info["parameters"].get("mode") == "distributed"
        console.print(f"redoing {', '.join(affected)}", highlight=False)
        raise typer.Exit(_run_flow(config=None, run_id=run_id, root=root, overrides=[], rerun=[affected[0]],
                                   distributed=distributed, retries=retries, retry_delay=retry_delay,
                                   verbose=verbose))

    @app.command("runs")
    def runs_command(store: Optional[Path] = typer.Option(None, "--store", help="the run store")) -> None:
        """List the runs in the store."""
        from rich.table import Table

        from crossalign.site import SiteError
        from crossalign.store import RunStore, StoreError

        with user_errors(SiteError, StoreError):
            root = _store_root(store)
            runs = RunStore(root).runs()
            table = Table(title=f"runs in {RunStore(root).root}", title_justify="left")
            # the id is what users copy into the next command: the other columns wrap, it never does
            table.add_column("run", no_wrap=True, min_width=max((len(run.run_id) for run in runs), default=3))
            for column in ("model", "created", "steps done", "state", "verdict"):
                table.add_column(column)
            for run in runs:
                info = run.info
                states = run.states()
                done = sum(s.status == "done" for s in states)
                worst = next((s.status for s in states if s.status in ("failed", "interrupted", "running")), None)
                verdict, _ = _verdict(run)
                table.add_row(run.run_id, info["config"]["model"]["name"], info.get("created", "")[:16].replace("T", " "),
                              f"{done}/{len(states)}",
                              _styled(worst or ("done" if done == len(states) else "partial")),
                              verdict or "")
        console.print(table if runs else f"no runs in {RunStore(root).root}")

    @app.command("status")
    def status_command(run_id: str = typer.Argument(..., help="the run id"),
                       store: Optional[Path] = typer.Option(None, "--store", help="the run store")) -> None:
        """Per-step state, host, duration and outputs of one run."""
        from crossalign.site import SiteError
        from crossalign.store import RunStore, StoreError

        with user_errors(SiteError, StoreError):
            run = RunStore(_store_root(store)).run(run_id)
            console.print(_status_table(run))
            verdict, report = _verdict(run)
        if verdict is not None:
            console.print(f"verdict: {verdict}    report: {report}", highlight=False)

    agent_app = typer.Typer(name="agent", help="Run this machine as a worker of a pool (npu, cpu, gpu, orchestrator).",
                            no_args_is_help=True)
    app.add_typer(agent_app, name="agent")

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
        from rich.table import Table

        from crossalign.agents.pools import POOLS
        from crossalign.agents.probe import missing, probe_pool
        from crossalign.patching import PatchError
        from crossalign.site import SiteError, load_site, site_path

        if pool not in POOLS:
            err_console.print(f"[bold red]error:[/] --pool {pool!r} is not one of {', '.join(POOLS)}")
            raise typer.Exit(2)
        from crossalign.agents.worker import AgentAlreadyRunning, default_worker_name, hold_worker_lock

        with user_errors(SiteError, PatchError, AgentAlreadyRunning):
            site_file = site_file or site_path()
            site = load_site(site_file)
            name = name or default_worker_name(pool)
            # before anything slow: a second worker of this name would double the pool
            lock_fd = hold_worker_lock(pool, name, _server_url(required=False, site_file=site_file) or "")
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
            raise typer.Exit(2)
        if probe_only:
            return
        _server_url(required=True, site_file=site_file)
        _quiet_prefect(verbose=True)
        from crossalign.agents.worker import ensure_pool, run_worker, worker_environment

        created = ensure_pool(pool)
        env = worker_environment(site, site_file)
        console.print(f"pool {pool}: {'created' if created else 'exists'}; store {env['CROSSALIGN_STORE']}; "
                      "starting the worker", highlight=False)
        raise typer.Exit(run_worker(pool, env, name=name, limit=limit, lock_fd=lock_fd))

    @app.command("deploy")
    def deploy_command(prefect_file: Path = typer.Option(Path("prefect.yaml"), "--prefect-file",
                                                         help="the deployments file"),
                       site_file: Optional[Path] = typer.Option(None, "--site", help="the site config, for its "
                                                                "prefect_api_url (default: $CROSSALIGN_SITE or "
                                                                "./crossalign.site.yaml)")) -> None:
        """Create the orchestrator/npu/cpu/gpu pools if missing, deploy every flow of prefect.yaml and turn on
        the detection of flow runs whose machine died."""
        import yaml

        from crossalign.agents.automation import DEFAULT_ZOMBIE_AFTER_S
        from crossalign.agents.worker import DeployError, deploy
        from crossalign.site import site_path

        url = _server_url(required=True, site_file=site_file or site_path())
        _quiet_prefect(verbose=True)
        with user_errors(FileNotFoundError, DeployError):
            deploy(prefect_file)
        deployments = yaml.safe_load(prefect_file.read_text()).get("deployments", [])
        ui = url.rstrip("/").removesuffix("/api")
        console.print(f"deployed {len(deployments)} deployments of {prefect_file} to {ui}; a flow run silent for "
                      f"{DEFAULT_ZOMBIE_AFTER_S} s (its machine died) is marked Crashed and its step retried",
                      highlight=False, soft_wrap=True)
        console.print("next, on each machine, for its pools: crossalign agent start --pool orchestrator|npu|cpu|gpu",
                      highlight=False, soft_wrap=True)
        console.print(f"then: crossalign run qwen35_dense_tiny --distributed, or in the UI ({ui}): Deployments, "
                      "alignment/dense-tiny, Run", highlight=False, soft_wrap=True)

    server_app = typer.Typer(name="server", help="The Prefect server the agents and the UI talk to.",
                             no_args_is_help=True)
    app.add_typer(server_app, name="server")

    @server_app.command("start")
    def server_start(
        host: str = typer.Option("127.0.0.1", "--host", help="address to listen on (0.0.0.0: every interface)"),
        port: int = typer.Option(4200, "--port", help="port of the UI and the API"),
        url: Optional[str] = typer.Option(None, "--url", help="the address browsers and agents use "
                                          "(default: http://<this host's name>:PORT when listening beyond loopback)"),
        data: Optional[Path] = typer.Option(None, "--data", help="server home and its PostgreSQL cluster, kept "
                                            "between starts (default: ~/.crossalign/server, as root "
                                            "/var/lib/crossalign/server)"),
        insecure: bool = typer.Option(False, "--insecure", help="listen beyond loopback without basic auth"),
    ) -> None:
        """Run the Prefect server on PostgreSQL until stopped (Ctrl-C, SIGTERM).

        The database is $PREFECT_SERVER_DATABASE_CONNECTION_URL if set, else a PostgreSQL cluster of
        its own in --data. Beyond loopback anyone who reaches the port could start runs on the GPU
        and NPU machines, so it needs $PREFECT_SERVER_API_AUTH_STRING (user:password) unless --insecure.
        """
        import signal
        import socket
        import sys

        from crossalign.agents.server import AUTH_ENV, CLIENT_AUTH_ENV, LOOPBACK, ServerStartError, local_server

        beyond_loopback = host not in LOOPBACK
        if beyond_loopback and not os.environ.get(AUTH_ENV) and not insecure:
            err_console.print(f"[bold red]error:[/] --host {host} lets other machines start runs: set {AUTH_ENV}="
                              "user:password (agents and the CLI then need the same value in "
                              f"{CLIENT_AUTH_ENV}), or pass --insecure", highlight=False, soft_wrap=True)
            raise typer.Exit(EXIT_INVALID)
        if url is None and beyond_loopback:
            url = f"http://{socket.getfqdn()}:{port}"
        if beyond_loopback and _is_loopback_url(url):
            err_console.print(f"[bold red]error:[/] --host {host} serves other machines, but {url} is this machine's "
                              "loopback address, which would send their agents and browsers to themselves: pass "
                              f"--url http://ADDRESS:{port} with the name or address they reach this machine by",
                              highlight=False, soft_wrap=True)
            raise typer.Exit(EXIT_INVALID)
        if data is None:
            data = Path("/var/lib/crossalign/server") if os.geteuid() == 0 else Path("~/.crossalign/server")
        data = data.expanduser().absolute()
        # Ctrl-C and SIGTERM leave the block below, which stops the server and then PostgreSQL
        signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
        try:
            with local_server(data / "prefect", scheduler=True, database="postgres", host=host, port=port,
                              ui_url=url, database_url=os.environ.get("PREFECT_SERVER_DATABASE_CONNECTION_URL"),
                              postgres_dir=data / "postgres") as server:
                console.print(f"Prefect server up: UI {server.ui_url}  (log {server.home / 'server.log'})",
                              highlight=False)
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

    @app.command("serve")
    def serve_command(
        store: Optional[Path] = typer.Option(None, "--store", help="the run store (default: the site's store)"),
        host: str = typer.Option("127.0.0.1", "--host", help="address to listen on (0.0.0.0: every interface)"),
        port: int = typer.Option(8080, "--port", help="port to listen on"),
    ) -> None:
        """Serve the run store read-only over HTTP: the reports and plots the Prefect UI links to."""
        from crossalign.report.serve import serve, store_app
        from crossalign.site import SiteError

        with user_errors(SiteError, FileNotFoundError):
            root = _store_root(store).expanduser().absolute()
            served = store_app(root)
        shown = host if host in ("127.0.0.1", "localhost") else "<this host>"
        console.print(f"serving {root} read-only on {host}:{port}; the site config's report_url: "
                      f"http://{shown}:{port}/", highlight=False)
        serve(served, host, port)

    automations_app = typer.Typer(name="automations", help="Server-side automations (zombie runs, nightly alerts).",
                                  no_args_is_help=True)
    app.add_typer(automations_app, name="automations")

    @automations_app.command("install")
    def automations_install(
        webhook: Optional[str] = typer.Option(None, "--webhook", help="URL to call when a nightly run fails"),
        zombie_after: int = typer.Option(90, "--zombie-after", help="seconds without heartbeat before a flow "
                                         "run counts as crashed (as `crossalign deploy` sets it); keep it well "
                                         "above the heartbeat interval of every flow on the server (crossalign's "
                                         "30 s, Prefect's default 180 s)"),
    ) -> None:
        """Create (or replace) crossalign's automations on the Prefect server in PREFECT_API_URL."""
        from crossalign.agents.automation import AutomationError, install_automations

        _server_url(required=True)
        _quiet_prefect(verbose=True)
        with user_errors(AutomationError):
            installed = install_automations(webhook, zombie_after)
        for name, automation_id in installed.items():
            console.print(f"automation {name}: {automation_id}", highlight=False)
        if webhook is None:
            console.print("no --webhook: the nightly failure alert was not installed", highlight=False)
