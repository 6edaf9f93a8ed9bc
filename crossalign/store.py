"""The run store: every run's config, every step's outputs and the proof that they are complete.

Layout on storage that every agent mounts (a local folder by default)::

    <store>/<run_id>/run.json              config snapshot, parameters, dataset, code version
    <store>/<run_id>/01-base-train/        one folder per step, present only when complete:
        manifest.json                      status, host, command, timings, input digests,
        ...                                every output with its size and sha256
    <store>/<run_id>/.attempts/<step>.json the running or failed attempt of a step (for `status`)
    <store>/datasets/<vocab>/              the shipped corpus, prepared once for all runs

A step writes into a temporary sibling (``.01-base-train.partial-<host>-<pid>-<nonce>``) and
renames it into place only after its manifest is written, so a killed step leaves nothing that
looks complete. A step is done iff its manifest exists, its input digests still match and its
outputs still have the sizes the manifest lists (their sha256 too, when the orchestrator asks on a
retry or a rerun): the digest of an upstream step is the sha256 of that step's manifest (which
lists the sha256 of every output), never of the multi-GB files themselves. Re-running an upstream
step therefore makes everything downstream stale without touching it. The steps, their folders and
what each reads are the DAG's table (``crossalign.dag``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Literal

from crossalign.config import AlignmentConfig
from crossalign.dag import STEP_NAMES, StepSpec, downstream, step_for, step_spec
from crossalign.data.files import DatasetFiles

DUMP_REQUESTS = "dump_requests"  # run.json: {step: msprobe dump settings} asked by crossalign rerun --dump

MANIFEST = "manifest.json"
RUN_INFO = "run.json"
ATTEMPTS = ".attempts"
FORMAT_VERSION = 1


class StoreError(ValueError):
    """A run or step that cannot be used as asked (missing run, unknown step, config clash)."""


class StepNotReady(StoreError):
    """A step was started before the steps it reads from were complete."""


class StaleInputs(StoreError):
    """An input of a step changed while the step ran; its outputs would describe old inputs."""


# ---- small file helpers ---------------------------------------------------------------------


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_json(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON through a temporary sibling and a rename, so readers never see half a file."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=2, sort_keys=False)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise StoreError(f"{path}: not valid JSON: {exc}") from exc


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_tree(path: Path) -> None:
    """Remove a folder by first renaming it out of the way, so no reader sees it half-deleted."""
    if not path.exists():
        return
    trash = path.with_name(f".{path.name}.trash-{uuid.uuid4().hex[:8]}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def dataset_fingerprint(data: DatasetFiles) -> str:
    """A digest of a prepared dataset: sha256 of its index and tokenizer, plus the size of its data file.

    The ``.idx`` holds every document's length and offset, so a changed corpus changes it; the
    ``.bin`` can be many GB and is represented by its size only.
    """
    prefix = Path(data.prefix)
    idx, bin_ = prefix.with_name(prefix.name + ".idx"), prefix.with_name(prefix.name + ".bin")
    for path in (idx, bin_, Path(data.tokenizer)):
        if not path.exists():
            raise StoreError(f"dataset file {path} does not exist")
    return sha256_json({"idx": sha256_file(idx), "bin_size": bin_.stat().st_size,
                        "tokenizer": sha256_file(Path(data.tokenizer))})


# ---- step states ----------------------------------------------------------------------------

StepStatus = Literal["done", "stale", "running", "interrupted", "failed", "pending"]


@dataclass
class StepState:
    """What ``crossalign status`` shows for one step."""

    spec: StepSpec
    status: StepStatus
    manifest: dict[str, Any] | None = None
    attempt: dict[str, Any] | None = None

    @property
    def host(self) -> str:
        source = self.manifest or self.attempt or {}
        return source.get("host", "")

    @property
    def seconds(self) -> float | None:
        if self.manifest is not None:
            return self.manifest.get("seconds")
        if self.attempt is not None and "seconds" in self.attempt:
            return self.attempt["seconds"]
        return None


@dataclass
class StepWriter:
    """The staging folder of a step in progress; ``details`` ends up in the manifest.

    ``final_dir`` is where ``dir`` is renamed to when the step commits: the path to write into
    anything (a log line, a script) that names the step's folder.
    """

    dir: Path
    final_dir: Path
    details: dict[str, Any] = field(default_factory=dict)


class Run:
    """One run folder: its run.json and its six step folders."""

    def __init__(self, store: "RunStore", run_id: str):
        self.store = store
        self.run_id = run_id
        self.path = store.root / run_id

    def __repr__(self) -> str:
        return f"Run({self.path})"

    # -- run.json --------------------------------------------------------------------------

    @property
    def info(self) -> dict[str, Any]:
        path = self.path / RUN_INFO
        if not path.exists():
            raise StoreError(f"run {self.run_id!r} has no {RUN_INFO} in {self.path}")
        return read_json(path)

    @property
    def config(self) -> AlignmentConfig:
        return AlignmentConfig.model_validate(self.info["config"])

    @property
    def dataset(self) -> DatasetFiles:
        data = self.info.get("dataset")
        if not data:
            raise StoreError(f"run {self.run_id!r}: run.json records no dataset")
        return DatasetFiles(prefix=Path(data["prefix"]), tokenizer=Path(data["tokenizer"]))

    @property
    def start(self) -> dict[str, Any]:
        """Where step 1's weights come from, as recorded at creation: base training from a random init
        (``{"from": "base-train"}``) or an import of Hugging Face weights (``{"from": "huggingface",
        "path": ..., "config_sha256": ...}``)."""
        return self.info.get("start") or {"from": "base-train"}

    def spec(self, step: str) -> StepSpec:
        """The spec that carries out ``step`` in this run (``crossalign.dag.step_for``: step 1 of a run started
        from Hugging Face weights is their import)."""
        return step_for(step, self.start)

    def pool(self, step: str) -> str:
        """The pool that carries out ``step`` in this run."""
        return self.spec(step).pool

    def check_config(self, config: AlignmentConfig) -> None:
        """Refuse to reuse this run for another config: its finished steps describe another experiment."""
        if sha256_json(self.info["config"]) != sha256_json(config.model_dump(mode="json")):
            raise StoreError(f"run {self.run_id!r} in {self.store.root} exists with a different config; "
                             f"choose another run id or rerun it as it is")

    def update_info(self, **fields: Any) -> None:
        info = self.info
        info.update(fields)
        write_json_atomic(self.path / RUN_INFO, info)

    # -- msprobe dump requests (crossalign rerun --dump) -------------------------------------

    def request_dump(self, steps: list[str], settings: dict[str, Any] | None) -> None:
        """Make ``steps`` take an msprobe dump with ``settings`` (``DumpSettings`` as JSON) when they next run, or
        (None) no longer ask them to: recorded in run.json, which every pool's worker reads."""
        before = dict(self.info.get(DUMP_REQUESTS) or {})
        requests = dict(before)
        for step in steps:
            if settings is None:
                requests.pop(step, None)
            else:
                requests[step] = settings
        if requests != before:
            self.update_info(**{DUMP_REQUESTS: requests})

    def dump_request(self, step: str) -> dict[str, Any] | None:
        """The dump settings ``crossalign rerun --dump`` asked of ``step``, None if it asked none."""
        return (self.info.get(DUMP_REQUESTS) or {}).get(step)

    # -- steps -----------------------------------------------------------------------------

    def step_dir(self, step: str) -> Path:
        return self.path / step_spec(step).dirname

    def manifest(self, step: str) -> dict[str, Any] | None:
        path = self.step_dir(step) / MANIFEST
        return read_json(path) if path.exists() else None

    def input_digests(self, step: str) -> dict[str, str]:
        """The current digests of everything ``step`` reads; raises StepNotReady if an input step is not done."""
        spec = step_spec(step)
        info = self.info
        digests = {"config": sha256_json(info["config"])}
        if spec.index == 1 and self.start["from"] != "base-train":
            digests["start"] = sha256_json(info["start"])  # another source of step 1's weights redoes the run
        if spec.uses_dataset:
            if not info.get("dataset"):
                raise StepNotReady(f"run {self.run_id!r}: step {spec.name} needs a dataset and run.json records none")
            digests["dataset"] = info["dataset"]["fingerprint"]
        for upstream in spec.inputs:
            if not self.is_done(upstream):
                raise StepNotReady(f"run {self.run_id!r}: step {spec.name} needs {upstream}, which is not done")
            digests[upstream] = sha256_file(self.step_dir(upstream) / MANIFEST)
        return digests

    def is_done(self, step: str, *, checksums: bool = False) -> bool:
        """The step's manifest is complete, its inputs are unchanged and its outputs are intact.

        Output sizes are always compared with the manifest (a stat per file); ``checksums`` also
        recomputes every output's sha256, which reads the whole checkpoint: the orchestrator asks
        for it on a retry or a rerun, where an output may have been damaged since it was committed.
        """
        manifest = self.manifest(step)
        if manifest is None or manifest.get("status") != "done":
            return False
        try:
            if manifest.get("inputs") != self.input_digests(step):
                return False
        except StepNotReady:
            return False
        return not self.damaged_outputs(step, checksums=checksums)

    def damaged_outputs(self, step: str, *, checksums: bool = False) -> list[str]:
        """The outputs of a committed step that are missing or differ from its manifest, each with why."""
        folder = self.step_dir(step)
        damaged = []
        for output in (self.manifest(step) or {}).get("outputs", []):
            path = folder / output["path"]
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                damaged.append(f"{output['path']}: missing")
                continue
            if size != output["size"]:
                damaged.append(f"{output['path']}: {size} bytes, the manifest says {output['size']}")
            elif checksums and sha256_file(path) != output["sha256"]:
                damaged.append(f"{output['path']}: sha256 differs from the manifest")
        return damaged

    def attempt(self, step: str) -> dict[str, Any] | None:
        path = self.path / ATTEMPTS / f"{step_spec(step).name}.json"
        return read_json(path) if path.exists() else None

    def _write_attempt(self, step: str, record: dict[str, Any]) -> None:
        folder = self.path / ATTEMPTS
        folder.mkdir(exist_ok=True)
        write_json_atomic(folder / f"{step}.json", record)

    def _clear_attempt(self, step: str) -> None:
        (self.path / ATTEMPTS / f"{step}.json").unlink(missing_ok=True)

    def record_failure(self, step: str, error: str, *, retryable: bool) -> None:
        """Note a failed attempt, so that `status` can show it and the orchestrator can decide on a retry."""
        record = self.attempt(step) or {"step": step, "host": socket.gethostname()}
        record.update(status="failed", error=error, retryable=retryable, finished=now_iso())
        if "started_at" in record:
            record["seconds"] = round(time.time() - record["started_at"], 3)
        self._write_attempt(step, record)

    def state(self, step: str) -> StepState:
        spec = step_spec(step)
        manifest = self.manifest(spec.name)
        if manifest is not None:
            return StepState(spec, "done" if self.is_done(spec.name) else "stale", manifest, self.attempt(spec.name))
        attempt = self.attempt(spec.name)
        if attempt is None:
            return StepState(spec, "pending")
        if attempt.get("status") == "running":
            dead = attempt.get("host") == socket.gethostname() and not _pid_alive(int(attempt.get("pid", 0)))
            return StepState(spec, "interrupted" if dead else "running", None, attempt)
        return StepState(spec, "failed", None, attempt)

    def states(self) -> list[StepState]:
        return [self.state(s) for s in STEP_NAMES]

    def _partials(self, spec: StepSpec) -> list[Path]:
        return sorted(self.path.glob(f".{spec.dirname}.partial-*"))

    def _clean_partials(self, spec: StepSpec) -> None:
        """Remove staging folders left by killed attempts (any not owned by a live process on this host)."""
        here = socket.gethostname()
        for partial in self._partials(spec):
            owner = partial.name.split(".partial-", 1)[1].rsplit("-", 2)
            if len(owner) == 3 and owner[0] == here and owner[1].isdigit() and _pid_alive(int(owner[1])) \
                    and int(owner[1]) != os.getpid():
                continue
            shutil.rmtree(partial, ignore_errors=True)

    @contextmanager
    def commit(self, step: str, command: str) -> Iterator[StepWriter]:
        """Run a step's work in a staging folder and rename it into place only when it completed.

        Raises StepNotReady before anything is written if an input step is not done, and
        StaleInputs at the end if an input changed meanwhile. On any error the staging folder is
        removed and the attempt is recorded as failed; the previous output (if any) stays.
        """
        spec = step_spec(step)
        inputs = self.input_digests(spec.name)
        self._clean_partials(spec)
        host, pid = socket.gethostname(), os.getpid()
        staging = self.path / f".{spec.dirname}.partial-{host}-{pid}-{uuid.uuid4().hex[:8]}"
        staging.mkdir()
        started_at = time.time()
        self._write_attempt(spec.name, {"step": spec.name, "status": "running", "host": host, "pid": pid,
                                        "command": command, "started": now_iso(), "started_at": started_at})
        writer = StepWriter(staging, final_dir=self.step_dir(spec.name))
        try:
            yield writer
            if self.input_digests(spec.name) != inputs:
                raise StaleInputs(f"run {self.run_id!r}: an input of step {spec.name} changed while it ran")
            finished_at = time.time()
            manifest = {
                "format": FORMAT_VERSION, "run_id": self.run_id, "step": spec.name, "status": "done",
                "host": host, "pid": pid, "command": command,
                "started": datetime.fromtimestamp(started_at, timezone.utc).isoformat(timespec="seconds"),
                "finished": datetime.fromtimestamp(finished_at, timezone.utc).isoformat(timespec="seconds"),
                "seconds": round(finished_at - started_at, 3),
                "inputs": inputs, "outputs": _list_outputs(staging), "details": writer.details,
            }
            write_json_atomic(staging / MANIFEST, manifest)
            final = self.step_dir(spec.name)
            old = None
            if final.exists():
                old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
                os.replace(final, old)
            os.replace(staging, final)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            self._clear_attempt(spec.name)
        except BaseException as exc:
            shutil.rmtree(staging, ignore_errors=True)
            self.record_failure(spec.name, f"{type(exc).__name__}: {exc}", retryable=_is_retryable(exc))
            raise

    def invalidate(self, step: str) -> list[str]:
        """Remove ``step`` and everything downstream of it; returns the steps removed."""
        removed = []
        for name in downstream(step):
            if self.step_dir(name).exists():
                removed.append(name)
            _remove_tree(self.step_dir(name))
            self._clear_attempt(name)
        return removed


