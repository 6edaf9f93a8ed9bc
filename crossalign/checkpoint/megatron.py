"""Megatron-LM legacy ``torch`` checkpoints (SPEC section 4): read with weights_only, write loadable ones.

Layout::

    <root>/latest_checkpointed_iteration.txt      the number, no newline (or "release")
    <root>/iter_0000010/mp_rank_00/model_optim_rng.pt            TP ranks, no pipeline
    <root>/iter_0000010/mp_rank_01_002/model_optim_rng.pt        TP rank 1 of pipeline stage 2
    <root>/iter_0000010/mp_rank_01_003/model_optim_rng.pt        or of EP rank 3, without pipeline
    <root>/iter_0000010/mp_rank_01_002_003/model_optim_rng.pt    TP 1, pipeline stage 2, EP rank 3

(core_v0.16.1 ``megatron/training/checkpointing.py:162-201``, ``get_checkpoint_name``: the
pipeline rank is in the name when there is more than one stage, the expert rank appended
when expert parallel size > 1.) A name with one number after the tensor rank is a pipeline
stage or an EP rank: the contents tell, as only the last stage holds the final norm.

Each file holds ``{"checkpoint_version": 3.0, "iteration": N, "model": {...}}`` and nothing
else, so it loads with torch's default ``weights_only=True`` and needs no patch to Megatron
(an ``args`` Namespace is optional for ``--finetune`` and is left out). Files are written a
tensor at a time (``torch_file.py``), so saving never holds a second copy of the model.
"""

from __future__ import annotations

import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import torch

from crossalign.checkpoint.atomic import save_iteration
from crossalign.checkpoint.blocks import BlockCaster
from crossalign.checkpoint.errors import CheckpointError
from crossalign.checkpoint.reshard import (
    Rank,
    check_parallel_sizes,
    is_routed_expert,
    merge_shards,
    shard_shapes,
    shard_tensor,
)
from crossalign.checkpoint.torch_dist import fill_torch_dist, is_torch_dist, legacy_state, read_torch_dist_tensors
from crossalign.checkpoint.torch_file import TensorSpec, TorchFileWriter, write_to_all
from crossalign.config import ModelConfig

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0
_ITER_DIR = re.compile(r"iter_(\d{7})")
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")
_LAST_STAGE_KEY = "decoder.final_layernorm.weight"


def iteration_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    """Megatron's folder for one rank: ``mp_rank_TT``, then ``_PPP`` when pp > 1, then ``_EEE`` when ep > 1."""
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return name if ep == 1 else f"{name}_{ep_rank:03d}"


@dataclass
class MegatronCheckpoint:
    """A Megatron checkpoint merged into one full state dict (``_extra_state`` entries dropped)."""

    directory: Path
    iteration: int
    state: dict[str, torch.Tensor]
    tp: int
    pp: int
    ep: int = 1
    format: str = "torch"  # Megatron's --ckpt-format: torch (legacy) or torch_dist


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


def _model_keys(file: Path) -> set[str]:
    """The model keys of a rank file, read without its data (memory-mapped, so no tensor is copied)."""
    try:
        return set(torch.load(file, map_location="cpu", weights_only=True, mmap=True).get("model", {}))
    except Exception as exc:  # torch raises many kinds for a bad or foreign pickle
        raise CheckpointError(f"{file}: cannot be loaded with weights_only=True ({exc})") from None


def _ranks_of(folders: dict[tuple[int, ...], Path], directory: Path) -> dict[tuple[int, ...], Rank]:
    """(tp, pp, ep) of each folder's numbers: a lone second number is a stage unless every file has the final norm."""
    lengths = {len(numbers) for numbers in folders}
    if len(lengths) > 1:
        names = sorted(folder.name for folder in folders.values())
        raise CheckpointError(f"{directory}: rank folders of different forms: {names}")
    length = lengths.pop()
    if length == 1:
        return {numbers: (numbers[0], 0, 0) for numbers in folders}
    if length == 3:
        return {numbers: numbers for numbers in folders}
    expert_ranks = len(folders) > 1 and all(_LAST_STAGE_KEY in _model_keys(folder / MODEL_FILE)
                                            for folder in folders.values())
    return {numbers: (numbers[0], 0, numbers[1]) if expert_ranks else (numbers[0], numbers[1], 0)
            for numbers in folders}


