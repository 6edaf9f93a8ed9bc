"""Cast a MindFormers checkpoint to bf16 (DAG step 2), whatever the model, one tensor at a time.

The output has the input's layout: the tracker and the ``iteration_%08d`` folder (or a bare
folder), every safetensors file with the same tensors in the same order and the same header
metadata, floating weights cast to bf16 and the others unchanged, and every other file of
the folder (common.json) copied as is. What is not a weight is carried over unchanged, as the
training run that loads the cast expects it: the optimizer files (fp32 Adam moments and the
step count, for a resume) are copied, and buffers (``mlp.tokens_per_expert``, token counts
kept in fp32) keep their dtype. A weight that MindFormers 2.1.0 keeps in bf16 beside an fp32 master
(``main_param.*`` in the optimizer file, see ``mindformers.py``) is already the master rounded to bf16:
casting the model file's copy gives the same bf16 tensor as casting the master. Ranks' files stay as they are and metadata.json is copied
with the dtype of each cast tensor updated, so MindFormers reads the slices right.
The cast streams: each output file's header is written from the input header, then each
tensor is read, cast, written and dropped, in row blocks, so memory holds at most one block (``BLOCK_BYTES``) at a time
whatever the checkpoint size. Every tensor is read into, and cast into,
the same two buffers (``blocks.py``): fresh memory per tensor would cost a page fault per page.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from crossalign.tensorio.atomic import atomic_directory, check_output_dir
from crossalign.tensorio.blocks import BlockCaster, ReusedBuffer, one_thread
from crossalign.tensorio.errors import CheckpointError
from crossalign.sides.mindformers.checkpoint import (
    METADATA,
    MINDSPORE_DTYPE_NAMES,
    TRACKER,
    is_buffer,
    is_optimizer_entry,
    read_mindformers_checkpoint,
)
from crossalign.tensorio.blocks import BLOCK_BYTES
from crossalign.tensorio.safetensors_io import FLOATING, SafetensorsWriter, TensorInfo, read_header, read_rows

Progress = Callable[[int, int, str], None]  # (tensors done, tensors in all, tensor name)


@dataclass
class CastReport:
    input_dir: Path
    output_dir: Path
    files: list[Path]
    tensors: int
    cast: int
    bytes_in: int
    bytes_out: int
    seconds: float
    buffers: int = 0  # buffers kept in their dtype
    optimizer_files: list[Path] = field(default_factory=list)  # copied unchanged


def _is_weight(file: Path, name: str) -> bool:
    return not is_buffer(name) and not is_optimizer_entry(file, name)


def _cast_file(source: Path, target: Path, reads: ReusedBuffer, caster: BlockCaster,
               progress: Callable[[str], None]) -> tuple[int, int, int, int, int]:
    infos, metadata = read_header(source)
    to_cast = {info.name for info in infos if info.dtype in FLOATING and _is_weight(source, info.name)}
    out_infos = [TensorInfo(info.name, "BF16" if info.name in to_cast else info.dtype, info.shape) for info in infos]
    cast = sum(info.name in to_cast and info.dtype != "BF16" for info in infos)
    with SafetensorsWriter(target, out_infos, metadata) as writer:
        for info in infos:
            blocks = read_rows(source, info, BLOCK_BYTES, reads)
            writer.write_blocks(info.name, caster.cast_blocks(blocks, torch.bfloat16)
                                if info.name in to_cast else blocks)
            progress(info.name)
    buffers = sum(is_buffer(info.name) for info in infos)
    return len(infos), cast, sum(i.nbytes for i in infos), sum(i.nbytes for i in out_infos), buffers


def _cast_metadata(source: Path, target: Path, cast: set[str]) -> None:
    """metadata.json with the dtype of every cast tensor now bf16, all else as it was."""
    metadata = json.loads(source.read_text())
    for name in cast:
        metadata["state_dict_metadata"][name]["properties"]["dtype"] = MINDSPORE_DTYPE_NAMES["BF16"]
    target.write_text(json.dumps(metadata, ensure_ascii=False, separators=(",", ":")))


def cast_bf16(input_dir: Path, output_dir: Path, progress: Progress | None = None) -> CastReport:
    """Write a bf16 copy of the checkpoint at ``input_dir`` into ``output_dir`` (new or empty); atomic."""
    input_dir, output_dir = Path(input_dir), Path(output_dir)
    check_output_dir(output_dir)
    start = time.perf_counter()
    checkpoint = read_mindformers_checkpoint(input_dir)  # checks the layout and every header first
    directory = checkpoint.directory
    extra = [p for p in sorted(directory.iterdir()) if p.suffix != ".safetensors"]
    folders = [p for p in extra if p.is_dir()]
    if folders:
        raise CheckpointError(f"{directory}: unexpected folder {folders[0].name} in a checkpoint folder")
    model_files = checkpoint.model_files
    optimizer_files = [file for file in checkpoint.files if file not in model_files]
    total = sum(len(read_header(file)[0]) for file in model_files)  # every rank's copy is cast
    done = 0
    counts = [0, 0, 0, 0, 0]

    def advance(name: str) -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, total, name)

    reads, caster = ReusedBuffer(), BlockCaster(BLOCK_BYTES)  # one block of memory each for the whole checkpoint
    with atomic_directory(output_dir) as staging, one_thread():
        target_dir = staging
        if checkpoint.tracker_root is not None:
            shutil.copy2(checkpoint.tracker_root / TRACKER, staging / TRACKER)
            target_dir = staging / directory.name
            target_dir.mkdir()
        for file in model_files:
            for i, value in enumerate(_cast_file(file, target_dir / file.name, reads, caster, advance)):
                counts[i] += value
        for file in optimizer_files:
            shutil.copy2(file, target_dir / file.name)
        for file in extra:
            if file.name == METADATA:
                _cast_metadata(file, target_dir / file.name,
                               {name for name, info in checkpoint.entries.items() if info.dtype in FLOATING
                                and _is_weight(checkpoint.pieces[name][0].file, name)})
            else:
                shutil.copy2(file, target_dir / file.name)
    relative = target_dir.relative_to(staging)
    return CastReport(input_dir=input_dir, output_dir=output_dir,
                      files=[output_dir / relative / file.name for file in model_files],
                      tensors=counts[0], cast=counts[1], bytes_in=counts[2], bytes_out=counts[3],
                      seconds=time.perf_counter() - start, buffers=counts[4],
                      optimizer_files=[output_dir / relative / file.name for file in optimizer_files])
