"""Megatron's ``--ckpt-format torch_dist`` checkpoints (the default of recent Megatron), read a chunk at a time.

Layout (core_v0.16.1 ``megatron/core/dist_checkpointing``)::

    <root>/latest_checkpointed_iteration.txt
    <root>/iter_0000010/metadata.json         {"sharded_backend": "torch_dist", ...}
    <root>/iter_0000010/.metadata             torch.distributed.checkpoint's index
    <root>/iter_0000010/__0_0.distcp ...      the data, in any number of files
    <root>/iter_0000010/common.pt             what is not sharded

Every tensor is stored once at its global shape, as chunks with offsets, whatever layout saved
it, so a load at any TP/PP/EP cuts out its own slices: Megatron reshards at load. The keys and
chunks are those of ``torch_dist_layout.py``; each chunk is one ``torch.save`` blob at an
offset of a ``.distcp`` file (torch's ``FileSystemWriter``, ``filesystem.py`` ``_write_item``).

Reading needs no process group, no model and no megatron-core: the index is checked against
the model's layout before anything is read (every key the model's, at its global shape and
dtype, its chunks tiling it, each in a data file that is there and long enough), and then
``torch_dist_plan`` reads each legacy tensor (TE names, TP 1, routed experts one tensor per
expert) from the chunks that overlap it, straight into the reader's buffer when a chunk is
exactly its piece, else through one chunk's worth of scratch. So the merge path reads a routed
expert at a time, not a layer's [E, ...] tensor. Optimizer state, RNG state and the
``_extra_state`` objects are left out. The writer is ``torch_dist_write.py``.
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from crossalign.config import ModelConfig
from crossalign.models.layout import ExpertForm
from crossalign.sides.megatron.merge import FullTensor
from crossalign.sides.megatron.torch_dist_layout import Piece, torch_dist_layout
from crossalign.tensorio.blocks import ReusedBuffer
from crossalign.tensorio.errors import CheckpointError
from crossalign.tensorio.safetensors_io import read_into

METADATA = "metadata.json"
INDEX = ".metadata"
BACKEND = "torch_dist"
MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.", "mtp.")
FLOATING = (torch.float32, torch.bfloat16, torch.float16)
_LOCAL_HEADER_BYTES = 30  # a zip local file header before its name and extra field (lengths at bytes 26-29)


def is_torch_dist(directory: Path) -> bool:
    """Whether an iteration folder holds a torch_dist checkpoint (its metadata.json names the backend)."""
    file = Path(directory) / METADATA
    if not file.exists():
        return False
    try:
        backend = json.loads(file.read_text()).get("sharded_backend")
    except (OSError, ValueError, AttributeError):
        raise CheckpointError(f"{file}: not the JSON object a distributed checkpoint's metadata.json is") from None
    if backend != BACKEND:
        raise CheckpointError(f"{file}: sharded_backend {backend!r}; only {BACKEND!r} checkpoints are read")
    return True


def read_index(directory: Path):
    """torch.distributed.checkpoint's ``Metadata`` of a torch_dist folder, read with its own reader."""
    import torch.distributed.checkpoint as dcp  # heavy, and only a torch_dist folder needs it

    try:
        return dcp.FileSystemReader(str(directory)).read_metadata()
    except Exception as exc:  # a missing, truncated or foreign pickle raises whatever its unpickling meets
        raise CheckpointError(f"{Path(directory) / INDEX}: cannot read the torch_dist index ({exc})") from None


class _FileView(io.RawIOBase):
    """``length`` bytes of an open file from ``offset``, as a file of its own (for zipfile and torch.load)."""

    def __init__(self, handle, offset: int, length: int):
        self.handle, self.offset, self.length, self.position = handle, offset, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = base + position
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, buffer) -> int:
        size = max(0, min(len(buffer), self.length - self.position))
        self.handle.seek(self.offset + self.position)
        got = self.handle.readinto(memoryview(buffer)[:size])
        self.position += got
        return got


