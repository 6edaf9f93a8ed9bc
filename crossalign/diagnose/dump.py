"""The dump format: what each side's forward pass produced, module by module, for one batch.

A dump is one folder per side (format described in ``DUMP_FORMAT.md`` next to this file):
``index.json`` lists the modules in the order their forward finished, with statistics of
every tensor they returned, and ``tensors/`` optionally holds the tensors themselves as
safetensors. This module only knows numpy arrays, so the same writer serves the hooks in
MindSpore, in PyTorch and in the real MindFormers and Megatron runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

import numpy as np

FORMAT = "crossalign-dump"
VERSION = 1
INDEX = "index.json"
TENSOR_DIR = "tensors"
QUANTILES = (0.001, 0.01, 0.25, 0.5, 0.75, 0.99, 0.999)
# Quantiles of larger tensors come from an even stride of this many elements (sorting 500M logits is too slow).
QUANTILE_SAMPLE = 1 << 20
DEFAULT_MAX_TENSOR_BYTES = 64 << 20


class DumpError(ValueError):
    """A dump folder that cannot be written or read; the message names the folder and the entry."""


def entry_key(name: str, call: int) -> str:
    """The key of one module call: ``name`` for the first call, ``name#k`` for the k-th repeat (0-based)."""
    return name if call == 0 else f"{name}#{call}"


