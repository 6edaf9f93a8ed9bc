"""Read msprobe (mindstudio-probe 26.2.0) dumps: ``step{N}/rank{R}/dump.json`` (+ ``dump_tensor_data/``).

The schema is msprobe's own writer's: ``msprobe/core/dump/data_dump/json_writer.py:180-195`` writes the header
(``task``, ``level``, ``framework``, ``dump_data_dir``) and an empty ``data`` dict that ``update_data`` (line 275)
fills with one entry per call. An entry key is ``Module.<path>.<Class>.<forward|backward|parameters_grad>.<n>``
(``Cell.`` on the MindSpore side) at L0, plus ``<Api>.<op>.<n>.<forward|backward>`` at mix. A tensor record holds
``dtype``, ``shape`` and the statistics ``Max Min Mean Norm``; ``md5`` when ``summary_mode`` is md5; ``data_name``
(a file under ``dump_data_dir``, ``.pt`` for PyTorch, ``.npy`` for MindSpore) when ``task`` is tensor
(``data_processor/base.py:700-710``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FRAMEWORKS = ("pytorch", "mindspore")
OPTIONS = {"mindspore": "--npu-dump", "pytorch": "--gpu-dump"}  # the diagnose option that takes each one's dump
SIDE_NAMES = {"mindspore": "MindFormers", "pytorch": "Megatron"}  # the side a dump of each framework is of
DIRECTIONS = ("forward", "backward", "parameters_grad")
STATS = ("Max", "Min", "Mean", "Norm")


class MsprobeDumpError(ValueError):
    """A dump that cannot be read as msprobe wrote it; the message names the file."""


@dataclass(frozen=True)
class TensorRecord:
    """One tensor of an entry: its shape, dtype, statistics, and md5 or tensor file when the mode has them."""

    dtype: str
    shape: tuple[int, ...]
    stats: dict[str, float | None]
    md5: str | None = None
    data_path: Path | None = None

    def load(self) -> np.ndarray:
        """The whole tensor (tensor mode only) as float64 numpy."""
        if self.data_path is None:
            raise MsprobeDumpError("this record has no tensor file (the dump was not taken with task 'tensor')")
        if not self.data_path.is_file():
            raise MsprobeDumpError(f"{self.data_path}: tensor file named by dump.json is missing")
        if self.data_path.suffix == ".npy":
            return np.load(self.data_path).astype(np.float64)
        import torch  # only PyTorch-side tensor dumps need torch to read their .pt files

        return torch.load(self.data_path, map_location="cpu", weights_only=True).double().numpy()


@dataclass
class DumpEntry:
    """One call msprobe recorded: a module/cell (L0) or an API (mix), one direction."""

    key: str
    kind: str  # Module, Cell, or the API family (Tensor, Functional, Torch, Mint, ...)
    name: str  # module path (L0) or API name (mix)
    cls: str  # module class ('' for APIs)
    direction: str
    index: int
    inputs: list[TensorRecord] = field(default_factory=list)
    outputs: list[TensorRecord] = field(default_factory=list)
    parameters: dict[str, TensorRecord] = field(default_factory=dict)

    @property
    def is_module(self) -> bool:
        return self.kind in ("Module", "Cell")


@dataclass
class RankDump:
    """One rank folder's dump.json."""

    path: Path
    rank: int
    framework: str
    task: str
    level: str
    mode: str  # statistics, md5 or tensor
    entries: dict[str, DumpEntry]


@dataclass
class StepDump:
    """Every rank of one step of one side."""

    path: Path
    step: int
    framework: str
    mode: str
    ranks: dict[int, RankDump]


_RANK_DIR = re.compile(r"^(rank|proc)(\d*)$")
_STEP_DIR = re.compile(r"^step(\d+)$")


def parse_key(key: str, path: Path) -> tuple[str, str, str, str, int]:
    """(kind, name, class, direction, index) of an entry key."""
    parts = key.split(".")
    kind = parts[0]
    if kind in ("Module", "Cell"):
        # Module.<path>.<Class>.<direction>.<n>
        if len(parts) < 5 or parts[-2] not in DIRECTIONS or not parts[-1].isdigit():
            raise MsprobeDumpError(f"{path}: entry {key!r} is not Module/Cell.<path>.<Class>.<direction>.<n>")
        return kind, ".".join(parts[1:-3]), parts[-3], parts[-2], int(parts[-1])
    # <Api>.<op>.<n>.<direction>
    if len(parts) < 4 or parts[-1] not in DIRECTIONS or not parts[-2].isdigit():
        raise MsprobeDumpError(f"{path}: entry {key!r} is not <Api>.<op>.<n>.<direction>")
    return kind, ".".join(parts[1:-2]), "", parts[-1], int(parts[-2])


def _tensors(value, data_dir: Path | None, path: Path, key: str) -> list[TensorRecord]:
    """Every tensor record in an args/kwargs/output value, in order (nested lists and dicts flattened)."""
    if isinstance(value, list):
        return [record for item in value for record in _tensors(item, data_dir, path, key)]
    if isinstance(value, dict):
        if "shape" in value and "dtype" in value and "type" in value:
            if not str(value["type"]).endswith("Tensor"):
                return []
            data_name = value.get("data_name")
            if data_name is not None and data_dir is None:
                raise MsprobeDumpError(f"{path}: entry {key!r} names tensor file {data_name} but dump_data_dir is null")
            return [TensorRecord(str(value["dtype"]), tuple(int(n) for n in value["shape"]),
                                 {stat: value.get(stat) for stat in STATS}, value.get("md5"),
                                 data_dir / data_name if data_name else None)]
        return [record for item in value.values() for record in _tensors(item, data_dir, path, key)]
    return []


