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
tensor at a time (``torch_file.py``), so saving never holds a second copy of the model, and
read a tensor at a time whatever the layout (``open_megatron``, by the merge path of ``merge.py``).
"""

from __future__ import annotations

import math
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch

from crossalign.tensorio.atomic import save_iteration
from crossalign.tensorio.blocks import BlockCaster, ReusedBuffer
from crossalign.tensorio.errors import CheckpointError
from crossalign.sides.megatron.merge import MergedModel, layout_of, merge_plan
from crossalign.sides.megatron.sharding import Rank, check_parallel_sizes, is_routed_expert, shard_shapes, shard_tensor
from crossalign.tensorio.safetensors_io import read_into
from crossalign.sides.megatron.torch_dist import is_torch_dist, torch_dist_plan
from crossalign.sides.megatron.torch_dist_layout import TorchDistLayout
from crossalign.sides.megatron.torch_dist_write import finish_torch_dist, write_part
from crossalign.tensorio.torch_file import TensorSpec, TorchFileWriter, write_to_all
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


def loaded_rank_folders(tp: int, pp: int, ep: int, etp: int, world: int) -> list[str]:
    """The checkpoint folders the ``world`` ranks of a layout load, each rank its own (get_checkpoint_name,
    core_v0.16.1 megatron/training/checkpointing.py:162-201).

    megatron-core places ranks in its default order tp-cp-ep-dp-pp (megatron/core/parallel_state.py:562,
    the dense and expert RankGenerators at :775-805): a rank's tensor rank is rank mod TP, its expert rank
    (rank div ETP) mod EP, its pipeline rank rank div (world / PP). Where the expert ranks fold onto the
    tensor ranks (TP 2 x EP 2 with ETP 1 on two cards) fewer folders are loaded than a converter writes.
    """
    per_stage = world // pp
    return sorted({rank_dir_name(rank % tp, rank // per_stage, pp, (rank // etp) % ep, ep) for rank in range(world)})


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


def _load_rank(file: Path, location: str = "cpu") -> dict[str, torch.Tensor]:
    """A rank file's model tensors; with ``location`` "meta" only their shapes and places are read."""
    try:
        checkpoint = torch.load(file, map_location=location, weights_only=True)
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
    """The model keys of a rank file, read without its data (on the meta device, so no tensor is read)."""
    try:
        return set(torch.load(file, map_location="meta", weights_only=True).get("model", {}))
    except Exception as exc:  # torch raises many kinds for a bad or foreign pickle
        raise CheckpointError(f"{file}: cannot be loaded with weights_only=True ({exc})") from None


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a rank file and where its bytes are, to be read into memory the reader chooses.

    ``torch.load`` onto the meta device reads only the pickle; it gives each storage the file
    offset of its bytes (``_checkpoint_offset``) and each tensor its shape, strides and offset
    in that storage, which is all a plain ``readinto`` needs.
    """

    file: Path
    key: str  # the key in this file (local layer and expert numbers)
    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...]
    storage_offset: int  # in elements
    storage_bytes: int
    file_offset: int  # of the storage's first byte

    @property
    def where(self) -> str:
        return str(self.file)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def read(self, buffer: ReusedBuffer | None = None) -> torch.Tensor:
        """The tensor, read into ``buffer`` when given (valid until the buffer is used again)."""
        contiguous = torch.empty(self.shape, dtype=torch.uint8, device="meta").stride()
        if self.stride == contiguous or self.nbytes == 0:
            out = buffer.view(self.shape, self.dtype) if buffer is not None else torch.empty(self.shape,
                                                                                              dtype=self.dtype)
            self._read_at(self.file_offset + self.storage_offset * self.dtype.itemsize, out)
            return out
        storage = torch.empty(self.storage_bytes, dtype=torch.uint8)  # a strided view: its storage, then the view
        self._read_at(self.file_offset, storage)
        view = storage.view(self.dtype).as_strided(self.shape, self.stride, self.storage_offset)
        return view.clone() if buffer is None else buffer.view(self.shape, self.dtype).copy_(view)

    def _read_at(self, offset: int, target: torch.Tensor) -> None:
        with open(self.file, "rb", buffering=0) as handle:
            handle.seek(offset)
            read_into(handle, self.file, self.key, target)


def _stored_tensors(file: Path) -> dict[str, StoredTensor]:
    """Every model tensor of a rank file with where it is stored; no tensor data is read."""
    stored = {}
    for key, meta in _load_rank(file, "meta").items():
        storage = meta.untyped_storage()
        offset = getattr(storage, "_checkpoint_offset", None)
        if offset is None:
            raise CheckpointError(f"{file}: torch gave no file offset for {key!r}")
        stored[key] = StoredTensor(file, key, tuple(meta.shape), meta.dtype, tuple(meta.stride()),
                                   meta.storage_offset(), storage.nbytes(), offset)
    return stored


def _ranks_of(folders: dict[tuple[int, ...], Path], directory: Path,
              model_keys: Callable[[Path], set[str]] = _model_keys) -> dict[tuple[int, ...], Rank]:
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
    expert_ranks = len(folders) > 1 and all(_LAST_STAGE_KEY in model_keys(folder / MODEL_FILE)
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


def open_megatron(path: Path, model: ModelConfig | None = None, core_version: str = "0.16.1") -> MergedModel:
    """Any Megatron checkpoint as a ``MergedModel``, read a tensor at a time (given its root or iteration folder).

    Legacy rank files of any tensor, pipeline and expert layout are described from their
    pickles alone (``StoredTensor``) and merged by ``merge.merge_plan``, which needs the model
    config beyond one rank (the GDN segment sizes and the expert count come from it). A
    torch_dist folder (``torch_dist.py``), whatever layout saved it, needs the model config too.
    """
    directory, iteration = find_iteration_dir(Path(path))
    if is_torch_dist(directory):
        if model is None:
            raise CheckpointError(f"{directory}: reading a torch_dist checkpoint needs the model config")
        return MergedModel(directory, iteration, torch_dist_plan(directory, model, core_version), 1, 1, 1,
                           "torch_dist")
    folders = _rank_folders(directory)
    stored = {folder / MODEL_FILE: _stored_tensors(folder / MODEL_FILE) for folder in folders.values()}
    ranks = _ranks_of(folders, directory, lambda file: set(stored[file]))
    by_rank = {rank: stored[folders[numbers] / MODEL_FILE] for numbers, rank in ranks.items()}
    return MergedModel(directory, iteration, merge_plan(by_rank, model), *layout_of(by_rank))


def read_megatron_checkpoint(path: Path, model: ModelConfig | None = None,
                             core_version: str = "0.16.1") -> MegatronCheckpoint:
    """Open a checkpoint given its root (with the tracker) or an ``iter_%07d``/``release`` folder, merged into one
    full state dict in memory (``open_megatron`` reads it a tensor at a time instead)."""
    with open_megatron(path, model, core_version) as merged:
        state = merged.state()
    return MegatronCheckpoint(directory=merged.directory, iteration=merged.iteration, state=state, tp=merged.tp,
                              pp=merged.pp, ep=merged.ep, format=merged.format)


def read_rank_states(directory: Path) -> dict[Rank, dict[str, torch.Tensor]]:
    """Each (tp, pp, ep) rank's model state of a legacy ``iter_N`` folder, as its file holds it (not merged)."""
    folders = _rank_folders(directory)
    return _load_sharing_replicas({rank: folders[numbers] / MODEL_FILE
                                   for numbers, rank in _ranks_of(folders, directory).items()})


def _rank_folders(directory: Path) -> dict[tuple[int, ...], Path]:
    """The ``mp_rank_*`` folders of an iteration folder, by the numbers in their names."""
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
    return folders


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
            like = writers.get((t, p, 0))  # EP ranks hold the same keys and shapes: one skeleton, copied
            writers[(t, p, e)] = open_files.enter_context(TorchFileWriter(file, fields, "model", rank_specs, caster,
                                                                          like=like))
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


def write_torch_dist_checkpoint(root: Path, iteration: int, specs: Mapping[str, TensorSpec],
                                tensors: Iterable[tuple[str, torch.Tensor]], layout: TorchDistLayout) -> Path:
    """Stream the full model (legacy TE keys at TP 1, ``specs`` in the order ``tensors`` hands them over) into a
    torch_dist checkpoint of ``layout`` in one process (``torch_dist_write.py``), tracker and all; returns the
    iteration folder."""

    def fill(folder: Path) -> None:
        write_part(folder, 0, specs, tensors, layout, with_objects=True)
        finish_torch_dist(folder, 1, layout, iteration)

    return save_iteration(root, iteration_dir_name(iteration), iteration, TRACKER, fill)
