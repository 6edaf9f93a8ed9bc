"""Memory reused from tensor to tensor, and tensors cast row block by row block through it.

Fresh memory costs a page fault (and the kernel's zeroing) per page: reading or casting a
model of gigabytes into fresh tensors spends most of its time there, not in the copy. A
``ReusedBuffer`` is faulted in once and handed out again for every tensor of a job; a
``BlockCaster`` casts any tensor through one, a block of rows at a time, so memory stays
at about ``BLOCK_BYTES`` whatever the tensor's size, and each block is written out while it
is still in the CPU cache.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

import torch

# Tensors that are cast or streamed move in row blocks of about this size: small enough that a
# block is still in the CPU cache when it is written out after its cast. Measured on the real
# dense config, a conversion took 5.2 s with 64 MiB blocks, 2.6 s with 4 MiB and 1.9 s with 1 MiB.
# Writes go out in pieces of this size too: one write() of a whole 128 MiB tensor was measured
# 4.8x slower per byte than the same bytes in 1 MiB writes (2 GB: 4.7 s against 1.0 s, ext4).
BLOCK_BYTES = 2**20


def write_pieces(tensor: torch.Tensor, max_bytes: int = BLOCK_BYTES) -> Iterator[memoryview]:
    """The bytes of a contiguous tensor as consecutive pieces of at most ``max_bytes``, without a copy."""
    data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    for start in range(0, len(data), max_bytes):
        yield data[start:start + max_bytes]


class ReusedBuffer:
    """One growing piece of memory, handed out as a tensor of any shape and dtype.

    A tensor it hands out is valid until the next one is asked for.
    """

    def __init__(self) -> None:
        self._bytes = torch.empty(0, dtype=torch.uint8)

    def view(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for size in shape:
            numel *= size
        nbytes = numel * dtype.itemsize
        if self._bytes.numel() < nbytes:
            self._bytes = torch.empty(0, dtype=torch.uint8)  # the old memory goes before the new is taken
            self._bytes = torch.empty(nbytes, dtype=torch.uint8)
        return self._bytes[:nbytes].view(dtype).view(shape)


class RowBlocks:
    """A tensor handed over as consecutive row blocks (each valid until the next is asked for); read once."""

    def __init__(self, blocks: Iterable[torch.Tensor]):
        self._blocks = iter(blocks)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self._blocks


class BlockCaster:
    """Yields a tensor's rows cast to a dtype, in blocks that share one buffer (each valid until the next)."""

    def __init__(self, max_bytes: int = BLOCK_BYTES):
        self.max_bytes = max_bytes
        self._buffer = ReusedBuffer()

    def cast_blocks(self, blocks: Iterable[torch.Tensor], dtype: torch.dtype) -> Iterator[torch.Tensor]:
        """Each block (row blocks of one tensor, as read from a file) cast to ``dtype``."""
        for block in blocks:
            yield self._buffer.view(tuple(block.shape), dtype).copy_(block)

    def rows(self, tensor: torch.Tensor, dtype: torch.dtype) -> Iterator[torch.Tensor]:
        """``tensor`` cast to ``dtype`` in consecutive row blocks of at most about ``max_bytes`` (at least one row)."""
        yield from self.cast_blocks(row_blocks(tensor, dtype, self.max_bytes), dtype)


def row_blocks(tensor: torch.Tensor, dtype: torch.dtype, max_bytes: int) -> Iterator[torch.Tensor]:
    """Views of consecutive row blocks of ``tensor`` that are at most about ``max_bytes`` in ``dtype`` (at least
    one row; a 0-d tensor is one block)."""
    if tensor.dim() == 0:
        yield tensor
        return
    row_bytes = max(1, tensor[0].numel() * dtype.itemsize)
    step = max(1, max_bytes // row_bytes)
    for start in range(0, len(tensor), step):
        yield tensor[start:start + step]


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one thread meanwhile (the setting is restored after).

    Casting and moving tensors is bound by memory bandwidth, which a second thread hardly
    adds to; on a shared machine the thread team's waits for each other cost more than it
    gains (a bf16 cast measured 2.6 s on one thread against 4.7 s on two, under load).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