def tensor_stats(array: np.ndarray) -> dict[str, Any]:
    """Shape, mean, std, abs max, L2 norm, min, max, quantiles and non-finite counts of an array, in float64."""
    flat = np.asarray(array, dtype=np.float64).reshape(-1)
    finite = flat[np.isfinite(flat)]
    stats: dict[str, Any] = {
        "shape": list(array.shape),
        "numel": int(flat.size),
        "nan": int(np.isnan(flat).sum()),
        "inf": int(np.isinf(flat).sum()),
    }
    if finite.size == 0:
        stats.update(mean=None, std=None, abs_max=None, norm=None, min=None, max=None, quantiles=None)
        return stats
    sample = finite if finite.size <= QUANTILE_SAMPLE else finite[:: finite.size // QUANTILE_SAMPLE]
    values = np.quantile(sample, QUANTILES)
    stats.update(
        mean=float(finite.mean()),
        std=float(finite.std()),
        abs_max=float(np.abs(finite).max()),
        norm=float(np.sqrt(np.square(finite).sum())),
        min=float(finite.min()),
        max=float(finite.max()),
        quantiles={str(q): float(v) for q, v in zip(QUANTILES, values)},
    )
    return stats


def _file_stem(order: int, name: str) -> str:
    return f"{order:05d}_" + re.sub(r"[^A-Za-z0-9_.-]", "_", name or "root")[:120]


class DumpWriter:
    """Writes one dump folder: call :meth:`record` per finished module forward, then :meth:`close`.

    Everything goes to a temporary sibling folder that is renamed into place by ``close``,
    so a crashed run never leaves a folder that looks complete.
    """

    def __init__(self, folder: Path, *, side: str, framework: str, save_tensors: bool = True,
                 max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES, meta: dict[str, Any] | None = None) -> None:
        self.folder = Path(folder)
        if self.folder.exists() and not (self.folder / INDEX).is_file() and any(self.folder.iterdir()):
            raise DumpError(f"{self.folder}: exists and is not a dump folder (no {INDEX}); refusing to replace it")
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = Path(tempfile.mkdtemp(prefix=f".{self.folder.name}.", suffix=".partial", dir=self.folder.parent))
        self.side, self.framework = side, framework
        self.save_tensors, self.max_tensor_bytes = save_tensors, max_tensor_bytes
        self.meta = dict(meta or {})
        self.modules: list[dict[str, Any]] = []
        self._calls: dict[str, int] = {}
        self.closed = False

    def record(self, name: str, type_name: str, outputs: Sequence[tuple[np.ndarray, str]]) -> None:
        """One finished forward of module ``name``: its output tensors as (float array, original dtype)."""
        if self.closed:
            raise DumpError(f"{self.folder}: dump already closed, cannot record {name!r}")
        call = self._calls.get(name, 0)
        self._calls[name] = call + 1
        order = len(self.modules)
        entry: dict[str, Any] = {"order": order, "name": name, "call": call, "key": entry_key(name, call),
                                 "type": type_name, "outputs": []}
        to_save: dict[str, np.ndarray] = {}
        for index, (array, dtype) in enumerate(outputs):
            stats = {"index": index, "dtype": dtype, **tensor_stats(array)}
            if self.save_tensors and array.nbytes <= self.max_tensor_bytes:
                to_save[f"output.{index}"] = np.ascontiguousarray(array, dtype=np.float32)
            entry["outputs"].append(stats)
        if to_save:
            from safetensors.numpy import save_file

            relative = f"{TENSOR_DIR}/{_file_stem(order, name)}.safetensors"
            (self._tmp / TENSOR_DIR).mkdir(exist_ok=True)
            save_file(to_save, str(self._tmp / relative))
            for stats in entry["outputs"]:
                if f"output.{stats['index']}" in to_save:
                    stats["tensor"] = f"{relative}:output.{stats['index']}"
        self.modules.append(entry)

    def close(self) -> Path:
        """Write index.json and move the folder into place (replacing an older dump); returns the folder."""
        if self.closed:
            return self.folder
        index = {
            "format": FORMAT,
            "version": VERSION,
            "side": self.side,
            "framework": self.framework,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "meta": self.meta,
            "modules": self.modules,
        }
        (self._tmp / INDEX).write_text(json.dumps(index, indent=1, allow_nan=False))
        if self.folder.exists():
            old = self.folder.with_name(f".{self.folder.name}.old-{os.getpid()}")
            self.folder.rename(old)
            self._tmp.rename(self.folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            self._tmp.rename(self.folder)
        self.closed = True
        return self.folder

    def abort(self) -> None:
        """Drop everything written so far (the forward failed)."""
        shutil.rmtree(self._tmp, ignore_errors=True)
        self.closed = True


@dataclass
class DumpEntry:
    """One module call of a dump, as read back."""

    order: int
    name: str
    call: int
    key: str
    type: str
    outputs: list[dict[str, Any]]


@dataclass
class Dump:
    """A dump folder read back: entries in forward order, tensors loaded on demand."""

    folder: Path
    side: str
    framework: str
    meta: dict[str, Any]
    entries: list[DumpEntry]
    by_key: dict[str, DumpEntry] = field(init=False)

    def __post_init__(self) -> None:
        self.by_key = {e.key: e for e in self.entries}

    def tensor(self, entry: DumpEntry, index: int) -> np.ndarray | None:
        """Output ``index`` of ``entry`` as float32, or None when the dump kept only its statistics."""
        ref = entry.outputs[index].get("tensor")
        if not ref:
            return None
        from safetensors import safe_open

        relative, _, tensor_name = ref.partition(":")
        path = self.folder / relative
        if not path.is_file():
            raise DumpError(f"{path}: tensor file of {entry.key!r} is missing")
        with safe_open(str(path), framework="numpy") as handle:
            return handle.get_tensor(tensor_name)


def read_dump(folder: Path) -> Dump:
    """Read a dump folder; errors name the folder and what is wrong with it."""
    folder = Path(folder)
    path = folder / INDEX
    if not path.is_file():
        raise DumpError(f"{folder}: not a dump folder ({INDEX} is missing)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DumpError(f"{path}: not valid JSON: {exc}") from None
    if raw.get("format") != FORMAT:
        raise DumpError(f"{path}: format is {raw.get('format')!r}, expected {FORMAT!r}")
    if raw.get("version") != VERSION:
        raise DumpError(f"{path}: version {raw.get('version')!r} is not supported (expected {VERSION})")
    try:
        entries = [DumpEntry(order=m["order"], name=m["name"], call=m["call"], key=m["key"], type=m["type"],
                             outputs=list(m["outputs"])) for m in raw["modules"]]
    except (KeyError, TypeError) as exc:
        raise DumpError(f"{path}: malformed module entry ({exc})") from None
    return Dump(folder=folder, side=str(raw.get("side")), framework=str(raw.get("framework")),
                meta=dict(raw.get("meta") or {}), entries=entries)
