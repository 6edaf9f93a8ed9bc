"""The one merge path of sharded Megatron checkpoints (``sides/megatron/merge.py``): every check names the shard.

Each checkpoint is written by the converter and then altered with ``torch.save``, as a broken
or foreign converter would leave it; both readers (in memory, and mg2ms streaming) must refuse
it, and mg2ms must leave nothing behind.
"""

from pathlib import Path

import pytest
import torch

from crossalign.checkpoint.convert import convert_checkpoint
from crossalign.config import load_config
from crossalign.models.layout import random_mindformers_state
from crossalign.sides.megatron.checkpoint import open_megatron, read_megatron_checkpoint, read_rank_states
from crossalign.sides.megatron.merge import merge_rank_states
from crossalign.sides.mindformers.checkpoint import default_common, write_mindformers_checkpoint
from crossalign.tensorio.errors import CheckpointError

MOE = load_config("qwen35_moe_tiny").model  # 4 experts, 4 layers, MTP


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("ms")
    write_mindformers_checkpoint(root, 4, random_mindformers_state(MOE, seed=5), None, default_common(4, 4))
    return root


def _converted(tmp_path: Path, source: Path, **layout) -> Path:
    out = tmp_path / "mg"
    convert_checkpoint(MOE, "ms2mg", source, out, **layout)
    return out


def _alter(out: Path, folder: str, change) -> None:
    file = out / "iter_0000004" / folder / "model_optim_rng.pt"
    checkpoint = torch.load(file, weights_only=True)
    change(checkpoint["model"])
    torch.save(checkpoint, file)


def _both_refuse(tmp_path: Path, out: Path, pattern: str) -> None:
    with pytest.raises(CheckpointError, match=pattern):
        read_megatron_checkpoint(out, MOE)
    with pytest.raises(CheckpointError, match=pattern):
        convert_checkpoint(MOE, "mg2ms", out, tmp_path / "back")
    assert not (tmp_path / "back").exists()


def _bump(key: str):
    def change(model: dict) -> None:
        model[key].view(-1)[0] += 1
    return change


def test_a_replicated_tensor_that_differs_between_tensor_ranks_is_named(tmp_path, source):
    out = _converted(tmp_path, source, tp=2)
    _alter(out, "mp_rank_01", _bump("decoder.layers.0.self_attention.out_norm.weight"))
    _both_refuse(tmp_path, out, r"mp_rank_01.*replicated tensor 'decoder.layers.0.self_attention.out_norm.weight' "
                                r"differs between tensor-parallel ranks 0 and 1")


def test_an_embedding_copy_that_differs_between_pipeline_stages_is_named(tmp_path, source):
    out = _converted(tmp_path, source, pp=2)
    _alter(out, "mp_rank_00_001", _bump("embedding.word_embeddings.weight"))
    _both_refuse(tmp_path, out, r"mp_rank_00_001.*'embedding.word_embeddings.weight' differs between pipeline stages")


def test_an_expert_copy_beyond_the_expert_tensor_group_that_differs_is_named(tmp_path, source):
    out = _converted(tmp_path, source, tp=2, ep=2, etp=1)
    _alter(out, "mp_rank_01_001", _bump("decoder.layers.1.mlp.experts.linear_fc2.weight0"))
    _both_refuse(tmp_path, out, r"mp_rank_01_001.*'decoder.layers.1.mlp.experts.linear_fc2.weight0' differs between "
                                r"tensor ranks 0 and 1 of EP rank 1")


def test_a_rank_that_holds_other_keys_is_named(tmp_path, source):
    out = _converted(tmp_path, source, ep=2)
    _alter(out, "mp_rank_00_001", lambda model: model.pop("decoder.layers.2.mlp.router.weight"))
    _both_refuse(tmp_path, out, r"mp_rank_00_001.*pipeline stage 0: ranks \(tp, ep\) \(0, 0\) and \(0, 1\) hold "
                                r"different keys: \['decoder.layers.2.mlp.router.weight'\]")