def _load_sharing_replicas(files: dict[Rank, Path]) -> dict[Rank, dict[str, torch.Tensor]]:
    """Every rank's state; what an EP rank holds like EP rank 0 is checked bit for bit and then shared.

    Each expert-parallel rank repeats the whole non-expert model: keeping one copy of it, as
    each file is read, holds the model about once in memory however many EP ranks there are.
    """
    shards: dict[Rank, dict[str, torch.Tensor]] = {}
    for rank in sorted(files, key=lambda r: (r[2], r[1], r[0])):  # EP rank 0 of every (tp, pp) first
        state = _load_rank(files[rank])
        reference = shards.get((rank[0], rank[1], 0)) if rank[2] else None
        if reference is not None:
            for key, tensor in state.items():
                if key in reference and not is_routed_expert(key):
                    if not torch.equal(tensor, reference[key]):
                        raise CheckpointError(f"{files[rank]}: {key!r} differs from expert-parallel rank 0's")
                    state[key] = reference[key]
        shards[rank] = state
    return shards


def read_megatron_checkpoint(path: Path, model: ModelConfig | None = None,
                             core_version: str = "0.16.1") -> MegatronCheckpoint:
    """Open a checkpoint given its root (with the tracker) or an ``iter_%07d``/``release`` folder.

    All ``mp_rank_*`` shards, of any tensor, pipeline and expert layout, are merged into one
    state dict; merging tensor- or expert-parallel shards needs the model config (the GDN
    segment sizes and the expert count come from it). A torch_dist folder (``torch_dist.py``)
    is read whole, whatever layout saved it, and needs the model config too.
    """
    directory, iteration = find_iteration_dir(Path(path))
    if is_torch_dist(directory):
        if model is None:
            raise CheckpointError(f"{directory}: reading a torch_dist checkpoint needs the model config")
        state = legacy_state(read_torch_dist_tensors(directory), model, core_version)
        return MegatronCheckpoint(directory=directory, iteration=iteration, state=state, tp=1, pp=1,
                                  format="torch_dist")
    shards = read_rank_states(directory)
    tp, pp, ep = (1 + max(rank[i] for rank in shards) for i in range(3))
    state = merge_shards(shards, model) if len(shards) > 1 else shards[(0, 0, 0)]
    return MegatronCheckpoint(directory=directory, iteration=iteration, state=state, tp=tp, pp=pp, ep=ep)


def read_rank_states(directory: Path) -> dict[Rank, dict[str, torch.Tensor]]:
    """Each (tp, pp, ep) rank's model state of a legacy ``iter_N`` folder, as its file holds it (not merged)."""
    folders: dict[tuple[int, ...], Path] = {}
    for rank_dir in sorted(directory.iterdir()):
        match = _RANK_DIR.fullmatch(rank_dir.name)
        if not match:
            if rank_dir.name.startswith("mp_rank_"):
                raise CheckpointError(f"{rank_dir}: not a rank folder of the form mp_rank_TT[_PPP][_EEE]")
            continue
        if not (rank_dir / MODEL_FILE).exists():
            raise CheckpointError(f"{rank_dir}: {MODEL_FILE} is missing")
        folders[tuple(int(g) for g in match.groups() if g is not None)] = rank_dir
    if not folders:
        raise CheckpointError(f"{directory}: no mp_rank_* folders")
    return _load_sharing_replicas({rank: folders[numbers] / MODEL_FILE
                                   for numbers, rank in _ranks_of(folders, directory).items()})


def _rank_specs(specs: Mapping[str, TensorSpec], model: ModelConfig | None, tp: int, pp: int, ep: int,
                etp: int | None) -> dict[Rank, dict[str, TensorSpec]]:
    """What each rank file holds, in the order the tensors come."""
    per_rank: dict[Rank, dict[str, TensorSpec]] = {(t, p, e): {} for p in range(pp) for t in range(tp)
                                                   for e in range(ep)}
    for key, spec in specs.items():
        for rank, local_key, shape in shard_shapes(key, spec.shape, model, tp, pp, ep, etp):
            per_rank[rank][local_key] = TensorSpec(shape, spec.dtype)
    return per_rank


