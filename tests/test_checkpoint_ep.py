"""Megatron legacy checkpoints at expert-parallel layouts: Megatron's folder names, local expert ids, read back."""

from pathlib import Path

import pytest
import torch

from crossalign.checkpoint.convert import convert_checkpoint, mindformers_to_megatron
from crossalign.tensorio.errors import CheckpointError
from crossalign.models.layout import random_mindformers_state
from crossalign.sides.megatron.checkpoint import read_megatron_checkpoint, rank_dir_name
from crossalign.sides.mindformers.checkpoint import default_common, read_mindformers_checkpoint, write_mindformers_checkpoint
from crossalign.config import load_config

MOE = load_config("qwen35_moe_tiny").model  # 4 experts, 4 layers (3 GDN + 1 attention), MTP
DENSE = load_config("qwen35_dense_tiny").model
FC1 = "decoder.layers.1.mlp.experts.linear_fc1.weight"
FC2 = "decoder.layers.1.mlp.experts.linear_fc2.weight"


@pytest.fixture(scope="module")
def moe_state():
    return random_mindformers_state(MOE, seed=21)


@pytest.fixture(scope="module")
def source(tmp_path_factory, moe_state):
    root = tmp_path_factory.mktemp("ms")
    write_mindformers_checkpoint(root, 4, moe_state, None, default_common(4, 4))
    return root


def _shard(root: Path, folder: str) -> dict:
    return torch.load(root / "iter_0000004" / folder / "model_optim_rng.pt", weights_only=True)["model"]


def test_folder_names_follow_megatron_get_checkpoint_name():
    # core_v0.16.1 megatron/training/checkpointing.py:191-199
    assert rank_dir_name(1, 0, 1) == "mp_rank_01"
    assert rank_dir_name(1, 2, 4) == "mp_rank_01_002"
    assert rank_dir_name(1, 0, 1, 3, 4) == "mp_rank_01_003"
    assert rank_dir_name(0, 1, 2, 3, 4) == "mp_rank_00_001_003"


@pytest.mark.parametrize(("tp", "pp", "ep", "etp", "experts"), [
    (1, 1, 2, None, "per_expert"), (1, 1, 4, None, "stacked"), (2, 1, 2, None, "per_expert"),
    (2, 2, 2, 1, "per_expert"), (1, 2, 2, None, "stacked"), (2, 1, 2, 1, "stacked"),
])
def test_expert_parallel_layouts_write_and_read_back_bit_identically(tmp_path, source, moe_state, tp, pp, ep, etp,
                                                                     experts):
    out = tmp_path / "mg"
    report = convert_checkpoint(MOE, "ms2mg", source, out, tp=tp, pp=pp, ep=ep, etp=etp, experts=experts)
    folders = sorted(p.name for p in (out / "iter_0000004").iterdir())
    assert folders == sorted(rank_dir_name(t, p, pp, e, ep) for t in range(tp) for p in range(pp) for e in range(ep))
    assert len(report.files) == tp * pp * ep and report.ep == ep
    merged = read_megatron_checkpoint(out, MOE)
    assert (merged.tp, merged.pp, merged.ep) == (tp, pp, ep)
    full = mindformers_to_megatron(moe_state, MOE, experts=experts)
    assert merged.state.keys() == full.keys()
    assert all(torch.equal(merged.state[k], full[k]) for k in full)
    back = convert_checkpoint(MOE, "mg2ms", out, tmp_path / "ms")
    assert back.keys_out == len(moe_state)
    again = read_mindformers_checkpoint(tmp_path / "ms")
    assert all(torch.equal(again.tensor(k), moe_state[k]) for k in moe_state)