def read_rank(folder: Path) -> RankDump:
    """One rank folder (``rank{R}`` or, without torch.distributed, ``proc{pid}``)."""
    folder = Path(folder)
    path = folder / "dump.json"
    if not path.is_file():
        raise MsprobeDumpError(f"{path}: no dump.json in this rank folder")
    try:
        document = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MsprobeDumpError(f"{path}: not valid JSON (truncated?): {exc}") from exc
    if not isinstance(document, dict):
        raise MsprobeDumpError(f"{path}: top level is not an object")
    missing = [key for key in ("task", "level", "framework", "data") if key not in document]
    if missing:
        raise MsprobeDumpError(f"{path}: missing {', '.join(missing)} (not an msprobe dump.json)")
    framework = document["framework"]
    if framework not in FRAMEWORKS:
        raise MsprobeDumpError(f"{path}: framework {framework!r} is not one of {FRAMEWORKS}")
    data_dir = document.get("dump_data_dir")
    # msprobe writes the absolute path of the machine that dumped; the folder travels beside dump.json
    data_dir = folder / Path(data_dir).name if data_dir else None
    entries = {}
    for key, body in document["data"].items():
        kind, name, cls, direction, index = parse_key(key, path)
        entry = DumpEntry(key, kind, name, cls, direction, index)
        if direction == "parameters_grad":
            entry.parameters = {pname: records[0] for pname, value in body.items()
                                if (records := _tensors(value, data_dir, path, key))}
        else:
            inputs = body.get("input_args", []) + list((body.get("input_kwargs") or {}).values()) \
                if "input_args" in body else body.get("input", [])
            entry.inputs = _tensors(inputs, data_dir, path, key)
            entry.outputs = _tensors(body.get("output", []), data_dir, path, key)
            entry.parameters = {pname: records[0] for pname, value in (body.get("parameters") or {}).items()
                                if (records := _tensors(value, data_dir, path, key))}
        entries[key] = entry
    records = [r for e in entries.values() for r in (*e.inputs, *e.outputs, *e.parameters.values())]
    if document["task"] == "tensor":
        mode = "tensor"
    elif records and all(r.md5 is not None for r in records):
        mode = "md5"
    else:
        mode = "statistics"
    match = _RANK_DIR.match(folder.name)
    rank = int(match.group(2)) if match and match.group(1) == "rank" and match.group(2) else 0
    return RankDump(folder, rank, framework, document["task"], document["level"], mode, entries)


def read_step(folder: Path) -> StepDump:
    """A ``step{N}`` folder: one rank folder per rank (``proc{pid}`` stands for rank 0 of a single process)."""
    folder = Path(folder)
    match = _STEP_DIR.match(folder.name)
    if not match:
        raise MsprobeDumpError(f"{folder}: not a step{{N}} folder")
    rank_dirs = sorted(p for p in folder.iterdir() if p.is_dir() and _RANK_DIR.match(p.name))
    if not rank_dirs:
        raise MsprobeDumpError(f"{folder}: no rank{{R}} folder (empty dump?)")
    ranks: dict[int, RankDump] = {}
    for rank_dir in rank_dirs:
        dump = read_rank(rank_dir)
        if dump.rank in ranks:
            raise MsprobeDumpError(f"{rank_dir}: a second folder for rank {dump.rank} "
                                   f"(beside {ranks[dump.rank].path.name})")
        ranks[dump.rank] = dump
    first = next(iter(ranks.values()))
    for dump in ranks.values():
        if dump.framework != first.framework:
            raise MsprobeDumpError(f"{dump.path / 'dump.json'}: framework {dump.framework}, "
                                   f"but {first.path / 'dump.json'} is {first.framework}")
        if dump.mode != first.mode:
            raise MsprobeDumpError(f"{dump.path / 'dump.json'}: mode {dump.mode}, "
                                   f"but {first.path / 'dump.json'} is {first.mode}")
    return StepDump(folder, int(match.group(1)), first.framework, first.mode, ranks)


def read_dump(folder: Path, step: int | None = None) -> StepDump:
    """A dump root (holding ``step{N}/``), a step folder, or a single rank folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise MsprobeDumpError(f"{folder}: no such dump folder")
    if (folder / "dump.json").is_file():
        dump = read_rank(folder)
        return StepDump(folder, step if step is not None else 0, dump.framework, dump.mode, {dump.rank: dump})
    if _STEP_DIR.match(folder.name):
        return read_step(folder)
    steps = sorted((int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name)))
    if not steps:
        raise MsprobeDumpError(f"{folder}: no step{{N}} folder and no dump.json (empty dump?)")
    if step is None:
        if len(steps) > 1:
            raise MsprobeDumpError(f"{folder}: steps {[n for n, _ in steps]}; name one")
        return read_step(steps[0][1])
    chosen = [p for n, p in steps if n == step]
    if not chosen:
        raise MsprobeDumpError(f"{folder}: no step{step} (has {[n for n, _ in steps]})")
    return read_step(chosen[0])