def test_an_expert_held_by_two_ranks_is_named(tmp_path, source):
    """Local expert 2 of EP rank 0 is global expert 2, which EP rank 1 holds as its local 0."""
    out = _converted(tmp_path, source, ep=2)
    fc1 = "decoder.layers.1.mlp.experts.linear_fc1.weight"
    for folder in ("mp_rank_00_000", "mp_rank_00_001"):
        _alter(out, folder, lambda model: model.__setitem__(f"{fc1}2", model[f"{fc1}1"].clone()))
    _both_refuse(tmp_path, out, rf"mp_rank_00_000.*'{fc1}2' is expert '{fc1}2', which another rank holds too")


def test_a_tensor_shard_of_another_shape_is_named(tmp_path, source):
    out = _converted(tmp_path, source, tp=2)
    key = "decoder.layers.3.self_attention.linear_proj.weight"
    _alter(out, "mp_rank_01", lambda model: model.__setitem__(key, model[key][:, :-1].clone()))
    _both_refuse(tmp_path, out, rf"mp_rank_01.*'{key}' has shape \[64, \d+\], tensor rank 0's")


def test_a_missing_tensor_rank_is_named(tmp_path, source):
    out = _converted(tmp_path, source, tp=2, pp=2)
    (out / "iter_0000004" / "mp_rank_01_001" / "model_optim_rng.pt").unlink()
    (out / "iter_0000004" / "mp_rank_01_001").rmdir()
    _both_refuse(tmp_path, out, r"\(tp, pp, ep\) \[\(1, 1, 0\)\] are missing")


def test_rank_states_in_memory_merge_by_the_same_plan_as_the_files(tmp_path, source):
    out = _converted(tmp_path, source, tp=2, pp=2, ep=2)
    directory = out / "iter_0000004"
    from_files = read_megatron_checkpoint(out, MOE).state
    in_memory = merge_rank_states(read_rank_states(directory), MOE)
    assert list(in_memory) == list(from_files)
    assert all(torch.equal(in_memory[key], from_files[key]) for key in from_files)
    with pytest.raises(CheckpointError, match="merging tp=2 ep=2 shards needs the model config"):
        merge_rank_states(read_rank_states(directory), None)


def test_the_streamed_model_reads_each_tensor_into_the_callers_buffer(tmp_path, source):
    from crossalign.tensorio.blocks import ReusedBuffer

    out = _converted(tmp_path, source, tp=2, pp=2, ep=2)
    full = read_megatron_checkpoint(out, MOE).state
    buffer = ReusedBuffer()
    buffer.view((2**22,), torch.uint8)  # larger than any tensor here: it never moves
    with open_megatron(out, MOE) as merged:
        assert (merged.tp, merged.pp, merged.ep) == (2, 2, 2)
        assert merged.shapes == {key: tuple(tensor.shape) for key, tensor in full.items()}
        for key, tensor in full.items():
            read = merged.tensor(key, buffer)
            assert read.data_ptr() == buffer.view((1,), torch.uint8).data_ptr() or read.numel() == 0
            assert torch.equal(read, tensor), key
        merged.check_replicas()


def test_mg2ms_writes_mindformers_token_counts_as_zeros_and_says_why(tmp_path, source):
    """MindFormers saves mlp.tokens_per_expert (a Parameter); Megatron does not save its counts (a non-persistent
    buffer): a round trip gives MindFormers' fresh zeros, and both legs say what they did."""
    from crossalign.models.layout import mindformers_buffers
    from crossalign.sides.mindformers.checkpoint import read_mindformers_checkpoint

    counted = tmp_path / "counted"
    state = random_mindformers_state(MOE, seed=5)
    counts = {name: torch.arange(shape[0], dtype=torch.float32) + 1 for name, shape in mindformers_buffers(MOE).items()}
    write_mindformers_checkpoint(counted, 4, {**state, **counts}, None, default_common(4, 4))
    there = convert_checkpoint(MOE, "ms2mg", counted, tmp_path / "mg", ep=2)
    assert any(f"left out {len(counts)} buffer(s)" in note for note in there.notes)
    back = convert_checkpoint(MOE, "mg2ms", tmp_path / "mg", tmp_path / "back")
    assert any(f"added {len(counts)} buffer(s) mlp.tokens_per_expert as zeros" in note for note in back.notes)
    written = read_mindformers_checkpoint(tmp_path / "back")
    assert set(written.buffer_entries()) == set(counts) and len(counts) == 5  # 4 MoE layers and the MTP layer's
    for name in counts:
        assert torch.equal(written.tensor(name), torch.zeros(MOE.num_experts))
