"""mg2ms ``--tp 2`` streams into the rank files: the same bytes as the model gathered and saved by the in-memory writer.

The reference is ``write_mindformers_checkpoint(..., world=2, split_dim=mindformers_split_dim)``
of the whole converted model (``convert_state``, plus the buffers MindFormers saves): every file
of the iteration folder (rank files, metadata.json, common.json) must be byte-identical. The
routed experts of the MoE model also go through the chunked path (``expert_chunks.py``) with
chunks of 1 and 3 of its 4 experts, so that a chunk straddles the boundary between the ranks'
experts (the expert axis is the one MindFormers' ranks split them on).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from crossalign.checkpoint import expert_chunks
from crossalign.checkpoint.convert import convert_checkpoint, convert_state
from crossalign.checkpoint.convert_core import cast, fresh_buffers
from crossalign.config import load_config
from crossalign.models.layout import random_mindformers_state
from crossalign.sides.megatron.checkpoint import read_megatron_checkpoint
from crossalign.sides.megatron.sharding import mindformers_split_dim
from crossalign.sides.mindformers.checkpoint import (
    default_common,
    iteration_dir_name,
    read_mindformers_checkpoint,
    stream_mindformers_checkpoint,
    write_mindformers_checkpoint,
)
from crossalign.tensorio.blocks import RowBlocks
from crossalign.tensorio.errors import CheckpointError
from crossalign.tensorio.torch_file import TensorSpec

DENSE = load_config("qwen35_dense_tiny").model
MOE = load_config("qwen35_moe_tiny").model
ITERATION = 6


def _megatron_source(root: Path, model, **layout) -> Path:
    ms = root / "ms"
    write_mindformers_checkpoint(ms, ITERATION, random_mindformers_state(model, seed=5), None,
                                 default_common(ITERATION, 2))
    convert_checkpoint(model, "ms2mg", ms, root / "mg", **layout)
    return root / "mg"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_stream")
    return {"dense": (DENSE, _megatron_source(root / "dense", DENSE, tp=2, pp=2)),
            "moe": (MOE, _megatron_source(root / "moe", MOE, tp=2, pp=2, ep=2))}


def _in_memory(source: Path, model, out: Path, dtype: str, tp: int) -> Path:
    """The reference: the whole model converted in memory (cast as it is read), saved by the in-memory writer as
    ``tp`` ranks."""
    megatron = read_megatron_checkpoint(source, model)
    state = convert_state({key: cast(tensor, dtype) for key, tensor in megatron.state.items()}, model, "mg2ms")
    state.update(fresh_buffers(model)[0])
    return write_mindformers_checkpoint(out, megatron.iteration, state, None, default_common(megatron.iteration, 2),
                                        world=tp, split_dim=mindformers_split_dim)


def _files(folder: Path) -> dict[str, bytes]:
    return {file.name: file.read_bytes() for file in sorted(folder.iterdir())}


@pytest.mark.parametrize("name,dtype", [("dense", "fp32"), ("moe", "fp32"), ("moe", "bf16")])
def test_mg2ms_tp2_streams_the_bytes_of_the_in_memory_writer(tmp_path, sources, name, dtype):
    model, source = sources[name]
    report = convert_checkpoint(model, "mg2ms", source, tmp_path / "stream", tp=2, dtype=dtype, global_batch_size=2)
    streamed = _files(tmp_path / "stream" / iteration_dir_name(ITERATION))
    expected = _files(_in_memory(source, model, tmp_path / "memory", dtype, 2))
    assert sorted(streamed) == ["common.json", "metadata.json", "qwen35-model-0000000-0000002.safetensors",
                                "qwen35-model-0000001-0000002.safetensors"]
    assert streamed == expected
    assert [file.name for file in report.files] == sorted(streamed)[2:]


@pytest.mark.parametrize("experts_per_chunk", [1, 3])
def test_mg2ms_tp2_cuts_chunked_experts_at_the_rank_boundary(tmp_path, sources, monkeypatch, experts_per_chunk):
    """Chunks of 3 of the 4 experts: the first chunk holds rank 0's two experts and rank 1's first."""
    model, source = sources["moe"]
    expected = _files(_in_memory(source, model, tmp_path / "memory", "keep", 2))
    whole = read_mindformers_checkpoint(tmp_path / "memory").entries["decoder.layers.0.mlp.experts.weight1"]
    monkeypatch.setattr(expert_chunks, "CHUNK_BYTES", experts_per_chunk * whole.nbytes // model.num_experts)
    convert_checkpoint(model, "mg2ms", source, tmp_path / "stream", tp=2, dtype="keep", global_batch_size=2)
    assert _files(tmp_path / "stream" / iteration_dir_name(ITERATION)) == expected


def test_row_blocks_that_every_rank_holds_whole_are_refused(tmp_path):
    """Blocks come once: a tensor handed over in row blocks can go to several ranks only cut along its rows."""
    specs = {"decoder.layers.0.input_layernorm.weight": TensorSpec((4,), torch.float32)}  # whole on every rank
    blocks = RowBlocks(iter([torch.ones(2), torch.ones(2)]))
    with pytest.raises(CheckpointError, match="input_layernorm.weight.*only cut along its rows, not whole"):
        stream_mindformers_checkpoint(tmp_path / "out", 1, specs, [(next(iter(specs)), blocks)], default_common(1),
                                      world=2, split_dim=mindformers_split_dim)
    assert not (tmp_path / "out").exists()


def test_row_blocks_reach_each_rank_as_they_come(tmp_path):
    """Row blocks that share one buffer (each overwritten by the next), cut at the rank boundary and cast on the way,
    give the files of the whole tensors saved in memory; so do a tensor cut on its columns and one held whole."""
    torch.manual_seed(0)
    model = {"decoder.layers.0.mlp.experts.weight1": torch.randn(4, 3, 8),
             "decoder.layers.0.self_attention.linear_proj.weight": torch.randn(6, 4),
             "decoder.layers.0.input_layernorm.weight": torch.randn(6)}
    experts = model["decoder.layers.0.mlp.experts.weight1"]
    shared = torch.empty(3, 3, 8)

    def blocks():  # 3 + 1 experts: the first block holds rank 0's two and rank 1's first
        for start in (0, 3):
            block = shared[:min(3, 4 - start)]
            block.copy_(experts[start:start + 3])
            yield block

    def tensors():
        for name, tensor in model.items():
            yield name, RowBlocks(blocks()) if tensor is experts else tensor

    specs = {name: TensorSpec(tuple(tensor.shape), torch.bfloat16) for name, tensor in model.items()}
    streamed = stream_mindformers_checkpoint(tmp_path / "stream", 1, specs, tensors(), default_common(1), world=2,
                                             split_dim=mindformers_split_dim)
    expected = write_mindformers_checkpoint(tmp_path / "memory", 1, {k: v.bfloat16() for k, v in model.items()},
                                            None, default_common(1), world=2, split_dim=mindformers_split_dim)
    assert _files(streamed) == _files(expected)
    back = read_mindformers_checkpoint(tmp_path / "stream")
    assert torch.equal(back.tensor("decoder.layers.0.mlp.experts.weight1"), experts.bfloat16())