@dataclass
class StoredChunk:
    """One chunk of a sharded key: where its ``torch.save`` blob is, and what the index says it holds.

    Before its first read the blob's zip records are checked: one stored tensor record of the
    chunk's bytes. The first chunk of each key (``unpickle``) is also loaded on the meta device by
    torch, which reads only its pickle, to check the dtype and shape it holds (about a millisecond
    a blob: for every chunk it would cost a real model's conversion minutes).
    """

    file: Path
    key: str
    offset: int  # of the blob in the file
    length: int
    offsets: tuple[int, ...]  # of the chunk in the global tensor
    sizes: tuple[int, ...]
    dtype: torch.dtype
    unpickle: bool = False
    _data: int | None = None  # file offset of the chunk's bytes, found on the first read

    def _data_offset(self) -> int:
        """Where the tensor's bytes start in the file, after checking the blob holds what the index says."""
        if self._data is not None:
            return self._data
        where = f"{self.file}: {self.key!r} chunk at {list(self.offsets)}"
        nbytes = math.prod(self.sizes) * self.dtype.itemsize
        try:
            with open(self.file, "rb") as handle:
                blob = _FileView(handle, self.offset, self.length)
                meta = torch.load(blob, map_location="meta", weights_only=True) if self.unpickle else None
                blob.seek(0)
                with zipfile.ZipFile(blob) as archive:
                    records = [info for info in archive.infolist() if info.filename.endswith("/data/0")]
                header = records[0].header_offset if len(records) == 1 else None
                blob.seek(header + 26 if header is not None else 0)
                lengths = blob.read(4)
        except Exception as exc:  # a blob that is not a torch.save file raises whatever its parser meets
            raise CheckpointError(f"{where}: not a torch.save blob ({exc})") from None
        if meta is not None and (not isinstance(meta, torch.Tensor) or meta.dtype != self.dtype
                                 or tuple(meta.shape) != self.sizes or not meta.is_contiguous()
                                 or meta.storage_offset() != 0):
            what = f"{meta.dtype} {list(meta.shape)}" if isinstance(meta, torch.Tensor) else type(meta).__name__
            raise CheckpointError(f"{where}: the data file holds {what}, the index says {self.dtype} "
                                  f"{list(self.sizes)}")
        if header is None or records[0].file_size != nbytes or records[0].compress_type != zipfile.ZIP_STORED:
            held = f"{records[0].file_size} bytes" if header is not None else f"{len(records)} tensor records"
            raise CheckpointError(f"{where}: the data file holds {held}, the index says {self.dtype} "
                                  f"{list(self.sizes)} ({nbytes} bytes)")
        name_length, extra_length = int.from_bytes(lengths[:2], "little"), int.from_bytes(lengths[2:], "little")
        self._data = self.offset + header + _LOCAL_HEADER_BYTES + name_length + extra_length
        return self._data

    def read(self, target: torch.Tensor) -> None:
        """The chunk's data into ``target`` (contiguous, of the chunk's numel and dtype)."""
        with open(self.file, "rb", buffering=0) as handle:
            handle.seek(self._data_offset())
            read_into(handle, self.file, self.key, target)


class DistTensor:
    """One legacy tensor of a torch_dist folder, read from the chunks that hold its pieces (a merge ``Part``)."""

    def __init__(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, pieces: tuple[Piece, ...],
                 chunks: dict[str, dict[tuple, StoredChunk]], directory: Path, scratch: ReusedBuffer):
        self.key, self.shape, self.dtype, self.pieces, self.chunks = key, shape, dtype, pieces, chunks
        self.where, self._scratch = f"{directory}: {pieces[0].key}", scratch

    def read(self, buffer: ReusedBuffer | None = None) -> torch.Tensor:
        out = buffer.view(self.shape, self.dtype) if buffer is not None else torch.empty(self.shape, dtype=self.dtype)
        for piece in self.pieces:
            self._read_piece(piece, piece.take(out))
        return out

    def _read_piece(self, piece: Piece, target: torch.Tensor) -> None:
        chunks = self.chunks[piece.key]
        exact = chunks.get((piece.offsets, piece.sizes))
        if exact is not None and target.is_contiguous():  # the chunk is the piece: straight into the target
            exact.read(target)
            return
        for chunk in chunks.values():
            low = [max(a, b) for a, b in zip(piece.offsets, chunk.offsets)]
            high = [min(a + n, b + m) for a, n, b, m in zip(piece.offsets, piece.sizes, chunk.offsets, chunk.sizes)]
            if any(lo >= hi for lo, hi in zip(low, high)):
                continue
            data = self._scratch.view(chunk.sizes, chunk.dtype)
            chunk.read(data)
            into, out_of = target, data
            for dim, (lo, hi) in enumerate(zip(low, high)):
                into = into.narrow(dim, lo - piece.offsets[dim], hi - lo)
                out_of = out_of.narrow(dim, lo - chunk.offsets[dim], hi - lo)
            into.copy_(out_of)


def _tiles(key: str, shape: tuple[int, ...], chunks: list[StoredChunk], index: Path) -> None:
    """The chunks cover the tensor exactly once: each a union of cells of the grid of all their boundaries."""
    bounds = [sorted({0, size, *(c.offsets[d] for c in chunks), *(c.offsets[d] + c.sizes[d] for c in chunks)})
              for d, size in enumerate(shape)]
    covered: set[tuple[int, ...]] = set()
    for chunk in chunks:
        if len(chunk.offsets) != len(shape) or any(o < 0 or o + n > size for o, n, size in
                                                   zip(chunk.offsets, chunk.sizes, shape)):
            raise CheckpointError(f"{index}: {key!r} has a chunk at {list(chunk.offsets)} of {list(chunk.sizes)} "
                                  f"outside its shape {list(shape)}")
        ranges = [range(b.index(o), b.index(o + n)) for b, o, n in zip(bounds, chunk.offsets, chunk.sizes)]
        cells = set(_grid(ranges))
        if cells & covered:
            raise CheckpointError(f"{index}: {key!r} has overlapping chunks (one at {list(chunk.offsets)})")
        covered |= cells
    if len(covered) != math.prod(len(b) - 1 for b in bounds):
        raise CheckpointError(f"{index}: the chunks of {key!r} do not cover its shape {list(shape)}")