def _is_retryable(exc: BaseException) -> bool:
    """Infrastructure trouble (I/O, network, interruption) may pass; everything else fails the same way again."""
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        return True
    if isinstance(exc, ValueError):
        return False
    return isinstance(exc, (OSError, ConnectionError, TimeoutError))


def _list_outputs(folder: Path) -> list[dict[str, Any]]:
    outputs = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel == MANIFEST:
            continue
        outputs.append({"path": rel, "size": path.stat().st_size, "sha256": sha256_file(path)})
    return outputs


class RunStore:
    """The folder that holds every run (``site.store``)."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().absolute()

    def __repr__(self) -> str:
        return f"RunStore({self.root})"

    def run(self, run_id: str) -> Run:
        """An existing run; raises StoreError naming the store if there is none."""
        run = Run(self, check_run_id(run_id))
        if not (run.path / RUN_INFO).exists():
            raise StoreError(f"no run {run_id!r} in {self.root}")
        return run

    def exists(self, run_id: str) -> bool:
        return (self.root / check_run_id(run_id) / RUN_INFO).exists()

    def create_run(self, run_id: str, config: AlignmentConfig, *, config_source: str,
                   parameters: dict[str, Any], code_version: dict[str, Any],
                   start: dict[str, Any] | None = None) -> Run:
        """Create a run, or open it again if it exists with the same config (a resume).

        A run id that exists with a different config, or with another ``start`` when one is
        given (see :attr:`Run.start`), is refused: its finished steps describe another experiment.
        """
        run = Run(self, check_run_id(run_id))
        if (run.path / RUN_INFO).exists():
            run.check_config(config)
            if start is not None and run.start != start:
                raise StoreError(f"run {run_id!r} in {self.root} was started from {run.start}, not {start}")
            return run
        run.path.mkdir(parents=True, exist_ok=True)
        write_json_atomic(run.path / RUN_INFO, {
            "format": FORMAT_VERSION, "run_id": run_id, "created": now_iso(), "host": socket.gethostname(),
            "config_source": config_source, "parameters": parameters, "code_version": code_version,
            "config": config.model_dump(mode="json"), "dataset": None, "start": start or {"from": "base-train"},
        })
        return run

    def runs(self) -> list[Run]:
        if not self.root.exists():
            return []
        return [Run(self, p.name) for p in sorted(self.root.iterdir()) if (p / RUN_INFO).exists()]

    def dataset_dir(self, vocab_size: int) -> Path:
        return self.root / "datasets" / str(vocab_size)


def new_run_id(model: str) -> str:
    """A fresh run id, ``<model>-YYYYMMDD-HHMMSS-<4 hex>``, for runs started from the CLI and the UI alike.

    The time says when it was started; the random suffix keeps two runs started in the same
    second (two users, a script) apart, which would otherwise share one folder and become one run.
    """
    while True:  # one process never hands out an id twice; two processes collide once in 65,536 same-second pairs
        run_id = check_run_id(f"{model}-{datetime.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:4]}")
        if run_id not in _ISSUED_RUN_IDS:
            _ISSUED_RUN_IDS.add(run_id)
            return run_id


_ISSUED_RUN_IDS: set[str] = set()
_NEW_RUN_ID = re.compile(r"[A-Za-z0-9_.-]+-\d{8}-\d{6}-[0-9a-f]{4}")


def is_new_run_id(text: str) -> bool:
    """Whether ``text`` has the form of a run id :func:`new_run_id` makes."""
    return _NEW_RUN_ID.fullmatch(text) is not None


def check_run_id(run_id: str) -> str:
    """The run id itself if it is usable as a folder name; raises StoreError otherwise."""
    if not run_id or run_id.startswith(".") or "/" in run_id or run_id != run_id.strip() or run_id == "datasets":
        raise StoreError(f"invalid run id {run_id!r}: use letters, digits, dashes, dots or underscores")
    if not all(c.isalnum() or c in "-_." for c in run_id):
        raise StoreError(f"invalid run id {run_id!r}: use letters, digits, dashes, dots or underscores")
    return run_id
