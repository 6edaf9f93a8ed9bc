"""A torch_dist checkpoint written a chunk at a time, without the model, by torch.distributed.checkpoint's own writer.

megatron-core's ``dist_checkpointing.save`` needs the model built and a process group, and holds
the model's state; crossalign writes the same checkpoint from the converter's stream instead:

* the layout (keys, global shapes, chunk offsets, ``_extra_state`` objects) is megatron-core's,
  derived from the config (``torch_dist_layout.py``);
* the data files are written by torch's ``FileSystemWriter.write_data`` with one thread, which
  asks the planner for each item in the plan's order (``filesystem.py``: ``_split_by_size_and_type``
  keeps the order for one bin, ``_SerialCpuLoader`` resolves one item at a time); the planner
  here resolves an item by taking the next chunk of the conversion's stream, so one chunk is in
  memory at a time, and each is one ``torch.save`` blob as torch writes it;
* a *part* (a range of layers, on any machine that shares the folder) writes its chunks into
  ``__{part}_0.distcp`` and its own index ``__{part}.metadata``, torch's form for a rank that
  saves without collectives (``FileSystemWriter.finish`` with ``use_collectives=False``);
* ``finish_torch_dist`` merges the parts' indexes into ``.metadata`` with the same writer's
  ``finish``, after checking that every chunk of the layout is stored exactly once, and writes
  ``metadata.json`` and ``common.pt`` as megatron-core does (core_v0.16.1
  ``dist_checkpointing/core.py:22-33`` ``CheckpointingConfig``, ``:80-97`` ``save_config``;
  ``strategies/common.py:40-49``: ``torch.save`` of the common state).

common.pt holds what Megatron-LM's ``load_checkpoint`` reads beside the model: the checkpoint
version (3.0: no query/key/value reordering, ``fix_query_key_value_ordering``) and the iteration,
as the legacy rank files do. The ShardedObjects hold ``[None]``, what megatron-core saves for a
linear layer's extra state without fp8 (``torch.save`` of the list of its shards' data,
``strategies/torch.py`` ``_mcore_to_torch_sharded_object``).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import torch

from crossalign.sides.megatron.torch_dist import BACKEND, INDEX, METADATA
from crossalign.sides.megatron.torch_dist_layout import TorchDistLayout
from crossalign.tensorio.blocks import BLOCK_BYTES
from crossalign.tensorio.errors import CheckpointError
from crossalign.tensorio.torch_file import TensorSpec

COMMON = "common.pt"
CHECKPOINT_VERSION = 3.0
# megatron-core's CheckpointingConfig("torch_dist") as save_config writes it
CHECKPOINTING_CONFIG = {"sharded_backend": BACKEND, "sharded_backend_version": 1, "common_backend": "torch",
                        "common_backend_version": 1}


class _PieceWrites(io.RawIOBase):
    """A file written in pieces of at most ``BLOCK_BYTES`` (``tensorio/blocks.py`` says why: one write() of a whole
    tensor was measured several times slower per byte than the same bytes in 1 MiB writes)."""

    def __init__(self, stream):
        self.stream = stream

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), BLOCK_BYTES):
            self.stream.write(view[start:start + BLOCK_BYTES])
        return len(view)

    def tell(self) -> int:
        return self.stream.tell()

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()


def _piece_writes_file_system():
    """torch's FileSystem whose data files are written through ``_PieceWrites`` (FileSystemWriter's ``fs``)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class PieceWritesFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path, mode):
            with super().create_stream(path, mode) as stream:
                yield _PieceWrites(stream) if "w" in mode else stream

    return PieceWritesFileSystem()


def part_index(part: int) -> str:
    """The index file a part writes (torch's name for a rank's own metadata)."""
    return f"__{part}{INDEX}"


def _chunks(specs: Mapping[str, TensorSpec], tensors: Iterable[tuple[str, torch.Tensor]],
            layout: TorchDistLayout, folder: Path) -> Iterator[tuple[str, tuple[int, ...], torch.Tensor]]:
    """(sharded key, offsets, chunk in its stored dtype) of each tensor of the stream, in the announced order."""
    announced = iter(specs.items())
    for name, tensor in tensors:
        expected, spec = next(announced, (None, None))
        if spec is None:
            raise CheckpointError(f"{folder}: tensor {name!r} was not announced")
        castable = tensor.dtype == spec.dtype or (tensor.is_floating_point() and spec.dtype.is_floating_point)
        if name != expected or tuple(tensor.shape) != spec.shape or not castable:
            raise CheckpointError(f"{folder}: expected {expected!r} {spec.dtype} {list(spec.shape)}, got {name!r} "
                                  f"{tensor.dtype} {list(tensor.shape)}")
        for piece in layout.pieces[name]:
            # a tensor of its own, cast on the way: torch.save writes a tensor's whole storage, and a piece is
            # often a view of a bigger one (an expert of a block, a half of fc1)
            yield piece.key, piece.offsets, torch.empty(piece.sizes, dtype=spec.dtype).copy_(piece.take(tensor))
    left = next(announced, None)
    if left is not None:
        raise CheckpointError(f"{folder}: announced tensor {left[0]!r} was never written")


