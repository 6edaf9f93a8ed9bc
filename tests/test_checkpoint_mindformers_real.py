"""Checkpoints as MindFormers 2.1.0 itself saves them: buffers, optimizer files, several ranks.

The fixtures are written the way MindFormers' ``checkpoint.save_checkpoint`` writes them: each
rank's files by MindSpore's own ``save_checkpoint(..., format="safetensors")`` (the call MindFormers
makes), ``common.json`` with ``CommonInfo``'s fields, and ``metadata.json`` in the format of
``checkpoint/metadata.py: save_metadata`` with each layout made by MindSpore's ``Layout``. The
MindFormers 2.1.0 wheel cannot be imported beside MindSpore 2.10's numpy<2: its checkpoint package
imports ``mindformers.core`` (``checkpoint/layout_adapter.py``), which reaches jieba, rouge_chinese,
``datasets`` and so pyarrow, whose wheels need numpy 2. So its format is followed as its reader
(``load_metadata``, ``ReshardLoader``) reads it:

* a tensor's ``global_offset`` is ``[slice id]``, the slice numbered row-major over its
  ``axis_fragmentations`` (``sharded_tensor.py: _rank_id_with_slice_id``), each slice
  ``global_shape / axis_fragmentations`` big;
* ``storage_data`` maps ``str((name, (slice id,)))`` to the rank files holding that slice;
* a layout is ``Layout.to_dict()``, read back by unpacking its values in that order.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

ms = pytest.importorskip("mindspore")
from mindspore.parallel import Layout  # noqa: E402

from crossalign.checkpoint.cast import cast_bf16  # noqa: E402
from crossalign.checkpoint.convert import convert_checkpoint, mindformers_to_megatron  # noqa: E402
from crossalign.tensorio.errors import CheckpointError  # noqa: E402
from crossalign.models.layout import random_mindformers_state  # noqa: E402
from crossalign.sides.megatron.checkpoint import read_megatron_checkpoint  # noqa: E402
from crossalign.sides.mindformers.checkpoint import default_common, read_mindformers_checkpoint  # noqa: E402
from crossalign.tensorio.safetensors_io import read_header  # noqa: E402
from crossalign.cli import app  # noqa: E402
from crossalign.config import load_config  # noqa: E402

MOE = load_config("qwen35_moe_tiny").model
DENSE = load_config("qwen35_dense_tiny").model
MS_DTYPE = {torch.float32: "Float32", torch.int64: "Int64", torch.bfloat16: "BFloat16"}


def _buffers(model, seed=0) -> dict[str, torch.Tensor]:
    """MindFormers' MoE token counts: one (E,) float32 per MoE layer, the MTP layer's included."""
    layers = [f"decoder.layers.{i}." for i in range(model.num_layers)] + ["mtp.layers.0.transformer_layer."]
    gen = torch.Generator().manual_seed(seed)
    return {f"{p}mlp.tokens_per_expert": torch.randint(0, 500, (model.num_experts,), generator=gen).float()
            for p in layers}


def _optimizer(model_state: dict, step: int) -> dict[str, torch.Tensor]:
    """What MindFormers' pynative AdamW saves: moments per parameter and an int64 step count."""
    out = {f"adam_m.{n}": torch.full_like(t, 0.5) for n, t in model_state.items()}
    out.update({f"adam_v.{n}": torch.full_like(t, 0.25) for n, t in model_state.items()})
    out["global_step"] = torch.tensor([step], dtype=torch.int64)
    return out


