"""A ``torch.save`` file written one tensor at a time, so that a model never sits whole in memory.

``torch.save`` needs every tensor in memory at once, in its final dtype. Under
``torch.serialization.skip_data`` it writes the whole file (the pickle, one zip record per
tensor, the central directory) but leaves each tensor's bytes as an unwritten hole, to be
filled in a separate pass; ``TorchFileWriter`` does that pass, a tensor at a time, casting
each to its announced dtype through one reused buffer on the way. The placeholders handed to
``torch.save`` come from ``torch.empty`` and are never touched, so they cost address space,
not memory. The result is an ordinary ``torch.save`` file that loads with
``torch.load(weights_only=True)``; only the tensor records carry no CRC-32, which torch's
reader never checks (it is built with MINIZ_DISABLE_ZIP_READER_CRC32_CHECKS).
"""

from __future__ import annotations

import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from crossalign.tensorio.blocks import BlockCaster, write_pieces
from crossalign.tensorio.errors import CheckpointError

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, then the name and extra-field lengths at bytes 26-29
_LOCAL_SIGNATURE = b"PK\x03\x04"


@dataclass(frozen=True)
class TensorSpec:
    """What a tensor record of the file holds: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


def _record_offsets(path: Path, count: int) -> list[tuple[int, int]]:
    """(offset, size) of the bytes of records ``data/0`` .. ``data/{count-1}``: the tensors in pickling order."""
    with zipfile.ZipFile(path) as archive:
        records = {info.filename.split("/", 1)[-1]: info for info in archive.infolist()}
    stored = sum(name.startswith("data/") for name in records)
    if stored != count:
        raise CheckpointError(f"{path}: torch.save stored {stored} tensors, {count} were announced")
    offsets = []
    with open(path, "rb") as handle:
        for key in range(count):
            info = records[f"data/{key}"]
            handle.seek(info.header_offset)
            signature, name_length, extra_length = _LOCAL_HEADER.unpack(handle.read(_LOCAL_HEADER.size))
            if signature != _LOCAL_SIGNATURE or info.compress_type != zipfile.ZIP_STORED:
                raise CheckpointError(f"{path}: record data/{key} is not a stored zip entry")
            offsets.append((info.header_offset + _LOCAL_HEADER.size + name_length + extra_length, info.file_size))
    return offsets


def _copy_skeleton(source: Path, target: Path, records: list[tuple[int, int]]) -> None:
    """Copy a laid-out file's bytes outside its tensor records (pickle, zip headers, central directory) into
    ``target`` at the same places; the records stay holes, as ``torch.save`` under ``skip_data`` leaves them."""
    size = source.stat().st_size
    gaps, position = [], 0
    for offset, length in sorted(records):
        gaps.append((position, offset))
        position = offset + length
    gaps.append((position, size))
    with open(source, "rb") as reading, open(target, "wb") as writing:
        for start, end in gaps:
            if end > start:
                reading.seek(start)
                writing.seek(start)
                writing.write(reading.read(end - start))
        writing.truncate(size)


class TorchFileWriter:
    """Writes ``torch.save({**fields, tensors_field: {name: tensor, ...}})`` tensor by tensor.

    The tensors are announced up front (name, shape, dtype), which lays out the whole file,
    then handed over in the announced order; a floating tensor of another floating dtype is
    cast while it is written. A tensor that does not match its announcement is an error.
    """

    def __init__(self, path: Path, fields: Mapping[str, object], tensors_field: str,
                 specs: Mapping[str, TensorSpec], caster: BlockCaster | None = None,
                 like: "TorchFileWriter | None" = None):
        """``like``: a writer of the same fields and specs, whose laid-out file is copied (without its tensors'
        bytes) instead of pickling the same skeleton again: the expert-parallel ranks of a stage hold the same
        keys and shapes."""
        self.path = path
        if like is not None and like._layout == (dict(fields), tensors_field, dict(specs)):
            self._records = like._records
            _copy_skeleton(like.path, path, self._records)
        else:
            placeholders = {name: torch.empty(spec.shape, dtype=spec.dtype) for name, spec in specs.items()}
            with torch.serialization.skip_data():
                torch.save({**fields, tensors_field: placeholders}, path)
            del placeholders
            self._records = _record_offsets(path, len(specs))
        self._layout = (dict(fields), tensors_field, dict(specs))
        offsets = self._records
        for (name, spec), (_, size) in zip(specs.items(), offsets):
            if size != spec.nbytes:
                raise CheckpointError(f"{path}: the record of {name!r} holds {size} bytes, not {spec.nbytes}")
        self._pending = [(name, spec, offset) for (name, spec), (offset, _) in zip(specs.items(), offsets)]
        self._pending.reverse()  # popped from the end, in announced order
        self._caster = caster or BlockCaster()
        self._file = open(path, "r+b")

    def _claim(self, name: str, tensor: torch.Tensor) -> tuple[int, torch.dtype]:
        """Take the next announced record for ``tensor``: its offset and stored dtype (checked against it)."""
        if not self._pending:
            raise CheckpointError(f"{self.path}: tensor {name!r} was not announced")
        expected, spec, offset = self._pending.pop()
        castable = tensor.dtype == spec.dtype or (tensor.is_floating_point() and spec.dtype.is_floating_point)
        if name != expected or tuple(tensor.shape) != spec.shape or not castable:
            raise CheckpointError(f"{self.path}: expected {expected!r} {spec.dtype} {list(spec.shape)}, "
                                  f"got {name!r} {tensor.dtype} {list(tensor.shape)}")
        return offset, spec.dtype

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next announced tensor (cast to its announced dtype when both are floating)."""
        write_to_all([(self, name)], tensor)

    def close(self) -> None:
        self._file.close()
        if self._pending:
            raise CheckpointError(f"{self.path}: {len(self._pending)} announced tensors were never written, "
                                  f"first {self._pending[-1][0]!r}")

    def __enter__(self) -> "TorchFileWriter":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self._file.close()


def write_to_all(targets: list[tuple[TorchFileWriter, str]], tensor: torch.Tensor) -> None:
    """Write one tensor as the next announced record of several files (each under its name there).

    A tensor that several ranks hold alike (replicated over expert-parallel ranks) is cast once,
    block by block, and each block goes to every file while it is in the CPU cache: casting it
    again for every file would cost as much as the writes.
    """
    claims = [(writer, *writer._claim(name, tensor)) for writer, name in targets]
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        # A transposed tensor (an expert in Megatron's [out, in] from MindSpore's [in, out]) cast or written
        # row block by row block reads across the whole of it for every block: 160 MB/s measured on the
        # 397B-A17B's experts. One copy in its own dtype takes torch's blocked transpose (aten/native/Copy.cpp,
        # copy_transpose_valid), at memory speed.
        tensor = tensor.contiguous()
    by_dtype: dict[torch.dtype, list[tuple[TorchFileWriter, int]]] = {}
    for writer, offset, dtype in claims:
        by_dtype.setdefault(dtype, []).append((writer, offset))
    for dtype, places in by_dtype.items():
        same = tensor.dtype == dtype and tensor.is_contiguous()
        blocks = [tensor] if same else places[0][0]._caster.rows(tensor, dtype)  # a view is copied a block at a time
        position = 0
        for block in blocks:
            for piece in write_pieces(block):
                for writer, offset in places:
                    writer._file.seek(offset + position)
                    writer._file.write(piece)
                position += len(piece)
