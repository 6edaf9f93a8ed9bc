"""What a site runs on this machine, and ``crossalign down``, which ends it.

``crossalign server start``, ``serve`` and ``agent start`` each record themselves in the site's folder on this
machine (``crossalign.site.site_home``: ``processes/<key>.json``, with the process's start time, so that a pid the
system reused is never taken for it) for as long as they run. ``end_recorded`` ends them: the agents first (each
stops its worker), then the report server, then the Prefect server (which stops its PostgreSQL), each with SIGTERM
and, after a grace period, SIGKILL, with whatever it started (the worker's flow-run processes, a training) that is
still there afterwards. It says what it ended.
"""

from __future__ import annotations

import json
import os
import signal
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from crossalign.agents.server import ServerStartError, stop_postgres
from crossalign.site import site_home

ORDER = ("agent", "report server", "Prefect server")  # what is ended first: nothing then starts new work
GRACE_S = 30.0  # an agent stops within 10 s; a server stops PostgreSQL after it


@dataclass(frozen=True)
class Recorded:
    """A process of the site on this machine: what it is (``kind``, one of ORDER), its pid and start time, and
    what it says about itself (``details``: the pool, the URL, the data folder)."""

    path: Path
    kind: str
    pid: int
    create_time: float
    details: dict[str, Any] = field(default_factory=dict)

    def process(self) -> psutil.Process | None:
        """The live process, or None when it ended (or its pid now belongs to another process)."""
        try:
            process = psutil.Process(self.pid)
            if abs(process.create_time() - self.create_time) < 1.0 and process.status() != psutil.STATUS_ZOMBIE:
                return process
        except psutil.Error:
            pass
        return None

    def title(self) -> str:
        what = f"{self.kind} {self.details['pool']}" if self.kind == "agent" else f"the {self.kind}"
        where = self.details.get("url")
        return f"{what} (pid {self.pid}{', ' + where if where else ''})"


def records_dir(site_file: Path | None) -> Path:
    return site_home(site_file) / "processes"


def record_this_process(site_file: Path | None, key: str, kind: str, **details: Any) -> Path:
    """Record the calling process as ``kind`` of the site under ``key`` (one record per key); returns the record,
    which the caller removes when it ends (a record whose process is gone is ignored and cleared)."""
    folder = records_dir(site_file)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{key}.json"
    entry = {"kind": kind, "pid": os.getpid(), "create_time": psutil.Process().create_time(), "details": details}
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(entry, indent=2) + "\n")
    os.replace(temporary, path)
    return path


def forget(path: Path) -> None:
    """Remove the record at ``path`` if it is still the calling process's."""
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def recorded(site_file: Path | None) -> list[Recorded]:
    """The site's processes that still run on this machine, in the order ``end_recorded`` ends them; the records of
    processes that are gone are removed."""
    found = []
    folder = records_dir(site_file)
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            entry = json.loads(path.read_text())
            record = Recorded(path, entry["kind"], int(entry["pid"]), float(entry["create_time"]),
                              entry.get("details", {}))
        except (OSError, ValueError, KeyError):
            continue
        if record.process() is None:
            path.unlink(missing_ok=True)
        else:
            found.append(record)
    return sorted(found, key=lambda record: ORDER.index(record.kind) if record.kind in ORDER else len(ORDER))


def end_recorded(site_file: Path | None, grace_s: float = GRACE_S) -> list[str]:
    """End the site's processes on this machine (see the module); returns one line per process ended."""
    said = []
    for record in recorded(site_file):
        process = record.process()
        if process is None:
            continue
        started = process.children(recursive=True)
        how = _end(process, grace_s)
        left = [child for child in started if _alive(child)]
        for child in left:
            _end(child, grace_s)
        line = f"ended {record.title()}{how}"
        if left:
            line += f" and {len(left)} process{'es' if len(left) > 1 else ''} it had started ({_pids(left)})"
        elif started:
            line += f", with what it had started ({_pids(started)})"
        if record.kind == "Prefect server" and record.details.get("postgres"):
            line += "; " + _postgres_stopped(Path(record.details["postgres"]))
        said.append(line)
        record.path.unlink(missing_ok=True)
    return said


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _end(process: psutil.Process, grace_s: float) -> str:
    """SIGTERM, then SIGKILL after ``grace_s``; says how it ended when it took the kill."""
    try:
        process.send_signal(signal.SIGTERM)
    except psutil.NoSuchProcess:
        return ""
    if _gone_within(process, grace_s):
        return ""
    with suppress(psutil.NoSuchProcess):
        process.kill()
    _gone_within(process, grace_s)
    return f" (killed: still running {grace_s:.0f} s after SIGTERM)"


def _gone_within(process: psutil.Process, seconds: float) -> bool:
    """Whether ``process`` ends within ``seconds``; an ended process its parent has not reaped yet (a zombie)
    counts as ended (psutil's own wait would wait for the reaping)."""
    deadline = time.monotonic() + seconds
    while _alive(process):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _pids(processes: list[psutil.Process]) -> str:
    return "pid" + ("s " if len(processes) > 1 else " ") + ", ".join(str(p.pid) for p in processes)


def _postgres_stopped(folder: Path) -> str:
    """Its PostgreSQL cluster stopped: by the server as it ended, else here (a server that took the kill)."""
    if not (folder / "data" / "postmaster.pid").exists():
        return f"its PostgreSQL ({folder}) is stopped"
    try:
        stop_postgres(folder)
    except ServerStartError as exc:
        return f"its PostgreSQL ({folder}) did not stop: {exc}"
    return f"its PostgreSQL ({folder}) is stopped (it outlived the server)"