def _grid(ranges: list[range]):
    if not ranges:
        yield ()
        return
    for first in ranges[0]:
        for rest in _grid(ranges[1:]):
            yield (first, *rest)


def local_aliases(model: ModelConfig, core_version: str, experts: ExpertForm = "per_expert") -> dict[str, str]:
    """The sharded key of megatron-core's local-module model -> TE's, where they differ (the fused norms)."""
    te, local = (torch_dist_layout(model, core_version, experts, names) for names in ("te", "local"))
    return {mine.key: theirs.key for legacy, pieces in te.pieces.items()
            for theirs, mine in zip(pieces, local.pieces[legacy]) if mine.key != theirs.key}


def torch_dist_plan(directory: Path, model: ModelConfig, core_version: str,
                    experts: ExpertForm = "per_expert") -> dict[str, FullTensor]:
    """Every model tensor of a torch_dist folder under its legacy TE key at TP 1, as the chunks it is read from.

    Only the index is read, and held against the model's layout and the data files' sizes;
    each problem names the file and the key. Local-module norm names are read as TE's.
    """
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata  # torch_dist only

    directory = Path(directory)
    index = directory / INDEX
    metadata = read_index(directory)
    layout = torch_dist_layout(model, core_version, experts)
    expected = layout.global_shapes
    aliases: dict[str, str] | None = None  # built only for a checkpoint of the local model's keys
    stored: dict[str, dict[tuple, StoredChunk]] = {}
    sizes: dict[Path, int] = {}
    dtypes: dict[torch.dtype, str] = {}
    for name, info in metadata.state_dict_metadata.items():
        if not isinstance(info, TensorStorageMetadata) or not name.startswith(MODEL_PREFIXES):
            continue
        key = name
        if key not in expected:
            aliases = local_aliases(model, core_version, experts) if aliases is None else aliases
            key = aliases.get(name, name)
        if key not in expected:
            raise CheckpointError(f"{index}: {name!r} is not a tensor of model {model.name} (core {core_version})")
        if tuple(info.size) != expected[key]:
            raise CheckpointError(f"{index}: {name!r} has shape {list(info.size)}, model {model.name} "
                                  f"{list(expected[key])}")
        dtype = info.properties.dtype
        if dtype not in FLOATING:
            raise CheckpointError(f"{index}: {name!r} is {dtype}, not a floating dtype of a model's weights")
        dtypes.setdefault(dtype, name)
        if len(dtypes) > 1:
            first, other = list(dtypes.items())
            raise CheckpointError(f"{index}: {other[1]!r} is {other[0]}, while {first[1]!r} is {first[0]}: a "
                                  "checkpoint holds its model in one dtype")
        chunks = []
        for chunk in info.chunks:
            where = metadata.storage_data.get(MetadataIndex(name, chunk.offsets))
            if where is None:
                raise CheckpointError(f"{index}: {name!r} has no data for its chunk at {list(chunk.offsets)}")
            file = directory / where.relative_path
            if file not in sizes:
                sizes[file] = file.stat().st_size if file.exists() else -1
            if sizes[file] < 0:
                raise CheckpointError(f"{file}: the data file of {name!r} is missing")
            if where.offset + where.length > sizes[file]:
                raise CheckpointError(f"{file}: truncated: {name!r} is stored up to byte {where.offset + where.length}"
                                      f", the file has {sizes[file]}")
            chunks.append(StoredChunk(file, name, where.offset, where.length, tuple(chunk.offsets),
                                      tuple(chunk.sizes), dtype, unpickle=not chunks))
        _tiles(name, tuple(info.size), chunks, index)
        stored[key] = {(chunk.offsets, chunk.sizes): chunk for chunk in chunks}
    missing = sorted(set(expected) - set(stored))
    if missing:
        raise CheckpointError(f"{index}: model {model.name} (core {core_version}) has {len(missing)} tensors the "
                              f"checkpoint does not: {missing[:5]}")
    scratch = ReusedBuffer()
    dtype = next(iter(dtypes))
    tensors = {}
    for legacy, pieces in layout.pieces.items():
        tensors[legacy] = FullTensor(((DistTensor(legacy, layout.shapes[legacy], dtype, pieces, stored, directory,
                                                  scratch),),))
    return tensors

