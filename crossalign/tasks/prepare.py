"""Before the six steps: create (or reopen) the run from its resolved request, and settle its dataset.

The run's config snapshot in run.json is the single source every step reads: the request's config,
loaded once with its overrides (``crossalign.request.RunRequest.resolve``), is frozen into the run here.
"""

from __future__ import annotations

import fcntl
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import crossalign
from crossalign.data.files import DatasetFiles
from crossalign.data.prepare import prepare_dataset
from crossalign.request import ResolvedRequest
from crossalign.store import Run, RunStore, StoreError, dataset_fingerprint


def code_version() -> dict[str, Any]:
    """The crossalign version and, in a git checkout, the commit and whether the tree had local changes."""
    version: dict[str, Any] = {"crossalign": crossalign.__version__}
    root = Path(crossalign.__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10)
        if commit.returncode == 0:
            version["git_commit"] = commit.stdout.strip()
            dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10)
            version["git_dirty"] = bool(dirty.stdout.strip())
    except (OSError, subprocess.TimeoutExpired):
        pass
    return version


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (a lock file), so two runs never build the same dataset at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def shared_dataset(store: RunStore, vocab_size: int) -> DatasetFiles:
    """The shipped corpus prepared for ``vocab_size`` in ``<store>/datasets/<vocab>/``, built once for all runs."""
    out_dir = store.dataset_dir(vocab_size)
    with _locked(out_dir.with_name(f"{out_dir.name}.lock")):
        return prepare_dataset(out_dir, vocab_size)


def prepare_run(resolved: ResolvedRequest) -> Run:
    """Create the run (or reopen it with the same config), with its dataset recorded in run.json.

    The request's ``mode`` (embedded or distributed) is recorded when the run is created, so that a
    later ``crossalign rerun`` redoes steps the same way; its start (``from_hf``: step 1 imports that
    Hugging Face checkpoint instead of training from a random init) is the run's. A request
    without a config reopens the run as it is.
    """
    request, store, dataset = resolved.request, resolved.store, resolved.dataset
    run_id = resolved.run_id
    if resolved.config is None:
        run = store.run(run_id)
    else:
        parameters = {"config": request.config, "overrides": list(request.overrides), "mode": request.mode,
                      "dataset": None if dataset is None else {"prefix": str(dataset.prefix),
                                                               "tokenizer": str(dataset.tokenizer)}}
        if store.exists(run_id):
            existing = store.run(run_id).info.get("parameters", {})
            if existing.get("dataset") and dataset is None:
                parameters["dataset"] = existing["dataset"]
        run = store.create_run(run_id, resolved.config, config_source=str(resolved.config_source),
                               parameters=parameters, code_version=code_version(), start=resolved.start)
    recorded = run.info.get("dataset")
    if recorded is None:
        files = dataset if dataset is not None else shared_dataset(store, run.config.model.vocab_size)
        run.update_info(dataset={"prefix": str(Path(files.prefix).absolute()),
                                 "tokenizer": str(Path(files.tokenizer).absolute()),
                                 "fingerprint": dataset_fingerprint(files),
                                 "shipped": dataset is None})
    elif dataset is not None and Path(recorded["prefix"]) != Path(dataset.prefix).absolute():
        raise StoreError(f"run {run_id!r} was started with dataset {recorded['prefix']}, not {dataset.prefix}")
    return run
