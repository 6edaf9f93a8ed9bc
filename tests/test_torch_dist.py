"""Megatron torch_dist checkpoints: crossalign's streaming writer and chunked reader, proved by megatron-core itself.

crossalign writes a torch_dist checkpoint without the model (ms2mg --format torch_dist,
``torch_dist_write.py``). megatron-core 0.16.1 and 0.17.0 (each its own ``dist_checkpointing``)
load it strictly into GPTModel at TP 1 and at TP 2 x PP 2 x EP 2, where every parameter must
equal, bit for bit, the shard that crossalign's legacy layout rules give that rank; what they
save from those layouts converts back to the bf16 MindSpore source bit for bit, and their save
at TP 1 is the oracle of the writer: the same keys, global shapes, dtypes, chunks and data.
Bad folders are refused before anything is written, naming the file and the key.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from crossalign.checkpoint.convert import convert_checkpoint, convert_part, finish_parts
from crossalign.config import load_config
from crossalign.models.layout import random_mindformers_state
from crossalign.sides.megatron.checkpoint import read_megatron_checkpoint
from crossalign.sides.mindformers.checkpoint import (default_common, read_mindformers_checkpoint,
                                                     write_mindformers_checkpoint)
from crossalign.tensorio.errors import CheckpointError

CONFIG = load_config("qwen35_moe_tiny")
MOE = CONFIG.model
CORE = CONFIG.training.megatron_core_version
ROOT = Path(__file__).resolve().parents[1]
CORE_017 = ROOT / ".cache" / "megatron-core-0.17.0"  # scripts/setup.sh --dev installs it there
DRIVER = Path(__file__).parent / "helpers" / "mcore_dist_driver.py"


def _bf16_source(root: Path, model) -> tuple[Path, dict]:
    state = {key: value.bfloat16() for key, value in random_mindformers_state(model, seed=31).items()}
    # Norm gammas that are not all 1, so that a norm put in the wrong place shows.
    for key in state:
        if key.endswith("norm.weight"):
            state[key] = (1 + 0.1 * torch.randn(state[key].shape)).bfloat16()
    write_mindformers_checkpoint(root, 4, state, None, default_common(4, 4))
    return root, state


@pytest.fixture(scope="module")
def bf16_source(tmp_path_factory):
    return _bf16_source(tmp_path_factory.mktemp("ms"), MOE)


@pytest.fixture(scope="module")
def torch_dist(tmp_path_factory, bf16_source):
    out = tmp_path_factory.mktemp("td") / "mg"
    report = convert_checkpoint(MOE, "ms2mg", bf16_source[0], out, dtype="bf16", ckpt_format="torch_dist")
    return out, report


def _same_as_source(folder: Path, state: dict) -> list[str]:
    back = read_mindformers_checkpoint(folder)
    return [key for key in state if back.tensor(key).dtype != state[key].dtype
            or not torch.equal(back.tensor(key), state[key])]


def _index(folder: Path):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(folder)).read_metadata()


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist folder, whole, read by torch.distributed.checkpoint itself."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = {}
    for key, entry in _index(folder).state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            out[key] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
            dcp.load({key: out[key]}, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
    return out


def test_torch_dist_is_megatron_cores_format_under_the_gpu_runs_keys(torch_dist):
    out, report = torch_dist
    folder = out / "iter_0000004"
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert json.loads((folder / "metadata.json").read_text()) == {
        "sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
        "common_backend_version": 1}
    assert torch.load(folder / "common.pt", weights_only=True) == {"checkpoint_version": 3.0, "iteration": 4}
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp", "common.pt", "metadata.json"]
    assert report.format == "torch_dist" and report.files == [folder / "__0_0.distcp"]
    entries = _index(folder).state_dict_metadata
    # TE's fused-norm names (a GPU run's), GDN's in_proj by parts, experts as one [E, ...] tensor per layer with
    # one chunk per expert (two for fc1: its gate and up halves)
    assert "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight" in entries
    assert "decoder.layers.0.self_attention.in_proj.layer_norm_weight" in entries
    assert "decoder.layers.0.input_layernorm.weight" not in entries
    assert {f"decoder.layers.0.self_attention.in_proj.weight.{p}" for p in ("query", "key", "value", "z", "beta",
                                                                             "alpha")} <= set(entries)
    fc1 = entries["decoder.layers.0.mlp.experts.experts.linear_fc1.weight"]
    assert tuple(fc1.size) == (4, 64, 64) and len(fc1.chunks) == 8
    assert "decoder.layers.0.mlp.experts.experts.linear_fc2._extra_state/shard_3_4" in entries


def test_torch_dist_reads_back_to_the_source_bit_for_bit(tmp_path, torch_dist, bf16_source):
    out, _ = torch_dist
    checkpoint = read_megatron_checkpoint(out, MOE, CORE)
    assert checkpoint.format == "torch_dist" and checkpoint.iteration == 4
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight3" in checkpoint.state  # read an expert at a time
    report = convert_checkpoint(MOE, "mg2ms", out, tmp_path / "ms", dtype="bf16")
    assert report.format == "torch_dist"
    assert _same_as_source(tmp_path / "ms", bf16_source[1]) == []


def test_parts_written_apart_give_the_one_process_checkpoint(tmp_path, torch_dist, bf16_source):
    """Three parts (the layer ranges the cpu pool's workers write, in any order) and the index: the same
    checkpoint as the one process writes; the output appears only when the index is written."""
    parts = tmp_path / "parts"
    for part in (2, 0, 1):
        report = convert_part(MOE, bf16_source[0], parts, part, 3, dtype="bf16")
        assert report.files == [parts / "iter_0000004" / f"__{part}_0.distcp"]
    with pytest.raises(CheckpointError, match="part 3 of 4 has not been written"):
        finish_parts(MOE, bf16_source[0], parts, tmp_path / "mg", 4, dtype="bf16")
    assert not (tmp_path / "mg").exists()
    finish_parts(MOE, bf16_source[0], parts, tmp_path / "mg", 3, dtype="bf16")
    folder, one = tmp_path / "mg" / "iter_0000004", torch_dist[0] / "iter_0000004"
    assert not parts.exists() and (tmp_path / "mg" / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert _index(folder).state_dict_metadata == _index(one).state_dict_metadata
    ours, theirs = _tensors(folder), _tensors(one)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[key], theirs[key]) for key in ours)
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp",
                                                        "common.pt", "metadata.json"]


def test_torch_dist_takes_no_layout(tmp_path, bf16_source):
    with pytest.raises(CheckpointError, match="Megatron reshards a torch_dist checkpoint"):
        convert_checkpoint(MOE, "ms2mg", bf16_source[0], tmp_path / "a", tp=2, ckpt_format="torch_dist")
    with pytest.raises(CheckpointError, match="format 'zarr'"):
        convert_checkpoint(MOE, "ms2mg", bf16_source[0], tmp_path / "b", ckpt_format="zarr")
    folder = tmp_path / "c" / "iter_0000001"
    folder.mkdir(parents=True)
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    with pytest.raises(CheckpointError, match="sharded_backend 'zarr'"):
        read_megatron_checkpoint(folder, MOE)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def _broken_copy(torch_dist, tmp_path: Path) -> Path:
    copy = tmp_path / "broken"
    shutil.copytree(torch_dist[0], copy)
    return copy / "iter_0000004"


def _rewrite_index(folder: Path, change) -> None:
    index = _index(folder)
    change(index)
    with open(folder / ".metadata", "wb") as handle:
        pickle.dump(index, handle)


FC1 = "decoder.layers.0.mlp.experts.experts.linear_fc1.weight"


def _drop_a_chunk(index) -> None:
    index.state_dict_metadata[FC1].chunks.pop()


def _rename_a_key(index) -> None:
    entries = index.state_dict_metadata
    entries["decoder.layers.0.mlp.experts.experts.linear_fc3.weight"] = entries.pop(FC1)


def _say_fp16(index) -> None:
    index.state_dict_metadata["decoder.layers.1.mlp.router.weight"].properties.dtype = torch.float16


def _say_bf16_blob_is_fp32(index) -> None:
    for entry in index.state_dict_metadata.values():
        if hasattr(entry, "properties"):
            entry.properties.dtype = torch.float32


@pytest.mark.parametrize("damage, match", [
    (lambda f: (f / "__0_0.distcp").unlink(), r"__0_0.distcp: the data file of '.*' is missing"),
    (lambda f: os.truncate(f / "__0_0.distcp", 1000), r"__0_0.distcp: truncated: '.*' is stored up to byte"),
    (lambda f: (f / ".metadata").write_bytes(b"not a pickle"), r"\.metadata: cannot read the torch_dist index"),
    (lambda f: _rewrite_index(f, _rename_a_key), r"\.metadata: 'decoder.layers.0.mlp.experts.experts.linear_fc3"
                                                r".weight' is not a tensor of model qwen35_moe_tiny"),
    (lambda f: _rewrite_index(f, _drop_a_chunk), rf"\.metadata: the chunks of '{FC1}' do not cover its shape"),
    (lambda f: _rewrite_index(f, _say_fp16), r"\.metadata: 'decoder.layers.1.mlp.router.weight' is torch.float16, "
                                            r"while '.*' is torch.bfloat16"),
    (lambda f: _rewrite_index(f, _say_bf16_blob_is_fp32), r"__0_0.distcp: '.*' chunk at \[.*\]: the data file "
                                                          r"holds torch.bfloat16 \[.*\], the index says torch.float32"),
], ids=["missing-file", "truncated-file", "index-not-a-pickle", "unknown-key", "chunk-missing", "mixed-dtype",
        "blob-not-its-dtype"])
def test_bad_torch_dist_folders_are_named_and_nothing_is_written(tmp_path, torch_dist, damage, match):
    folder = _broken_copy(torch_dist, tmp_path)
    damage(folder)
    with pytest.raises(CheckpointError, match=match):
        convert_checkpoint(MOE, "mg2ms", folder.parent, tmp_path / "out", dtype="bf16")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_a_bad_torch_dist_folder_exits_2_from_the_cli(tmp_path, torch_dist):
    folder = _broken_copy(torch_dist, tmp_path)
    os.truncate(folder / "__0_0.distcp", 1000)
    from typer.testing import CliRunner

    from crossalign.cli import app

    result = CliRunner().invoke(app, ["convert", "--model", "qwen35_moe_tiny", "--direction", "mg2ms", "--input",
                                      str(folder.parent), "--output", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "__0_0.distcp: truncated" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def _megatron_core(core: str, source: Path, checkpoint: Path, save: Path, tp: int, pp: int, ep: int, etp: int,
                   freq: int = MOE.linear_attention_freq) -> None:
    env = dict(os.environ)
    if core == "0.17.0":
        if not (CORE_017 / "megatron").is_dir():
            pytest.skip(f"megatron-core 0.17.0 is not installed in {CORE_017} (scripts/setup.sh --dev)")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(CORE_017), env.get("PYTHONPATH"))))
    done = subprocess.run([sys.executable, str(DRIVER), "qwen35_moe_tiny", str(freq), str(source), str(checkpoint),
                           str(save), core, str(tp), str(pp), str(ep), str(etp)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def _as_checkpoint(folder: Path) -> Path:
    (folder.parent / "latest_checkpointed_iteration.txt").write_text("4")
    return folder.parent


@pytest.mark.slow
@pytest.mark.parametrize("core", ["0.16.1", "0.17.0"])
def test_megatron_core_loads_it_at_tp1_and_tp2_pp2_ep2_and_its_own_saves_agree(tmp_path, bf16_source, core):
    """megatron-core's own load at TP 1 and at TP 2 x PP 2 x EP 2 (four gloo processes), each parameter the legacy
    path's shard bit for bit; its own save at TP 1 holds what ours holds; what it saves at either layout converts
    back to the MindSpore source bit for bit."""
    ours = tmp_path / "ours"
    convert_checkpoint(MOE, "ms2mg", bf16_source[0], ours, dtype="bf16", ckpt_format="torch_dist", core_version=core)
    for name, sizes in {"tp1": (1, 1, 1, 1), "tp2pp2ep2": (2, 2, 2, 1)}.items():
        saved = tmp_path / name / "iter_0000004"
        _megatron_core(core, bf16_source[0], ours / "iter_0000004", saved, *sizes)
        convert_checkpoint(MOE, "mg2ms", _as_checkpoint(saved), tmp_path / f"ms-{name}", dtype="bf16",
                           core_version=core)
        assert _same_as_source(tmp_path / f"ms-{name}", bf16_source[1]) == [], name
    oracle = tmp_path / "tp1" / "iter_0000004"
    theirs_index, ours_index = _index(oracle).state_dict_metadata, _index(ours / "iter_0000004").state_dict_metadata
    assert theirs_index.keys() == ours_index.keys()  # tensors and the linear layers' _extra_state objects
    for key, entry in theirs_index.items():
        if hasattr(entry, "size"):
            assert (entry.size, entry.properties.dtype) == (ours_index[key].size, ours_index[key].properties.dtype)
            assert sorted(map(str, entry.chunks)) == sorted(map(str, ours_index[key].chunks)), key
    theirs, mine = _tensors(oracle), _tensors(ours / "iter_0000004")
    assert [key for key in theirs if not torch.equal(theirs[key], mine[key])] == []


@pytest.mark.slow
def test_stacked_layers_match_megatron_cores_own_save(tmp_path):
    """A config whose layers are all alike (linear_attention_freq 1, as the real-layer benchmark's): megatron-core
    stacks them under one key per tensor, [L, ...] with a chunk per layer; its own load takes ours and its own
    save holds the same keys, chunks and data."""
    model = type(MOE).model_validate({**MOE.model_dump(), "linear_attention_freq": 1})  # validated anew
    source, state = _bf16_source(tmp_path / "ms", model)
    ours = tmp_path / "ours"
    convert_checkpoint(model, "ms2mg", source, ours, dtype="bf16", ckpt_format="torch_dist")
    entries = _index(ours / "iter_0000004").state_dict_metadata
    assert tuple(entries["decoder.layers.self_attention.linear_qkv.layer_norm_weight"].size) == (4, 64)
    assert tuple(entries["decoder.layers.mlp.experts.experts.linear_fc1.weight"].size) == (4, 4, 64, 64)
    saved = tmp_path / "tp1" / "iter_0000004"
    _megatron_core("0.16.1", source, ours / "iter_0000004", saved, 1, 1, 1, 1, freq=1)
    theirs, mine = _tensors(saved), _tensors(ours / "iter_0000004")
    assert _index(saved).state_dict_metadata.keys() == entries.keys()
    assert theirs.keys() == mine.keys() and [key for key in theirs if not torch.equal(theirs[key], mine[key])] == []
    convert_checkpoint(model, "mg2ms", ours, tmp_path / "back", dtype="bf16")
    assert _same_as_source(tmp_path / "back", state) == []


def test_diagnose_reads_a_torch_dist_checkpoint(tmp_path, torch_dist, bf16_source):
    from crossalign.diagnose.run import diagnose

    result = diagnose(CONFIG, bf16_source[0], torch_dist[0], tmp_path / "out", seq=32, batch=1, save_tensors=False)
    assert not result.diagnosis.diverged, result.diagnosis.hint()