def _ms_save(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """MindSpore's own safetensors save, as MindFormers calls it (the name without the extension)."""
    ms.save_checkpoint([{"name": n, "data": ms.Tensor(t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy(),
                                                        ms.bfloat16 if t.dtype == torch.bfloat16 else None)}
                        for n, t in tensors.items()], str(path).removesuffix(".safetensors"), format="safetensors")


def _rank_slice(tensor: torch.Tensor, cut: tuple, mesh: dict[str, int],
                coords: dict[str, int]) -> tuple[int, torch.Tensor]:
    """Rank ``coords``' slice of a tensor whose axis i is cut along mesh axis ``cut[i]`` ("None": not cut)."""
    fragments = [mesh.get(axis, 1) for axis in cut]
    index = [coords.get(axis, 0) for axis in cut]
    piece = tensor
    for dim, (count, i) in enumerate(zip(fragments, index)):
        piece = piece.chunk(count, dim=dim)[i]
    slice_id = 0
    for count, i in zip(fragments, index):
        slice_id = slice_id * count + i
    return slice_id, piece.contiguous()


def mindformers_save(root: Path, iteration: int, model: dict, optimizer: dict | None, *, mesh: dict[str, int],
                     cuts: dict[str, tuple], prefix: str = "qwen35", total_steps: int = 10) -> Path:
    """One iteration as MindFormers 2.1.0's save_checkpoint leaves it, saved by every rank of ``mesh``.

    ``mesh`` is the device matrix as {alias: size} (rightmost fastest); ``cuts`` gives, per tensor,
    the mesh alias each of its axes is cut along (tensors not named are whole on every rank).
    """
    folder = root / f"iteration_{iteration:08d}"
    folder.mkdir(parents=True)
    aliases, sizes = list(mesh), list(mesh.values())
    world = math.prod(sizes)
    described, storage = {}, {}
    for kind, tensors in (("model", model), ("opt", optimizer or {})):
        holders: dict[tuple[str, int], list[int]] = {}
        for rank in range(world):
            coords, rest = {}, rank
            for alias, size in reversed(list(mesh.items())):
                coords[alias], rest = rest % size, rest // size
            local = {}
            for name, tensor in tensors.items():
                cut = cuts.get(name, ("None",) * tensor.dim())
                slice_id, local[name] = _rank_slice(tensor, cut, mesh, coords)
                holders.setdefault((name, slice_id), []).append(rank)
                layout = Layout(tuple(sizes), tuple(aliases), list(range(world)))(*cut).to_dict()
                entry = described.setdefault(name, {
                    "properties": {"dtype": MS_DTYPE[tensor.dtype], "replica_id": [0] * world,
                                   "allow_shape_mismatch": False, "allow_to_save": True},
                    "global_shape": list(tensor.shape),
                    "axis_fragmentations": [mesh.get(axis, 1) for axis in cut],
                    "layout": json.loads(json.dumps(layout)), "chunk": []})
                chunk = {"global_offset": [slice_id], "local_shape": list(local[name].shape)}
                if chunk not in entry["chunk"]:
                    entry["chunk"].append(chunk)
            if tensors:
                _ms_save(folder / f"{prefix}-{kind}-{rank:07d}-{world:07d}.safetensors", local)
        for (name, slice_id), ranks in holders.items():
            storage[str((name, (slice_id,)))] = [
                {"file_name": f"{prefix}-{kind}-{rank:07d}-{world:07d}.safetensors", "storage_rank": rank,
                 "rank_group": ranks} for rank in ranks]
    if world > 1:  # "No need to save metadata.json for single card."
        (folder / "metadata.json").write_text(json.dumps({"state_dict_metadata": described, "storage_data": storage},
                                                         ensure_ascii=False, separators=(",", ":")))
    common = {"epoch_num": 1, "step_num": total_steps, "global_step": iteration, "loss_scale": 1.0,
              "global_batch_size": 8, "consumed_samples": 8 * iteration, "ckpt_status": None}
    (folder / "common.json").write_text(json.dumps(common, ensure_ascii=False, indent=4))
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return root


@pytest.fixture(scope="module")
def moe_weights():
    return random_mindformers_state(MOE, seed=3)


def _two_rank_cuts(state: dict) -> dict[str, tuple]:
    """A tensor-parallel split of two ranks: 2-D weights cut on their rows where they divide, the rest whole."""
    return {name: ("tp",) + ("None",) * (t.dim() - 1) for name, t in state.items()
            if t.dim() >= 2 and t.shape[0] % 2 == 0}


def _megatron(folder: Path) -> dict[str, torch.Tensor]:
    return read_megatron_checkpoint(folder, MOE).state


def test_a_real_moe_checkpoint_converts_without_its_buffers_and_optimizer(tmp_path, moe_weights):
    model = {**moe_weights, **_buffers(MOE)}
    source = mindformers_save(tmp_path / "mf", 10, model, _optimizer(moe_weights, 10), mesh={"tp": 1}, cuts={})
    report = convert_checkpoint(MOE, "ms2mg", source, tmp_path / "mg")
    assert report.keys_in == len(moe_weights)
    assert report.notes and "left out 5 buffer(s)" in report.notes[0]
    expected = mindformers_to_megatron(moe_weights, MOE)
    converted = _megatron(tmp_path / "mg")
    assert set(converted) == set(expected) and all(torch.equal(converted[k], v) for k, v in expected.items())

    # the DAG's way: cast first; buffers and optimizer come through unchanged, the cast converts the same
    cast = cast_bf16(source, tmp_path / "bf16")
    assert cast.buffers == 5 and [f.name for f in cast.optimizer_files] == ["qwen35-opt-0000000-0000001.safetensors"]
    bf16 = read_mindformers_checkpoint(tmp_path / "bf16")
    assert all(torch.equal(t, model[n]) for n, t in bf16.buffer_state().items())
    assert bf16.optimizer_state()["global_step"].dtype == torch.int64
    result = CliRunner().invoke(app, ["convert", "--model", "qwen35_moe_tiny", "--direction", "ms2mg",
                                      "--input", str(tmp_path / "bf16"), "--output", str(tmp_path / "mg16")])
    assert result.exit_code == 0, result.output
    assert "note: left out 5 buffer(s) that Megatron does not keep" in result.output


@pytest.mark.parametrize("extra, model, named", [
    ({"decoder.layers.0.mlp.expert_bias": torch.zeros(4)}, MOE, "decoder.layers.0.mlp.expert_bias"),
    ({"decoder.layers.9.mlp.tokens_per_expert": torch.zeros(4)}, MOE, "decoder.layers.9.mlp.tokens_per_expert"),
    ({"decoder.layers.0.mlp.tokens_per_expert": torch.zeros(3)}, MOE, "decoder.layers.0.mlp.tokens_per_expert"),
    ({"decoder.layers.0.mlp.tokens_per_expert": torch.zeros(4)}, DENSE, "decoder.layers.0.mlp.tokens_per_expert"),
])
def test_unknown_keys_are_still_refused_by_name(tmp_path, moe_weights, extra, model, named):
    weights = moe_weights if model is MOE else random_mindformers_state(DENSE, seed=1)
    source = mindformers_save(tmp_path / "mf", 2, {**weights, **extra}, None, mesh={"tp": 1}, cuts={})
    with pytest.raises(CheckpointError, match=named.replace(".", r"\.")):
        convert_checkpoint(model, "ms2mg", source, tmp_path / "mg")
    assert not (tmp_path / "mg").exists()


def test_slices_of_a_two_by_two_mesh_are_stitched_from_metadata_json(tmp_path):
    model = {"both": torch.arange(48.0).reshape(8, 6), "rows": torch.arange(24.0).reshape(4, 6),
             "cols": torch.arange(12.0).reshape(2, 6), "norm": torch.arange(6.0)}
    optimizer = {"adam_m.both": model["both"] * 2, "global_step": torch.tensor([4], dtype=torch.int64)}
    cuts = {"both": ("dp", "tp"), "adam_m.both": ("dp", "tp"), "rows": ("tp", "None"), "cols": ("None", "tp")}
    root = mindformers_save(tmp_path / "mf", 4, model, optimizer, mesh={"dp": 2, "tp": 2}, cuts=cuts)
    checkpoint = read_mindformers_checkpoint(root)
    assert checkpoint.world_size == 4 and len(checkpoint.pieces["both"]) == 4 and len(checkpoint.pieces["norm"]) == 1
    state = checkpoint.model_state()
    assert set(state) == set(model) and all(torch.equal(state[n], t) for n, t in model.items())
    assert torch.equal(checkpoint.optimizer_state()["adam_m.both"], optimizer["adam_m.both"])


def test_a_multi_rank_checkpoint_converts_as_one_rank_does(tmp_path, moe_weights):
    model = {**moe_weights, **_buffers(MOE)}
    cuts = _two_rank_cuts(moe_weights)
    cuts.update({f"adam_m.{n}": c for n, c in cuts.items()} | {f"adam_v.{n}": c for n, c in cuts.items()})
    source = mindformers_save(tmp_path / "mf", 6, model, _optimizer(moe_weights, 6), mesh={"tp": 2}, cuts=cuts)
    assert len(list((source / "iteration_00000006").glob("*-model-*-0000002.safetensors"))) == 2
    report = convert_checkpoint(MOE, "ms2mg", source, tmp_path / "mg", tp=2)
    whole = mindformers_save(tmp_path / "one", 6, model, None, mesh={"tp": 1}, cuts={})
    convert_checkpoint(MOE, "ms2mg", whole, tmp_path / "mg1", tp=2)
    for file in report.files:
        other = tmp_path / "mg1" / file.relative_to(tmp_path / "mg")
        a, b = torch.load(file, weights_only=True)["model"], torch.load(other, weights_only=True)["model"]
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)

    calls = []
    cast = cast_bf16(source, tmp_path / "bf16", progress=lambda done, total, name: calls.append((done, total)))
    assert len(cast.files) == 2  # rank files stay, metadata.json follows the new dtypes
    assert calls[-1][0] == calls[-1][1] == cast.tensors
    meta = json.loads((tmp_path / "bf16" / "iteration_00000006" / "metadata.json").read_text())
    dtypes = {n: e["properties"]["dtype"] for n, e in meta["state_dict_metadata"].items()}
    assert dtypes["output_layer.weight"] == "BFloat16" and dtypes["decoder.layers.0.mlp.tokens_per_expert"] == "Float32"
    assert dtypes["adam_m.output_layer.weight"] == "Float32"
    stitched = read_mindformers_checkpoint(tmp_path / "bf16").model_state()
    assert all(torch.equal(stitched[n], t.to(torch.bfloat16)) for n, t in moe_weights.items())