def _plan_items(specs: Mapping[str, TensorSpec], layout: TorchDistLayout, objects: tuple[str, ...]):
    """torch's WriteItems of the part: the objects, then every chunk in the stream's order."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    items = [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in objects]
    for name, spec in specs.items():
        for piece in layout.pieces[name]:
            items.append(WriteItem(
                index=MetadataIndex(piece.key, piece.offsets), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(piece.offsets),
                                                                       torch.Size(piece.sizes)),
                                            properties=TensorProperties(dtype=spec.dtype),
                                            size=torch.Size(piece.global_shape))))
    return items


def _state_dict_metadata(items) -> dict:
    """The index entries of some WriteItems: each tensor's global shape, dtype and chunks; each object's."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    entries: dict = {}
    for item in items:
        if item.tensor_data is None:
            entries[item.index.fqn] = BytesStorageMetadata()
            continue
        entry = entries.setdefault(item.index.fqn, TensorStorageMetadata(item.tensor_data.properties,
                                                                         item.tensor_data.size, []))
        entry.chunks.append(item.tensor_data.chunk)
    return entries


def write_part(folder: Path, part: int, specs: Mapping[str, TensorSpec], tensors: Iterable[tuple[str, torch.Tensor]],
               layout: TorchDistLayout, with_objects: bool) -> None:
    """Write the chunks of the legacy tensors ``specs`` (handed over in that order by ``tensors``) as part ``part``:
    ``__{part}_0.distcp`` and its index ``__{part}.metadata``; ``with_objects``: the ShardedObjects too."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

    objects = layout.objects if with_objects else ()
    items = _plan_items(specs, layout, objects)
    stream = _chunks(specs, tensors, layout, folder)

    class StreamedPlanner(DefaultSavePlanner):
        """Resolves each item with the next chunk of the conversion (the plan is in the stream's order).

        torch's writer keeps every tensor it wrote, by key, for its safetensors form
        (``filesystem.py``, ``_write_files_from_queue``: ``tensor_dict``): each chunk's memory is
        freed once it is written, when the next is asked for, so that memory holds one chunk.
        """

        written: torch.Tensor | None = None

        def release(self) -> None:
            if self.written is not None:
                self.written.untyped_storage().resize_(0)
                self.written = None

        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                data = io.BytesIO()
                torch.save([None], data)
                return data
            self.release()
            key, offsets, chunk = next(stream)
            if (key, offsets) != (write_item.index.fqn, tuple(write_item.index.offset)):
                raise CheckpointError(f"{folder}: the stream gave {key!r} at {list(offsets)} where "
                                      f"{write_item.index.fqn!r} at {list(write_item.index.offset)} was planned")
            self.written = chunk
            return chunk

    writer = FileSystemWriter(str(folder), sync_files=False, thread_count=1)
    writer.fs = _piece_writes_file_system()
    # torch names the files of the rank its plan is the i-th of __{i}_0.distcp ...: this part's is the last
    plan = writer.prepare_global_plan([SavePlan([])] * part + [SavePlan(items)])[-1]
    # No CRC-32 over every record: torch.load never checks it (torch is built with
    # MINIZ_DISABLE_ZIP_READER_CRC32_CHECKS, as tensorio/torch_file.py says), and it cost a third of the writing.
    crc32 = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    planner = StreamedPlanner()
    try:
        results = writer.write_data(plan, planner).value()
    finally:
        torch.serialization.set_crc32_options(crc32)
        planner.release()
    for left in stream:  # the stream must end where the plan does
        raise CheckpointError(f"{folder}: {left[0]!r} at {list(left[1])} was not planned")
    writer.set_up_storage_writer(part == 0, rank=part, use_collectives=False)
    writer.finish(Metadata(state_dict_metadata=_state_dict_metadata(items)), [results])


def finish_torch_dist(folder: Path, parts: int, layout: TorchDistLayout, iteration: int) -> None:
    """Merge the indexes of parts 0 .. parts-1 into ``.metadata`` (every chunk and object of the layout stored
    exactly once) and write ``metadata.json`` and ``common.pt``: the folder is then a whole checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
    from torch.distributed.checkpoint.storage import WriteResult

    folder = Path(folder)
    merged: dict = {}
    results = []
    for part in range(parts):
        if not (folder / part_index(part)).exists():
            raise CheckpointError(f"{folder / part_index(part)}: part {part} of {parts} has not been written")
        index = dcp.FileSystemReader(str(folder)).read_metadata(rank=part)
        for key, entry in index.state_dict_metadata.items():
            held = merged.setdefault(key, entry)
            if held is not entry and isinstance(entry, TensorStorageMetadata):
                held.chunks.extend(entry.chunks)
        results += [WriteResult(index=where, size_in_bytes=info.length, storage_data=info)
                    for where, info in index.storage_data.items()]
    stored = {(result.index.fqn, tuple(result.index.offset or ())) for result in results}
    planned = {(piece.key, piece.offsets) for pieces in layout.pieces.values() for piece in pieces}
    planned |= {(key, ()) for key in layout.objects}
    if len(stored) != len(results) or stored != planned:
        missing, extra = sorted(planned - stored), sorted(stored - planned)
        raise CheckpointError(f"{folder}: the parts do not store the model's chunks exactly once (missing "
                              f"{missing[:3]}, not the model's {extra[:3]}, {len(results) - len(stored)} twice)")
    dcp.FileSystemWriter(str(folder), sync_files=False).finish(Metadata(state_dict_metadata=merged), [results])
    for part in range(parts):
        (folder / part_index(part)).unlink()
    torch.save({"checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}, folder / COMMON)
    (folder / METADATA).write_text(json.dumps(CHECKPOINTING_CONFIG))

