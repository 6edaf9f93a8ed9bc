"""Safetensors files one tensor at a time, without memory-mapping them.

The bf16 cast must hold one tensor in memory at a time, and a conversion must not pull a
whole file into memory. ``safe_open`` validates a file (header, offsets, size), but it
memory-maps the file, whose pages then stay resident and cost a page fault each; so after
``safe_open`` has checked the header, tensor data is read with plain ``readinto`` at the
offsets the header gives. Writing streams the format directly: an 8-byte little-endian
header length, a JSON header (dtype, shape, data_offsets per tensor, ``__metadata__``),
then the raw bytes.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator, Mapping

import torch
from safetensors import safe_open

from crossalign.tensorio.blocks import BLOCK_BYTES, ReusedBuffer, write_pieces
from crossalign.tensorio.errors import CheckpointError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
FLOATING = frozenset(name for name, dtype in DTYPES.items() if dtype.is_floating_point)


@dataclass(frozen=True)
class TensorInfo:
    """What a safetensors header says about one tensor (``offset``: where its bytes start in the file)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize


def read_header(path: Path) -> tuple[list[TensorInfo], dict[str, str] | None]:
    """The tensors of a safetensors file (in storage order) and its ``__metadata__``; nothing is loaded."""
    try:
        with safe_open(str(path), framework="pt"):
            pass  # validates the header, the offsets and the file size
        with open(path, "rb") as handle:
            length = struct.unpack("<Q", handle.read(8))[0]
            header = json.loads(handle.read(length))
    except Exception as exc:  # safetensors raises its own error type, or OSError
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None
    metadata = header.pop("__metadata__", None)
    infos = sorted((TensorInfo(name, entry["dtype"], tuple(entry["shape"]), 8 + length + entry["data_offsets"][0])
                    for name, entry in header.items()), key=lambda info: info.offset)
    for info in infos:
        if info.dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor {info.name!r} has dtype {info.dtype}, which torch cannot hold")
    return infos, metadata


def read_into(handle: BinaryIO, path: Path, name: str, target: torch.Tensor) -> None:
    """Fill ``target`` with the bytes at the handle's position; a file that ends first names ``path`` and ``name``."""
    view = memoryview(target.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        got = handle.readinto(view[done:])
        if not got:
            raise CheckpointError(f"{path}: file ends inside tensor {name!r}")
        done += got


def read_tensor(path: Path, info: TensorInfo, dtype: torch.dtype | None = None,
                buffer: ReusedBuffer | None = None) -> torch.Tensor:
    """One tensor, converted to ``dtype`` block by block when given.

    It is read into memory of its own, or into ``buffer`` when given (then it is valid only
    until the buffer is used again).
    """
    source_dtype = DTYPES[info.dtype]
    target = dtype or source_dtype
    tensor = buffer.view(info.shape, target) if buffer is not None else torch.empty(info.shape, dtype=target)
    if tensor.dtype == source_dtype:
        with open(path, "rb", buffering=0) as handle:
            handle.seek(info.offset)
            read_into(handle, path, info.name, tensor)
        return tensor
    start = 0
    for block in read_rows(path, info, BLOCK_BYTES):
        if not info.shape:
            tensor.copy_(block)
            break
        tensor[start:start + block.shape[0]].copy_(block)
        start += block.shape[0]
    return tensor


def read_rows(path: Path, info: TensorInfo, max_bytes: int, buffer: ReusedBuffer | None = None) -> Iterator[torch.Tensor]:
    """A tensor in consecutive row blocks of at most about ``max_bytes`` (at least one row).

    The blocks share one buffer (``buffer`` when given, which a caller can keep from tensor
    to tensor): each is valid until the next is asked for.
    """
    rows = info.shape[0] if info.shape else 1
    row_shape = info.shape[1:] if info.shape else ()
    row_bytes = info.nbytes // rows if rows else 0
    step = max(1, max_bytes // max(row_bytes, 1))
    buffer = buffer or ReusedBuffer()
    with open(path, "rb", buffering=0) as handle:
        handle.seek(info.offset)
        for start in range(0, rows, step):
            shape = (min(step, rows - start), *row_shape) if info.shape else ()
            block = buffer.view(shape, DTYPES[info.dtype])
            read_into(handle, path, info.name, block)
            yield block


def _header_bytes(infos: Iterable[TensorInfo], metadata: Mapping[str, str] | None) -> bytes:
    header: dict[str, object] = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for info in infos:
        header[info.name] = {"dtype": info.dtype, "shape": list(info.shape), "data_offsets": [offset, offset + info.nbytes]}
        offset += info.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes with spaces


class SafetensorsWriter:
    """Writes a safetensors file tensor by tensor, in the order announced up front.

    The header (which needs every shape) is written first, so the caller announces all
    tensors, then hands them over one at a time; each is checked against its announcement.
    """

    def __init__(self, path: Path, infos: list[TensorInfo], metadata: Mapping[str, str] | None):
        self.path = path
        self._pending = list(infos)
        self._file: BinaryIO = open(path, "wb")
        header = _header_bytes(infos, metadata)
        self._file.write(struct.pack("<Q", len(header)))
        self._file.write(header)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next announced tensor whole."""
        self.write_blocks(name, [tensor])

    def write_blocks(self, name: str, blocks: Iterable[torch.Tensor]) -> None:
        """Write the next announced tensor from consecutive row blocks (so that it never sits whole in memory)."""
        if not self._pending:
            raise CheckpointError(f"{self.path}: tensor {name!r} was not announced")
        expected = self._pending.pop(0)
        shapes, written, dtype = [], 0, None
        for block in blocks:
            shapes.append(list(block.shape))
            dtype = DTYPE_NAMES.get(block.dtype)
            if name == expected.name and dtype == expected.dtype and (
                    tuple(block.shape) == expected.shape or tuple(block.shape[1:]) == expected.shape[1:]):
                for piece in write_pieces(block.detach().contiguous()):
                    self._file.write(piece)
                    written += len(piece)
            else:
                written = -1
                break
        if written != expected.nbytes:
            got = shapes[0] if len(shapes) == 1 else f"blocks {shapes}"
            raise CheckpointError(f"{self.path}: expected {expected.name!r} {expected.dtype} {list(expected.shape)}, "
                                  f"got {name!r} {dtype} {got}")

    def close(self) -> None:
        self._file.close()
        if self._pending:
            raise CheckpointError(f"{self.path}: {len(self._pending)} announced tensors were never written, "
                                  f"first {self._pending[0].name!r}")

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self._file.close()


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None) -> int:
    """Write tensors (already in memory) to one file; returns the bytes of tensor data written."""
    infos = []
    for name, tensor in tensors.items():
        if tensor.dtype not in DTYPE_NAMES:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store")
        infos.append(TensorInfo(name, DTYPE_NAMES[tensor.dtype], tuple(tensor.shape)))
    with SafetensorsWriter(path, infos, metadata) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
    return sum(info.nbytes for info in infos)