def _fill_iteration_dir(directory: Path, iteration: int, specs: Mapping[str, TensorSpec],
                        tensors: Iterable[tuple[str, torch.Tensor]], model: ModelConfig | None, tp: int,
                        pp: int, ep: int, etp: int | None) -> None:
    """Lay out every rank file, then shard each tensor as it comes and write its shards into their records."""
    if (tp, pp, ep, etp) != (1, 1, 1, None):
        if model is None:
            raise CheckpointError(f"writing tp={tp} pp={pp} ep={ep} shards needs the model config")
        check_parallel_sizes(model, tp, pp, ep, etp)
    fields = {"checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
    caster = BlockCaster()
    with ExitStack() as open_files:  # each writer checks on a clean exit that all its tensors came
        writers: dict[Rank, TorchFileWriter] = {}
        for (t, p, e), rank_specs in _rank_specs(specs, model, tp, pp, ep, etp).items():
            file = directory / rank_dir_name(t, p, pp, e, ep) / MODEL_FILE
            file.parent.mkdir(parents=True)
            writers[(t, p, e)] = open_files.enter_context(TorchFileWriter(file, fields, "model", rank_specs, caster))
        announced = iter(specs)
        for key, tensor in tensors:
            if key != next(announced, None):
                raise CheckpointError(f"{directory}: tensor {key!r} was not announced in this place")
            same: dict[int, list[tuple[TorchFileWriter, str]]] = {}  # shards that are one tensor, by its id
            shards = {}
            for rank, local_key, shard in shard_tensor(key, tensor, model, tp, pp, ep, etp):
                same.setdefault(id(shard), []).append((writers[rank], local_key))
                shards[id(shard)] = shard
            for identity, targets in same.items():
                write_to_all(targets, shards[identity])


def stream_megatron_checkpoint(root: Path, iteration: int, specs: Mapping[str, TensorSpec],
                               tensors: Iterable[tuple[str, torch.Tensor]], *, model: ModelConfig | None = None,
                               tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None) -> Path:
    """Save a full model given tensor by tensor (resharded to tp x pp x ep when asked); returns the iteration folder.

    ``specs`` announces every key of the full model with its shape and the dtype to store;
    ``tensors`` then yields the same keys in the same order, each consumed and dropped before
    the next is asked for, floating ones cast to the announced dtype as they are written. So
    memory holds one tensor at a time however large the model.

    A new root is built whole in a temporary sibling and renamed into place; an existing
    root gets the new iteration folder the same way and then its tracker is replaced.
    """
    return save_iteration(root, iteration_dir_name(iteration), iteration, TRACKER,
                          lambda folder: _fill_iteration_dir(folder, iteration, specs, tensors, model, tp, pp, ep, etp))


def write_megatron_checkpoint(root: Path, iteration: int, state: Mapping[str, torch.Tensor], *,
                              model: ModelConfig | None = None, tp: int = 1, pp: int = 1, ep: int = 1,
                              etp: int | None = None) -> Path:
    """Save a full state dict held in memory (resharded to tp x pp x ep when asked); returns the iteration folder."""
    specs = {key: TensorSpec(tuple(tensor.shape), tensor.dtype) for key, tensor in state.items()}
    return stream_megatron_checkpoint(root, iteration, specs, state.items(), model=model, tp=tp, pp=pp, ep=ep, etp=etp)


def write_torch_dist_checkpoint(root: Path, iteration: int, state: Mapping[str, torch.Tensor], model: ModelConfig,
                                core_version: str, dtype: torch.dtype) -> Path:
    """Save a full state dict as a torch_dist checkpoint (``torch_dist.py``), tracker and all; returns the folder."""
    return save_iteration(root, iteration_dir_name(iteration), iteration, TRACKER,
                          lambda folder: fill_torch_dist(folder, state, model, core_version, dtype))
