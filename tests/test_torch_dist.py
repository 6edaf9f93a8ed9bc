"""Megatron torch_dist checkpoints, proved against megatron-core 0.16.1's own dist_checkpointing.

crossalign writes a torch_dist checkpoint (ms2mg --format torch_dist) for one layout, and
megatron-core loads it into its GPTModel built at other layouts (TP 2, PP 2, EP 2: two gloo
processes on the CPU), where every parameter must equal, bit for bit, the shard that
crossalign's legacy layout rules give that rank. megatron-core then saves from that layout, and mg2ms turns its
checkpoint back into the MindSpore source, bf16 bit for bit.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from crossalign.checkpoint.convert import convert_checkpoint
from crossalign.tensorio.errors import CheckpointError
from crossalign.models.layout import random_mindformers_state
from crossalign.sides.megatron.checkpoint import read_megatron_checkpoint
from crossalign.sides.mindformers.checkpoint import default_common, read_mindformers_checkpoint, write_mindformers_checkpoint
from crossalign.config import load_config

CONFIG = load_config("qwen35_moe_tiny")
MOE = CONFIG.model
CORE = CONFIG.training.megatron_core_version


@pytest.fixture(scope="module")
def bf16_source(tmp_path_factory):
    state = {key: value.bfloat16() for key, value in random_mindformers_state(MOE, seed=31).items()}
    # Norm gammas that are not all 1, so that a norm put in the wrong place shows.
    for key in state:
        if key.endswith("norm.weight"):
            state[key] = (1 + 0.1 * torch.randn(state[key].shape)).bfloat16()
    root = tmp_path_factory.mktemp("ms")
    write_mindformers_checkpoint(root, 4, state, None, default_common(4, 4))
    return root, state


@pytest.fixture(scope="module")
def torch_dist(tmp_path_factory, bf16_source):
    out = tmp_path_factory.mktemp("td") / "mg"
    report = convert_checkpoint(MOE, "ms2mg", bf16_source[0], out, dtype="bf16", ckpt_format="torch_dist")
    return out, report


def _same_as_source(folder: Path, state: dict) -> list[str]:
    back = read_mindformers_checkpoint(folder)
    return [key for key in state if back.tensor(key).dtype != state[key].dtype
            or not torch.equal(back.tensor(key), state[key])]


def test_torch_dist_is_megatron_cores_format_under_the_gpu_runs_keys(torch_dist):
    out, report = torch_dist
    folder = out / "iter_0000004"
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert json.loads((folder / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert report.format == "torch_dist" and report.files and all(f.suffix == ".distcp" for f in report.files)
    held = "--format torch_dist holds the whole model in memory (.*): about 0.5 GB for this 0.0 GB model"
    assert any(re.match(held + ".*legacy --format torch streams", note) for note in report.notes)
    from torch.distributed.checkpoint import FileSystemReader

    keys = set(FileSystemReader(str(folder)).read_metadata().state_dict_metadata)
    # TE's fused-norm names (a GPU run's), GDN's in_proj by parts, experts as one [E, ...] tensor per layer.
    assert "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight" in keys
    assert "decoder.layers.0.self_attention.in_proj.layer_norm_weight" in keys
    assert "decoder.layers.0.input_layernorm.weight" not in keys
    assert {f"decoder.layers.0.self_attention.in_proj.weight.{p}" for p in ("query", "key", "value", "z", "beta",
                                                                             "alpha")} <= keys
    assert "decoder.layers.0.mlp.experts.experts.linear_fc1.weight" in keys


def test_torch_dist_reads_back_to_the_source_bit_for_bit(tmp_path, torch_dist, bf16_source):
    out, _ = torch_dist
    checkpoint = read_megatron_checkpoint(out, MOE, CORE)
    assert checkpoint.format == "torch_dist" and checkpoint.iteration == 4
    report = convert_checkpoint(MOE, "mg2ms", out, tmp_path / "ms", dtype="bf16")
    assert report.format == "torch_dist"
    assert _same_as_source(tmp_path / "ms", bf16_source[1]) == []


def test_torch_dist_takes_no_layout_and_bad_folders_are_named(tmp_path, bf16_source):
    with pytest.raises(CheckpointError, match="Megatron reshards a torch_dist checkpoint"):
        convert_checkpoint(MOE, "ms2mg", bf16_source[0], tmp_path / "a", tp=2, ckpt_format="torch_dist")
    with pytest.raises(CheckpointError, match="format 'zarr'"):
        convert_checkpoint(MOE, "ms2mg", bf16_source[0], tmp_path / "b", ckpt_format="zarr")
    folder = tmp_path / "c" / "iter_0000001"
    folder.mkdir(parents=True)
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    with pytest.raises(CheckpointError, match="sharded_backend 'zarr'"):
        read_megatron_checkpoint(folder, MOE)
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    with pytest.raises(CheckpointError, match="cannot read the torch_dist index"):
        read_megatron_checkpoint(folder, MOE)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


LAYOUTS = {"tp2": {"tensor": 2, "expert_tensor": 2}, "pp2": {"pipeline": 2, "expert_tensor": 1},
           "ep2": {"expert": 2, "expert_tensor": 1}}


def _load_and_save(rank: int, world: int, folder: str, source: str, checkpoint: str) -> None:
    """One rank: for each layout, megatron-core loads crossalign's torch_dist, checks it, and saves it again.

    The layouts run in the same two processes (one gloo group after the other), so that
    importing megatron-core is paid once.
    """
    from crossalign.sides.megatron.embedded.mcore_cpu import CudaLiteralsToCpu, ProcessGroup, megatron_core_on_cpu
    from crossalign.sides.megatron.embedded.mcore_model import Shard, build_gpt_model, load_converted_state
    from crossalign.checkpoint.convert import mindformers_to_megatron
    from crossalign.sides.megatron.torch_dist import load_sharded, save_sharded
    from crossalign.config import MegatronParallel

    state = read_mindformers_checkpoint(Path(source))
    full = mindformers_to_megatron({key: state.tensor(key) for key in state.model_entries()}, MOE, CORE)
    for name, sizes in LAYOUTS.items():
        layout = MegatronParallel(**sizes, cards_per_node=world)
        with megatron_core_on_cpu(1, ProcessGroup(rank, world, f"file://{folder}/rendezvous-{name}", **sizes)):
            with CudaLiteralsToCpu():  # the pipeline's stages share the MTP embedding with .cuda()
                loaded = build_gpt_model(MOE, CONFIG.training, bf16=True, layout=layout).to(torch.bfloat16)
                expected = build_gpt_model(MOE, CONFIG.training, bf16=True, layout=layout).to(torch.bfloat16)
            load_sharded(loaded, Path(checkpoint), MOE, CORE)
            load_converted_state(expected, full, MOE, CORE, Shard.of_this_process(layout))
            got, want = loaded.state_dict(), expected.state_dict()
            differ = [key for key in want if not key.endswith("_extra_state") and not torch.equal(got[key], want[key])]
            if differ:
                raise AssertionError(f"{name} rank {rank}: megatron-core loaded {differ[:5]} differently from "
                                     "crossalign's legacy shards")
            save_sharded(loaded, Path(folder) / name / "iter_0000004", MOE, CORE)


@pytest.mark.slow
def test_megatron_core_loads_it_at_other_layouts_and_its_own_saves_convert_back(tmp_path, torch_dist, bf16_source):
    """Written at TP 1 / PP 1 / EP 1; loaded at TP 2, PP 2 and EP 2, each in two processes; saved there by
    megatron-core."""
    out, _ = torch_dist
    for name in LAYOUTS:
        (tmp_path / name / "iter_0000004").mkdir(parents=True)
        (tmp_path / name / "latest_checkpointed_iteration.txt").write_text("4")
    mp.spawn(_load_and_save, nprocs=2, join=True,
             args=(2, str(tmp_path), str(bf16_source[0]), str(out / "iter_0000004")))
    for name in LAYOUTS:
        convert_checkpoint(MOE, "mg2ms", tmp_path / name, tmp_path / f"ms-{name}", dtype="bf16")
        assert _same_as_source(tmp_path / f"ms-{name}", bf16_source[1]) == [], name


def test_diagnose_reads_a_torch_dist_checkpoint(tmp_path, torch_dist, bf16_source):
    from crossalign.diagnose.run import diagnose

    result = diagnose(CONFIG, bf16_source[0], torch_dist[0], tmp_path / "out", seq=32, batch=1, save_tensors=False)
    assert not result.diagnosis.diverged, result.diagnosis.hint()