def test_experts_carry_local_ids_on_their_ep_rank(tmp_path, source, moe_state):
    out = tmp_path / "mg"
    convert_checkpoint(MOE, "ms2mg", source, out, tp=2, ep=2)
    full = mindformers_to_megatron(moe_state, MOE)
    local = MOE.num_experts // 2
    i = MOE.moe_ffn_hidden_size
    for t in range(2):
        for e in range(2):
            shard = _shard(out, f"mp_rank_{t:02d}_{e:03d}")
            experts = sorted(k for k in shard if k.startswith(FC1))
            assert experts == [f"{FC1}{j}" for j in range(local)]  # local ids 0..E/EP-1 on every EP rank
            for j in range(local):
                g = e * local + j  # global expert e * E/EP + j
                gate, up = full[f"{FC1}{g}"].chunk(2)
                assert torch.equal(shard[f"{FC1}{j}"], torch.cat([gate.chunk(2)[t], up.chunk(2)[t]]))
                assert torch.equal(shard[f"{FC2}{j}"], full[f"{FC2}{g}"][:, t * i // 2:(t + 1) * i // 2])
            # Everything else is the tensor rank's shard, the same on every EP rank.
            router = "decoder.layers.1.mlp.router.weight"
            assert torch.equal(shard[router], full[router])
            assert "decoder.final_layernorm.weight" in shard


def test_expert_tensor_parallel_one_keeps_whole_experts_on_every_tensor_rank(tmp_path, source, moe_state):
    out = tmp_path / "mg"
    convert_checkpoint(MOE, "ms2mg", source, out, tp=2, ep=2, etp=1, experts="stacked")
    full = mindformers_to_megatron(moe_state, MOE, experts="stacked")
    for t in range(2):
        shard = _shard(out, f"mp_rank_{t:02d}_001")
        assert torch.equal(shard[FC1], full[FC1][2:])
        attention = "decoder.layers.3.self_attention.linear_proj.weight"
        assert torch.equal(shard[attention], full[attention].chunk(2, dim=1)[t])


def test_pipeline_and_expert_ranks_are_told_apart_by_their_contents(tmp_path, source):
    convert_checkpoint(MOE, "ms2mg", source, tmp_path / "pp", pp=2)
    convert_checkpoint(MOE, "ms2mg", source, tmp_path / "ep", ep=2)
    names = sorted(p.name for p in (tmp_path / "pp" / "iter_0000004").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "ep" / "iter_0000004").iterdir()) == ["mp_rank_00_000",
                                                                                            "mp_rank_00_001"]
    pp, ep = read_megatron_checkpoint(tmp_path / "pp", MOE), read_megatron_checkpoint(tmp_path / "ep", MOE)
    assert (pp.pp, pp.ep, ep.pp, ep.ep) == (2, 1, 1, 2)
    assert pp.state.keys() == ep.state.keys()


def test_bad_expert_layouts_are_named(tmp_path, source):
    with pytest.raises(CheckpointError, match="expert parallel size 3 does not divide model.num_experts = 4"):
        convert_checkpoint(MOE, "ms2mg", source, tmp_path / "a", ep=3)
    with pytest.raises(CheckpointError, match="expert tensor parallel size 2 does not divide tensor parallel size 1"):
        convert_checkpoint(MOE, "ms2mg", source, tmp_path / "b", etp=2)
    with pytest.raises(CheckpointError, match="need an MoE model"):
        convert_checkpoint(DENSE, "ms2mg", source, tmp_path / "c", ep=2)
    with pytest.raises(CheckpointError, match="--ep"):
        convert_checkpoint(MOE, "mg2ms", source, tmp_path / "d", ep=2)
    assert not any((tmp_path / name).exists() for name in "abcd")


def test_a_missing_expert_rank_is_named(tmp_path, source):
    out = tmp_path / "mg"
    convert_checkpoint(MOE, "ms2mg", source, out, pp=2, ep=2)
    for file in (out / "iter_0000004" / "mp_rank_00_001_001").iterdir():
        file.unlink()
    (out / "iter_0000004" / "mp_rank_00_001_001").rmdir()
    with pytest.raises(CheckpointError, match=r"\(tp, pp, ep\) \[\(0, 1, 1\)\] are missing"):
        read_megatron_checkpoint(out, MOE)


def test_diagnose_reads_a_sharded_checkpoint_and_finds_no_divergence(tmp_path, source):
    from crossalign.diagnose.run import diagnose

    convert_checkpoint(MOE, "ms2mg", source, tmp_path / "mg", tp=2, pp=2, ep=2)
    result = diagnose(load_config("qwen35_moe_tiny"), source, tmp_path / "mg", tmp_path / "out", seq=32, batch=1,
                      save_tensors=False)
    assert not result.diagnosis.diverged, result.diagnosis.hint()


def test_an_ep_rank_whose_replicated_tensors_differ_is_named(tmp_path, source):
    out = tmp_path / "mg"
    convert_checkpoint(MOE, "ms2mg", source, out, ep=2)
    file = out / "iter_0000004" / "mp_rank_00_001" / "model_optim_rng.pt"
    checkpoint = torch.load(file, weights_only=True)
    checkpoint["model"]["decoder.layers.2.mlp.router.weight"][0, 0] += 1
    torch.save(checkpoint, file)
    with pytest.raises(CheckpointError, match=r"mp_rank_00_001.*'decoder.layers.2.mlp.router.weight' differs from "
                                              "expert-parallel rank 0's"):
        read_megatron_checkpoint(out, MOE)
    with pytest.raises(CheckpointError, match=r"mp_rank_00_001.*'decoder.layers.2.mlp.router.weight' differs from "
                                              "expert-parallel rank 0's"):  # mg2ms reads the ranks as it goes
        convert_checkpoint(MOE, "mg2ms", out, tmp_path / "ms")
    assert not (tmp_path / "ms").exists()


def test_mg2ms_reads_tensors_saved_as_views_of_shared_storage(tmp_path, moe_state):
    """Megatron may save a tensor that is a view: at an offset in a storage it shares, or with strides."""
    full = mindformers_to_megatron(moe_state, MOE)
    keys = list(full)
    flat = torch.cat([full[k].reshape(-1) for k in keys])  # one storage under every tensor
    model, start = {}, 0
    for key in keys:
        model[key] = flat[start:start + full[key].numel()].view(full[key].shape)
        start += full[key].numel()
    strided = "decoder.layers.0.self_attention.out_proj.weight"
    model[strided] = full[strided].t().contiguous().t()  # the same values, column-major
    assert model[keys[1]].storage_offset() > 0 and not model[strided].is_contiguous()
    folder = tmp_path / "mg" / "iter_0000007" / "mp_rank_00"
    folder.mkdir(parents=True)
    torch.save({"checkpoint_version": 3.0, "iteration": 7, "model": model}, folder / "model_optim_rng.pt")
    (tmp_path / "mg" / "latest_checkpointed_iteration.txt").write_text("7")
    convert_checkpoint(MOE, "mg2ms", tmp_path / "mg", tmp_path / "ms")
    back = read_mindformers_checkpoint(tmp_path / "ms")
    assert back.iteration == 7 and all(torch.equal(back.tensor(k), moe_state[k]) for k in moe_state)


def test_cli_writes_an_expert_parallel_layout(tmp_path, source):
    from typer.testing import CliRunner

    from crossalign.cli import app

    result = CliRunner().invoke(app, ["convert", "--model", "qwen35_moe_tiny", "--direction", "ms2mg", "--input",
                                      str(source), "--output", str(tmp_path / "mg"), "--ep", "2", "--tp", "2",
                                      "--etp", "1"])
    assert result.exit_code == 0, result.output
    assert "torch tp=2 pp=1 ep=2" in result.output
    assert read_megatron_checkpoint(tmp_path / "mg", MOE).ep == 2
    bad = CliRunner().invoke(app, ["convert", "--model", "qwen35_moe_tiny", "--direction", "ms2mg", "--input",
                                   str(source), "--output", str(tmp_path / "x"), "--ep", "3"])
    assert bad.exit_code == 2 and "expert parallel size 3" in bad.output
