"""Before the six steps: resolve the config, create (or reopen) the run, and settle its dataset.

The run's config snapshot in run.json is the single source every step reads, so overrides
given on the command line (``--set training.train_iters=10``) are applied here once, validated
like a config file, and frozen into the run.
"""

from __future__ import annotations

import fcntl
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import crossalign
from crossalign.data.files import DatasetFiles
from crossalign.config import AlignmentConfig, load_config, resolve_config_path
from crossalign.store import Run, RunStore, StoreError, dataset_fingerprint, new_run_id, sha256_file


def resolve_config(name_or_path: str | Path, overrides: Sequence[str] = ()) -> tuple[AlignmentConfig, Path]:
    """The validated config with ``overrides`` applied, and the file it came from."""
    return load_config(name_or_path, overrides), resolve_config_path(name_or_path)


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


def hf_start(directory: Path) -> dict[str, Any]:
    """The start record of a run whose step 1 imports a Hugging Face checkpoint (its folder and config.json digest)."""
    config_json = Path(directory).absolute() / "config.json"
    if not config_json.is_file():
        raise StoreError(f"--from-hf {directory}: no config.json there; not a Hugging Face checkpoint folder")
    return {"from": "huggingface", "path": str(config_json.parent), "config_sha256": sha256_file(config_json)}


def default_run_id(config: AlignmentConfig) -> str:
    return new_run_id(config.model.name)


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
    from crossalign.data.prepare import prepare_dataset

    out_dir = store.dataset_dir(vocab_size)
    with _locked(out_dir.with_name(f"{out_dir.name}.lock")):
        return prepare_dataset(out_dir, vocab_size)


def prepare_run(store: RunStore, config_name: str | Path, *, run_id: str | None = None,
                overrides: list[str] | tuple[str, ...] = (), dataset: DatasetFiles | None = None,
                mode: str = "embedded", from_hf: Path | None = None) -> Run:
    """Create the run (or reopen it with the same config), with its dataset recorded in run.json.

    ``mode`` (embedded or distributed) is recorded when the run is created, so that a later
    ``crossalign rerun`` redoes steps the same way. ``from_hf``: step 1 imports this Hugging
    Face checkpoint instead of training from a random init (recorded as the run's start).
    """
    config, path = resolve_config(config_name, overrides)
    run_id = run_id or default_run_id(config)
    parameters = {"config": str(config_name), "overrides": list(overrides), "mode": mode,
                  "dataset": None if dataset is None else {"prefix": str(dataset.prefix),
                                                           "tokenizer": str(dataset.tokenizer)}}
    if store.exists(run_id):
        existing = store.run(run_id).info.get("parameters", {})
        if existing.get("dataset") and dataset is None:
            parameters["dataset"] = existing["dataset"]
    run = store.create_run(run_id, config, config_source=str(path), parameters=parameters,
                           code_version=code_version(), start=None if from_hf is None else hf_start(from_hf))
    recorded = run.info.get("dataset")
    if recorded is None:
        files = dataset if dataset is not None else shared_dataset(store, config.model.vocab_size)
        run.update_info(dataset={"prefix": str(Path(files.prefix).absolute()),
                                 "tokenizer": str(Path(files.tokenizer).absolute()),
                                 "fingerprint": dataset_fingerprint(files),
                                 "shipped": dataset is None})
    elif dataset is not None and Path(recorded["prefix"]) != Path(dataset.prefix).absolute():
        raise StoreError(f"run {run_id!r} was started with dataset {recorded['prefix']}, not {dataset.prefix}")
    return run
