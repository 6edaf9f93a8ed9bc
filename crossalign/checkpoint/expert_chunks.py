"""Routed experts converted a chunk of experts at a time, so that memory does not grow with the expert count.

MindFormers stores a layer's routed experts as one tensor ([E, H, 2i], or [E*H, 2i] in graph
mode); Megatron's TE grouped experts as one tensor per expert. The expert rule
(``rules.TransposeExperts``) maps all E at once, which at 512 experts of the 397B-A17B is
8.6 GB in bf16 for one input and as much again for its outputs. Here its plan entry is cut
into ``ExpertChunk`` rules of about ``CHUNK_BYTES`` each, which apply the same rule to experts
``first .. first+count-1``: ms2mg reads only those experts' rows of the MindFormers tensor
(``chunked_reads``), mg2ms writes the chunk's rows of the MindFormers tensor as they come
(``joined_chunks`` hands them to the writer as one tensor's row blocks). The outputs are the
rule's own, bit for bit.

A chunk's MindFormers side is named ``<key>#experts=<first>:<stop>`` in the plan; no real key
holds a ``#``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Iterator

import torch

from crossalign.checkpoint.convert_core import reused_buffer_reads
from crossalign.checkpoint.rules import PlacedRule, Rule, TransposeExperts
from crossalign.sides.mindformers.checkpoint import MindFormersCheckpoint
from crossalign.tensorio.blocks import ReusedBuffer, RowBlocks
from crossalign.tensorio.errors import CheckpointError
from crossalign.tensorio.safetensors_io import DTYPES, read_into

CHUNK_BYTES = 256 * 2**20  # the MindFormers bytes of one chunk of experts (at least one expert)
_CHUNK_KEY = re.compile(r"(.+)#experts=(\d+):(\d+)")


@dataclasses.dataclass(frozen=True)
class ExpertChunk(Rule):
    """Experts ``first .. first+count-1`` of one per-expert ``TransposeExperts`` rule, as a rule of its own."""

    whole: TransposeExperts
    first: int
    count: int

    @property
    def sources(self) -> tuple[str, ...]:
        return (f"{self.whole.source}#experts={self.first}:{self.first + self.count}",)

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(f"{self.whole.target}{e}" for e in range(self.first, self.first + self.count))

    def _part(self) -> TransposeExperts:
        return dataclasses.replace(self.whole, num_experts=self.count)

    def forward(self, tensors):
        """The rule's outputs, each transposed straight into one contiguous block (views of it, which the
        streaming writer consumes one by one): the rule's own clones keep the transposed strides, and the
        writer would then transpose each again."""
        experts = self._part().stacked_input(tensors[0]).transpose(1, 2)
        out = torch.empty(experts.shape, dtype=experts.dtype)
        for e in range(self.count):
            out[e].copy_(experts[e])  # a 2-D transpose: torch's blocked copy (aten/native/Copy.cpp)
        return list(out)

    def inverse(self, tensors):
        return self._part().inverse(tensors)


def chunked_plan(plan: list[PlacedRule], expert_bytes: dict[str, int], chunk_bytes: int | None = None
                 ) -> list[PlacedRule]:
    """``plan`` with each per-expert rule whose MindFormers tensor is over ``chunk_bytes`` cut into chunks.

    ``expert_bytes``: the bytes of each MindFormers expert tensor (by its key) in the dtype it is
    read in; a tensor not named there is left whole.
    """
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    out = []
    for placed in plan:
        rule = placed.rule
        total = expert_bytes.get(placed.source_keys[0]) if isinstance(rule, TransposeExperts) else None
        if total is None or not rule.per_expert or total <= chunk_bytes:
            out.append(placed)
            continue
        count = max(1, chunk_bytes // (total // rule.num_experts))
        out += [dataclasses.replace(placed, rule=ExpertChunk(rule, first, min(count, rule.num_experts - first)))
                for first in range(0, rule.num_experts, count)]
    return out


def chunk_of(key: str) -> tuple[str, int, int] | None:
    """(the MindFormers key, first expert, stop) of a chunk's key, or None for a real key."""
    match = _CHUNK_KEY.fullmatch(key)
    return None if match is None else (match.group(1), int(match.group(2)), int(match.group(3)))


def chunked_reads(source: MindFormersCheckpoint, num_experts: int):
    """A ``Fetch`` of a MindFormers checkpoint that reads a chunk's experts only (each input into a buffer kept from
    rule to rule, as ``convert_core.reused_reads``); a key of a whole tensor reads the tensor."""

    def read(key: str, buffer: ReusedBuffer) -> torch.Tensor:
        chunk = chunk_of(key)
        if chunk is None:
            return source.tensor(key, buffer=buffer)
        name, first, stop = chunk
        pieces = source.pieces[source.master(name)]
        if len(pieces) != 1 or pieces[0].info.shape != source.entries[source.master(name)].shape:
            raise CheckpointError(f"{source.directory}: {name!r} is stored in slices; its experts cannot be read "
                                  "a chunk at a time")
        info, file = pieces[0].info, pieces[0].file
        rows = info.shape[0] // num_experts  # 1 in the [E, H, 2i] layout, H in graph mode's [E*H, 2i]
        per_row = info.nbytes // info.shape[0]
        shape = ((stop - first) * rows, *info.shape[1:])
        target = buffer.view(shape, DTYPES[info.dtype])
        with open(file, "rb", buffering=0) as handle:
            handle.seek(info.offset + first * rows * per_row)
            read_into(handle, file, f"{name} experts {first}..{stop - 1}", target)
        return target

    return reused_buffer_reads(read)


def joined_chunks(outputs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor | RowBlocks]]:
    """The outputs of a chunked inverse plan with the chunks of one MindFormers tensor joined into one item: its
    row blocks, each pulled from ``outputs`` when the writer asks for it (so one chunk is in memory at a time)."""
    items = iter(outputs)
    pending = next(items, None)
    while pending is not None:
        key, tensor = pending
        chunk = chunk_of(key)
        if chunk is None:
            yield key, tensor
            pending = next(items, None)
            continue
        name = chunk[0]
        following: list = []

        def blocks(first=tensor) -> Iterator[torch.Tensor]:
            yield first
            for item in items:
                more = chunk_of(item[0])
                if more is None or more[0] != name:
                    following.append(item)
                    return
                yield item[1]

        produced = RowBlocks(blocks())
        yield name, produced
        for _ in produced:  # what the consumer left unread is passed over, up to the next tensor
            pass
        pending = following[0] if following else None  # the blocks ran to the end of the outputs otherwise
