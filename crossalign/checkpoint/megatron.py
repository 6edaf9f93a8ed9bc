"""Megatron-LM legacy ``torch`` checkpoints (SPEC section 4): read with weights_only, write loadable ones.

Layout::

    <root>/latest_checkpointed_iteration.txt      the number, no newline (or "release")
    <root>/iter_0000010/mp_rank_00/model_optim_rng.pt            TP ranks, no pipeline
    <root>/iter_0000010/mp_rank_01_002/model_optim_rng.pt        TP rank 1 of pipeline stage 2

Each file holds ``{"checkpoint_version": 3.0, "iteration": N, "model": {...}}`` and nothing
else, so it loads with torch's default ``weights_only=True`` and needs no patch to Megatron
(an ``args`` Namespace is optional for ``--finetune`` and is left out).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from crossalign.checkpoint.atomic import atomic_directory, write_text_atomic
from crossalign.checkpoint.errors import CheckpointError
from crossalign.checkpoint.reshard import Rank, merge_shards, split_state
from crossalign.config import ModelConfig

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0
_ITER_DIR = re.compile(r"iter_(\d{7})")
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?")


def iteration_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


@dataclass
class MegatronCheckpoint:
    """A Megatron checkpoint merged into one full state dict (``_extra_state`` entries dropped)."""

    directory: Path
    iteration: int
    state: dict[str, torch.Tensor]
    tp: int
    pp: int


def find_iteration_dir(path: Path) -> tuple[Path, int]:
    """The folder holding the ``mp_rank_*`` folders and its iteration (0 for a release checkpoint)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a folder (a Megatron checkpoint is a folder)")
    if (path / TRACKER).exists():
        text = (path / TRACKER).read_text().strip()
        if text == "release":
            return path / "release", 0
        if not text.isdigit():
            raise CheckpointError(f"{path / TRACKER}: expected an iteration number or 'release', found {text!r}")
        directory = path / iteration_dir_name(int(text))
        if not directory.is_dir():
            raise CheckpointError(f"{path / TRACKER} names iteration {int(text)}, but {directory} does not exist")
        return directory, int(text)
    match = _ITER_DIR.fullmatch(path.name)
    if match:
        return path, int(match.group(1))
    if path.name == "release":
        return path, 0
    raise CheckpointError(f"{path}: no {TRACKER}, and not an iter_%07d or release folder")


def _load_rank(file: Path) -> dict[str, torch.Tensor]:
    try:
        checkpoint = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many kinds for a bad or foreign pickle
        raise CheckpointError(f"{file}: cannot be loaded with weights_only=True ({exc})") from None
    if not isinstance(checkpoint, dict) or "model" not in checkpoint:
        raise CheckpointError(f"{file}: no 'model' entry (virtual pipeline checkpoints are not supported)")
    state = {}
    for key, value in checkpoint["model"].items():
        if key.endswith("_extra_state"):
            continue
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{file}: model entry {key!r} is a {type(value).__name__}, not a tensor")
        state[key] = value
    return state


def read_megatron_checkpoint(path: Path, model: ModelConfig | None = None) -> MegatronCheckpoint:
    """Open a checkpoint given its root (with the tracker) or an ``iter_%07d``/``release`` folder.

    All ``mp_rank_*`` shards are merged into one state dict; merging tensor-parallel shards
    needs the model config (the GDN segment sizes come from it).
    """
    directory, iteration = find_iteration_dir(Path(path))
    shards: dict[Rank, dict[str, torch.Tensor]] = {}
    for rank_dir in sorted(directory.iterdir()):
        match = _RANK_DIR.fullmatch(rank_dir.name)
        if not match:
            if rank_dir.name.startswith("mp_rank_"):
                raise CheckpointError(f"{rank_dir}: expert-parallel or unknown rank folders are not supported")
            continue
        file = rank_dir / MODEL_FILE
        if not file.exists():
            raise CheckpointError(f"{rank_dir}: {MODEL_FILE} is missing")
        shards[(int(match.group(1)), int(match.group(2) or 0))] = _load_rank(file)
    if not shards:
        raise CheckpointError(f"{directory}: no mp_rank_* folders")
    tp = 1 + max(rank[0] for rank in shards)
    pp = 1 + max(rank[1] for rank in shards)
    state = merge_shards(shards, model) if len(shards) > 1 else shards[(0, 0)]
    return MegatronCheckpoint(directory=directory, iteration=iteration, state=state, tp=tp, pp=pp)


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """torch.save writes a tensor's whole storage: give views of larger tensors a storage of their own."""
    own_size = tensor.numel() * tensor.element_size()
    if tensor.is_contiguous() and tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == own_size:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def _save_rank(file: Path, iteration: int, state: Mapping[str, torch.Tensor]) -> None:
    """torch.save without record checksums: torch's reader is built with MINIZ_DISABLE_ZIP_READER_CRC32_CHECKS
    and never verifies them, and computing them doubles the time of saving a large model."""
    file.parent.mkdir(parents=True)
    model = {key: _compact(tensor) for key, tensor in state.items()}
    checksums = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration, "model": model}, file)
    finally:
        torch.serialization.set_crc32_options(checksums)


def _fill_iteration_dir(directory: Path, iteration: int, state: Mapping[str, torch.Tensor],
                        model: ModelConfig | None, tp: int, pp: int) -> None:
    if tp == 1 and pp == 1:
        _save_rank(directory / rank_dir_name(0, 0, 1) / MODEL_FILE, iteration, state)
        return
    if model is None:
        raise CheckpointError(f"writing tp={tp} pp={pp} shards needs the model config")
    for pp_rank in range(pp):
        for tp_rank, shard in split_state(dict(state), model, tp, pp, pp_rank).items():
            _save_rank(directory / rank_dir_name(tp_rank, pp_rank, pp) / MODEL_FILE, iteration, shard)


def write_megatron_checkpoint(root: Path, iteration: int, state: Mapping[str, torch.Tensor], *,
                              model: ModelConfig | None = None, tp: int = 1, pp: int = 1) -> Path:
    """Save a full state dict (resharded to tp x pp when asked); returns the iteration folder.

    A new root is built whole in a temporary sibling and renamed into place; an existing
    root gets the new iteration folder the same way and then its tracker is replaced.
    """
    root = Path(root)
    name = iteration_dir_name(iteration)
    if root.exists() and any(root.iterdir()):
        if (root / name).exists():
            raise CheckpointError(f"{root / name}: iteration {iteration} is already saved")
        with atomic_directory(root / name) as directory:
            _fill_iteration_dir(directory, iteration, state, model, tp, pp)
        write_text_atomic(root / TRACKER, str(iteration))
        return root / name
    with atomic_directory(root) as staging:
        _fill_iteration_dir(staging / name, iteration, state, model, tp, pp)
        (staging / TRACKER).write_text(str(iteration))
    return root / name
