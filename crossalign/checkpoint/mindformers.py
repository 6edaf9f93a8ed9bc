"""MindFormers "checkpoint 2.0" checkpoints (SPEC section 4): find, read lazily, write.

Layout::

    <root>/latest_checkpointed_iteration.txt          the iteration number
    <root>/iteration_00000010/common.json             training state; pynative resume needs it
    <root>/iteration_00000010/<prefix>-model-0000000-0000001.safetensors
    <root>/iteration_00000010/<prefix>-opt-0000000-0000001.safetensors
    <root>/iteration_00000010/metadata.json           only when more than one rank saved

A bare folder of safetensors files is accepted too (MindFormers loads it the same way).
Tensors are read one at a time, on demand, so that large checkpoints need not fit in memory.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from crossalign.checkpoint.atomic import save_iteration
from crossalign.checkpoint.blocks import ReusedBuffer
from crossalign.checkpoint.errors import CheckpointError
from crossalign.checkpoint.safetensors_io import FLOATING, TensorInfo, read_header, read_tensor, write_safetensors

TRACKER = "latest_checkpointed_iteration.txt"
COMMON = "common.json"
SAFETENSORS_METADATA = {"format": "ms"}
_ITERATION_DIR = re.compile(r"iteration_(\d{8})")
# Optimizer entries may share a file with the model when a bare folder holds one combined file.
_OPTIMIZER_PREFIXES = ("adam_m.", "adam_v.", "main_param.")
_OPTIMIZER_NAMES = ("learning_rate", "global_step")


def iteration_dir_name(iteration: int) -> str:
    return f"iteration_{iteration:08d}"


def is_optimizer_entry(file: Path, name: str) -> bool:
    """Optimizer files are named ``*-opt-*``; their entries, and Adam moments anywhere, are not model weights."""
    return "-opt-" in file.name or name.startswith(_OPTIMIZER_PREFIXES) or name in _OPTIMIZER_NAMES


def _read_tracker(root: Path) -> int:
    text = (root / TRACKER).read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{root / TRACKER}: expected an iteration number, found {text!r}")
    return int(text)


@dataclass
class MindFormersCheckpoint:
    """A MindFormers checkpoint on disk: the folder of safetensors files and what its headers say."""

    directory: Path
    iteration: int | None
    common: dict | None
    tracker_root: Path | None
    entries: dict[str, tuple[Path, TensorInfo]] = field(repr=False)

    @property
    def files(self) -> list[Path]:
        return sorted({path for path, _ in self.entries.values()})

    def model_entries(self) -> dict[str, TensorInfo]:
        return {name: info for name, (path, info) in self.entries.items() if not is_optimizer_entry(path, name)}

    def optimizer_entries(self) -> dict[str, TensorInfo]:
        return {name: info for name, (path, info) in self.entries.items() if is_optimizer_entry(path, name)}

    def tensor(self, name: str, floating_dtype: torch.dtype | None = None,
               buffer: ReusedBuffer | None = None) -> torch.Tensor:
        """One tensor; a floating one is converted to ``floating_dtype`` (when given) while it is read.

        It is read into ``buffer`` when given, and valid only until the buffer is used again.
        """
        if name not in self.entries:
            raise CheckpointError(f"{self.directory}: no tensor {name!r}")
        path, info = self.entries[name]
        return read_tensor(path, info, floating_dtype if info.dtype in FLOATING else None, buffer)

    def model_state(self) -> dict[str, torch.Tensor]:
        """Model weights only (no optimizer entries), all loaded."""
        return {name: self.tensor(name) for name in self.model_entries()}

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        return {name: self.tensor(name) for name in self.optimizer_entries()}


def find_checkpoint_dir(path: Path) -> tuple[Path, int | None, Path | None]:
    """The folder holding the safetensors files, its iteration, and the root with the tracker (if any)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a folder (a MindFormers checkpoint is a folder)")
    if (path / "model.safetensors.index.json").exists() or (path / "model.safetensors").exists():
        raise CheckpointError(f"{path}: a Hugging Face checkpoint, not a MindFormers one")
    if (path / TRACKER).exists():
        iteration = _read_tracker(path)
        directory = path / iteration_dir_name(iteration)
        if not directory.is_dir():
            raise CheckpointError(f"{path / TRACKER} names iteration {iteration}, but {directory} does not exist")
        return directory, iteration, path
    match = _ITERATION_DIR.fullmatch(path.name)
    return path, (int(match.group(1)) if match else None), None


def read_mindformers_checkpoint(path: Path) -> MindFormersCheckpoint:
    """Open a checkpoint given its root (with the tracker), an ``iteration_%08d`` folder or a bare folder.

    Every safetensors header is read and checked (a truncated file is an error here, before
    any conversion starts); tensors themselves are loaded only when asked for. The
    ``iteration_%08d`` layout requires ``common.json``, as MindFormers' pynative resume does.
    """
    directory, iteration, root = find_checkpoint_dir(Path(path))
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no .safetensors files")
    common = None
    if (directory / COMMON).exists():
        try:
            common = json.loads((directory / COMMON).read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{directory / COMMON}: not valid JSON ({exc})") from None
    elif iteration is not None:
        raise CheckpointError(f"{directory}: {COMMON} is missing (the iteration_%08d layout requires it)")
    entries: dict[str, tuple[Path, TensorInfo]] = {}
    for file in files:
        infos, _ = read_header(file)
        for info in infos:
            if info.name in entries:
                raise CheckpointError(f"tensor {info.name!r} is stored twice: in {entries[info.name][0]} and in {file}")
            entries[info.name] = (file, info)
    return MindFormersCheckpoint(directory=directory, iteration=iteration, common=common, tracker_root=root,
                                 entries=entries)


def default_common(iteration: int, global_batch_size: int | None = None) -> dict:
    """The ``common.json`` of a single-rank save at ``iteration``, with the fields MindFormers writes."""
    return {
        "epoch_num": 1,
        "step_num": iteration,
        "global_step": iteration,
        "loss_scale": 1.0,
        "global_batch_size": global_batch_size,
        "consumed_samples": None if global_batch_size is None else iteration * global_batch_size,
        "ckpt_status": None,
    }


def _fill_iteration_dir(directory: Path, model: Mapping[str, torch.Tensor],
                        optimizer: Mapping[str, torch.Tensor] | None, common: dict, prefix: str) -> None:
    write_safetensors(directory / f"{prefix}-model-0000000-0000001.safetensors", model, SAFETENSORS_METADATA)
    if optimizer is not None:
        write_safetensors(directory / f"{prefix}-opt-0000000-0000001.safetensors", optimizer, SAFETENSORS_METADATA)
    (directory / COMMON).write_text(json.dumps(common, indent=4))


def write_mindformers_checkpoint(root: Path, iteration: int, model: Mapping[str, torch.Tensor],
                                 optimizer: Mapping[str, torch.Tensor] | None, common: dict,
                                 prefix: str = "qwen35") -> Path:
    """Save one single-rank iteration in the checkpoint 2.0 layout; returns the iteration folder.

    A new root is built whole in a temporary sibling and renamed into place. An existing
    root (earlier saves of the same run) gets the new iteration folder the same way, then
    its tracker is replaced, so a reader always finds a complete iteration.
    """
    return save_iteration(root, iteration_dir_name(iteration), iteration, TRACKER,
                          lambda folder: _fill_iteration_dir(folder, model, optimizer, common, prefix))
