"""Before the six steps: resolve the config, create (or reopen) the run, and settle its dataset.

The run's config snapshot in run.json is the single source every step reads, so overrides
given on the command line (``--set training.train_iters=10``) are applied here once, validated
like a config file, and frozen into the run.
"""

from __future__ import annotations

import fcntl
import subprocess
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

import yaml
from pydantic import ValidationError

import crossalign
from crossalign.backends.base import DatasetFiles
from crossalign.config import AlignmentConfig, ConfigError, resolve_config_path
from crossalign.store import Run, RunStore, StoreError, dataset_fingerprint


class OverrideError(ConfigError):
    """A ``--set KEY=VALUE`` override that does not name a config field or gives it a bad value."""


def parse_override(text: str) -> tuple[list[str], Any]:
    """``training.train_iters=10`` -> (["training", "train_iters"], 10); the value is read as YAML."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise OverrideError(f"--set {text!r}: expected KEY=VALUE with a dotted key, e.g. training.train_iters=10")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError as exc:
        raise OverrideError(f"--set {text!r}: value is not valid YAML: {exc}") from None
    return key.split("."), parsed


def resolve_config(name_or_path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> tuple[AlignmentConfig, Path]:
    """The validated config with ``overrides`` applied, and the file it came from."""
    path = resolve_config_path(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping with 'model' and 'training' sections")
    for text in overrides:
        keys, value = parse_override(text)
        if keys[0] not in ("model", "training"):
            raise OverrideError(f"--set {text!r}: keys start with 'model.' or 'training.'")
        node = raw
        for depth, key in enumerate(keys[:-1]):
            child = node.get(key) if isinstance(node, dict) else None
            if not isinstance(child, dict):
                raise OverrideError(f"--set {text!r}: {'.'.join(keys[:depth + 1])} is not a config section")
            node = child
        node[keys[-1]] = value
    try:
        return AlignmentConfig.model_validate(raw), path
    except ValidationError as exc:
        problems = []
        for item in exc.errors():
            where = ".".join(str(p) for p in item["loc"])
            what = "unknown field" if item["type"] == "extra_forbidden" else item["msg"].removeprefix("Value error, ")
            problems.append(f"{where}: {what}" if where else what)
        origin = f"{path} with --set {' '.join(overrides)}" if overrides else str(path)
        raise ConfigError(f"{origin}: invalid config: " + "; ".join(problems)) from None


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


def default_run_id(config: AlignmentConfig) -> str:
    return f"{config.model.name}-{datetime.now():%Y%m%d-%H%M%S}"


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
                mode: str = "embedded") -> Run:
    """Create the run (or reopen it with the same config), with its dataset recorded in run.json.

    ``mode`` (embedded or distributed) is recorded when the run is created, so that a later
    ``crossalign rerun`` redoes steps the same way.
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
                           code_version=code_version())
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