def test_broken_multi_rank_checkpoints_are_named(tmp_path, moe_weights):
    source = mindformers_save(tmp_path / "mf", 1, dict(moe_weights), None, mesh={"tp": 2},
                              cuts=_two_rank_cuts(moe_weights))
    folder = source / "iteration_00000001"
    metadata = json.loads((folder / "metadata.json").read_text())
    chunks = metadata["state_dict_metadata"]["output_layer.weight"]["chunk"]
    (folder / "metadata.json").write_text(json.dumps({**metadata, "state_dict_metadata": {
        **metadata["state_dict_metadata"], "output_layer.weight": {
            **metadata["state_dict_metadata"]["output_layer.weight"], "chunk": chunks[:1]}}}))
    with pytest.raises(CheckpointError, match="'output_layer.weight' has 1 of its 2 slices"):
        read_mindformers_checkpoint(source)
    (folder / "metadata.json").write_text(json.dumps({**metadata, "state_dict_metadata": {
        k: v for k, v in metadata["state_dict_metadata"].items() if k != "decoder.final_layernorm.weight"}}))
    with pytest.raises(CheckpointError, match="'decoder.final_layernorm.weight' is not described in"):
        read_mindformers_checkpoint(source)
    (folder / "metadata.json").write_text(json.dumps(metadata))
    (folder / "qwen35-model-0000001-0000002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="qwen35-model-0000001-0000002.safetensors, which is missing"):
        convert_checkpoint(MOE, "ms2mg", source, tmp_path / "mg")
    assert not (tmp_path / "mg").exists()


def test_mg2ms_writes_what_mindformers_writes_for_several_ranks(tmp_path, moe_weights):
    source = mindformers_save(tmp_path / "mf", 7, dict(moe_weights), None, mesh={"tp": 1}, cuts={})
    convert_checkpoint(MOE, "ms2mg", source, tmp_path / "mg")
    convert_checkpoint(MOE, "mg2ms", tmp_path / "mg", tmp_path / "one", global_batch_size=8)
    report = convert_checkpoint(MOE, "mg2ms", tmp_path / "mg", tmp_path / "two", tp=2, global_batch_size=8)
    folder = tmp_path / "two" / "iteration_00000007"
    assert sorted(p.name for p in folder.iterdir()) == ["common.json", "metadata.json",
                                                         "qwen35-model-0000000-0000002.safetensors",
                                                         "qwen35-model-0000001-0000002.safetensors"]
    assert [f.name for f in report.files] == ["qwen35-model-0000000-0000002.safetensors",
                                              "qwen35-model-0000001-0000002.safetensors"]
    assert all(read_header(f)[1] == {"format": "ms"} for f in report.files)
    assert report.notes and "added 5 buffer(s)" in report.notes[0]
    # every layout is one MindSpore rebuilds as MindFormers' load_metadata does (values unpacked in order)
    metadata = json.loads((folder / "metadata.json").read_text())
    for name, entry in metadata["state_dict_metadata"].items():
        device_matrix, tensor_map, _, alias_name, rank_list = entry["layout"].values()
        names = {len(device_matrix) - 1 - i: alias for i, alias in enumerate(alias_name)}
        Layout(tuple(device_matrix), tuple(alias_name), rank_list)(*(names.get(i, "None") for i in tensor_map))
        for chunk in entry["chunk"]:
            assert str((name, tuple(chunk["global_offset"]))) in metadata["storage_data"]
    one, two = read_mindformers_checkpoint(tmp_path / "one"), read_mindformers_checkpoint(tmp_path / "two")
    assert two.world_size == 2 and one.world_size == 1
    a, b = one.model_state(), two.model_state()
    assert set(a) == set(moe_weights) and all(torch.equal(a[k], b[k]) and torch.equal(a[k], moe_weights[k]) for k in a)
    # the buffers of MindFormers' MoE layers, as its reset leaves them
    buffers = two.buffer_state()
    assert sorted(buffers) == sorted(_buffers(MOE)) and all(torch.equal(t, torch.zeros(4)) for t in buffers.values())
    assert load_file(report.files[0])["decoder.layers.0.mlp.tokens_per_expert"].dtype == torch.float32
    common = json.loads((folder / "common.json").read_text())
    assert list(common) == ["epoch_num", "step_num", "global_step", "loss_scale", "global_batch_size",
                            "consumed_samples", "ckpt_status"]
    assert common["global_step"] == 7 and common["consumed_samples"] == 56


def test_common_json_step_num_is_the_runs_total_steps():
    """MindFormers 2.1.0 pynative ``_create_common_info``: step_num = state.max_steps, global_step = steps done."""
    assert default_common(3, 8, total_steps=10) == {
        "epoch_num": 1, "step_num": 10, "global_step": 3, "loss_scale": 1.0, "global_batch_size": 8,
        "consumed_samples": 24, "ckpt_status": None}
    assert default_common(5)["consumed_samples"] == 0  # MindFormers writes 0 for a state without samples
