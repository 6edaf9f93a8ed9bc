"""Loads verified by the project itself: a missing, extra, renamed or different tensor fails, named."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from crossalign.sides.megatron.load_digest import verify_load_digest
from crossalign.tensorio.errors import LoadDigestError
from crossalign.tensorio.digest import (compare_loaded, numpy_sha256, torch_digests,
                                          torch_sha256)
from crossalign.models.layout import megatron_shapes, random_mindformers_state
from crossalign.sides.megatron.checkpoint import write_megatron_checkpoint
from crossalign.sides.megatron.te_local import te_to_local
from crossalign.config import load_config

RENAMED = ("decoder.layers.1.mlp.experts.linear_fc1.weight2", "decoder.layers.1.mlp.experts.linear_fc1.weight_2")
MISSING = "decoder.layers.3.mlp.experts.linear_fc2.weight0"


def random_megatron_state(config, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {key: torch.randn(shape, generator=generator)
            for key, shape in megatron_shapes(config.model, config.training.megatron_core_version).items()}


def faulty(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One routed-expert tensor renamed, one missing: the fault every side must name."""
    out = {(RENAMED[1] if key == RENAMED[0] else key): value for key, value in state.items()}
    del out[MISSING]
    return out


def test_a_renamed_and_a_missing_expert_tensor_are_both_named():
    config = load_config("qwen35_moe_tiny")
    state = random_megatron_state(config)
    loaded = torch_digests(state)
    compare_loaded(loaded, state, what="model vs ckpt")
    with pytest.raises(LoadDigestError) as caught:
        compare_loaded(loaded, faulty(state), what="model vs ckpt")
    message = str(caught.value)
    assert f"2 not in the checkpoint, so left at its initial value: {RENAMED[0]}, {MISSING}" in message
    assert f"1 in the checkpoint but never loaded (extra or renamed): {RENAMED[1]}" in message


def test_other_values_and_shapes_are_named():
    state = {"a": torch.ones(3), "b": torch.zeros(2, 2)}
    loaded = torch_digests(state)
    changed = {"a": torch.tensor([1.0, 1.0, 1.5]), "b": torch.zeros(4)}
    with pytest.raises(LoadDigestError, match=r"loaded with another shape: b \(loaded \(2, 2\), checkpoint \(4,\)\)"
                                              r".*loaded with other values: a \(float32\)"):
        compare_loaded(loaded, changed, what="x")


def test_bf16_parameters_are_held_against_the_checkpoint_rounded_to_bf16():
    """Megatron under --bf16 copies the fp32 checkpoint into bf16 parameters: compared in the loaded dtype."""
    fp32 = {"w": torch.tensor([1.0 + 2 ** -10, 3.0, -0.1])}
    loaded = torch_digests({"w": fp32["w"].to(torch.bfloat16)})
    assert loaded["w"]["dtype"] == "bfloat16"
    compare_loaded(loaded, fp32, what="x")
    with pytest.raises(LoadDigestError, match="other values: w"):
        compare_loaded(loaded, {"w": fp32["w"] + 0.01}, what="x")


def test_numpy_and_torch_hash_the_same_bytes():
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert numpy_sha256(values) == torch_sha256(torch.from_numpy(values))
    assert numpy_sha256(values.T) == torch_sha256(torch.from_numpy(values).T)  # C order either way


def test_the_launchers_digest_is_verified_against_the_checkpoint_under_the_te_names(tmp_path: Path):
    """The launcher hashes with its own copy of the function (it imports nothing from crossalign): both agree,
    and a CPU model's local names are mapped back to the checkpoint's TE names."""
    from crossalign.sides.megatron.embedded.mcore_model import layer_specs_module

    launcher = layer_specs_module()
    config = load_config("qwen35_moe_tiny")
    state = random_megatron_state(config)
    write_megatron_checkpoint(tmp_path / "ckpt", 0, state)
    local = te_to_local(state, config.model, config.training.megatron_core_version)
    digest = {key: {"shape": list(value.shape), "dtype": "float32", "sha256": launcher.tensor_sha256(value)}
              for key, value in local.items()}
    folder = tmp_path / "load_digest"
    folder.mkdir()
    (folder / "mp_rank_00.json").write_text(json.dumps({"rank": "mp_rank_00", "tensors": digest}))
    assert verify_load_digest(folder, tmp_path / "ckpt", config) == len(state)

    write_megatron_checkpoint(tmp_path / "bad", 0, faulty(state))
    with pytest.raises(LoadDigestError, match=f"{RENAMED[0]}, {MISSING}.*never loaded.*{RENAMED[1]}"):
        verify_load_digest(folder, tmp_path / "bad", config)
    with pytest.raises(LoadDigestError, match="wrote no load digest for rank mp_rank_00"):
        verify_load_digest(tmp_path / "nothing", tmp_path / "ckpt", config)


def test_the_mindspore_side_names_what_it_did_not_load():
    from crossalign.sides.mindformers.embedded.trainer import _verify_loaded

    config = load_config("qwen35_moe_tiny")
    state = random_mindformers_state(config.model, seed=0)
    values = {name: np.asarray(value, dtype=np.float32) for name, value in state.items()}
    _verify_loaded(values, state)
    expert = next(name for name in state if "experts" in name and "shared" not in name)
    changed = dict(state)
    changed[expert + "_renamed"] = changed.pop(expert)
    with pytest.raises(LoadDigestError, match=f"not in the checkpoint.*{expert}.*never loaded.*{expert}_renamed"):
        _verify_loaded(values, changed)


@pytest.mark.timeout(300)
def test_the_embedded_megatron_core_side_names_both_and_verifies_a_clean_load(tmp_path: Path):
    from crossalign.sides.megatron.embedded.mcore_cpu import megatron_core_on_cpu
    from crossalign.sides.megatron.embedded.mcore_model import McoreLoadError, build_gpt_model, load_converted_state
    from crossalign.sides.megatron.embedded.trainer import verify_loaded
    from crossalign.data.files import DatasetFiles
    from crossalign.sides.protocol import TrainRequest

    config = load_config("qwen35_moe_tiny")
    state = random_megatron_state(config)
    request = TrainRequest(config=config, side="megatron", mode="align", output_dir=tmp_path,
                           data=DatasetFiles(prefix=tmp_path / "data", tokenizer=tmp_path),
                           init_checkpoint=tmp_path / "ckpt")
    with megatron_core_on_cpu(config.training.seed):
        net = build_gpt_model(config.model, config.training)
        load_converted_state(net, state, config.model, config.training.megatron_core_version)
        verify_loaded(net, state, request)
        with pytest.raises(LoadDigestError, match="other values: decoder.final_layernorm.weight"):
            verify_loaded(net, {**state, "decoder.final_layernorm.weight": state["decoder.final_layernorm.weight"] + 1},
                          request)
        with pytest.raises(McoreLoadError) as caught:
            load_converted_state(net, faulty(state), config.model, config.training.megatron_core_version)
    local_renamed = RENAMED[0].replace("linear_fc1.weight2", "local_experts.2.linear_fc1.weight")
    for name in (local_renamed, MISSING.replace("linear_fc2.weight0", "local_experts.0.linear_fc2.weight"),
                 RENAMED[1]):
        assert name in str(caught.value)


def _rank_of_each(generator, token: str) -> dict[int, int]:
    """global rank -> its rank within its ``token`` group, from megatron-core's own RankGenerator."""
    return {rank: groups.index(rank) for groups in generator.get_ranks(token) for rank in groups}


@pytest.mark.parametrize("tp, pp, ep, etp, world", [
    (1, 1, 1, 1, 1), (2, 1, 1, 2, 2), (2, 2, 1, 2, 8), (1, 1, 2, 1, 2), (2, 1, 2, 1, 2), (2, 1, 2, 1, 4),
    (2, 2, 4, 2, 16), (4, 2, 2, 1, 16), (1, 2, 8, 1, 32),
])
def test_the_folders_each_layout_loads_are_the_ones_megatron_cores_ranks_name(tp, pp, ep, etp, world):
    """Each rank loads get_checkpoint_name(its tensor, pipeline, expert rank): the ranks as megatron-core's
    own RankGenerator places them (core_v0.16.1 megatron/core/parallel_state.py:775-805, default order)."""
    from megatron.core.parallel_state import RankGenerator

    from crossalign.sides.megatron.checkpoint import loaded_rank_folders, rank_dir_name

    order = "tp-cp-ep-dp-pp"
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp), pp=pp, cp=1, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=order)
    tensor, pipeline, experts = _rank_of_each(dense, "tp"), _rank_of_each(dense, "pp"), _rank_of_each(expert, "ep")
    expected = sorted({rank_dir_name(tensor[r], pipeline[r], pp, experts[r], ep) for r in range(world)})
    assert loaded_rank_folders(tp, pp, ep, etp, world) == expected


def test_a_folded_expert_layout_is_verified_on_the_folders_its_ranks_load(tmp_path: Path):
    """TP 2 x EP 2 with ETP 1 on two GPUs: the conversion writes four rank folders, the two ranks load two
    (mp_rank_00_000, mp_rank_01_001). Their digests suffice; a missing one of them is named."""
    from crossalign.checkpoint.convert import convert_checkpoint
    from crossalign.models.layout import split_stacked_experts
    from crossalign.tensorio.digest import write_digest
    from crossalign.sides.mindformers.checkpoint import default_common, write_mindformers_checkpoint

    config = load_config("qwen35_moe_tiny", ["parallel.megatron.tensor=2", "parallel.megatron.expert=2",
                                             "parallel.megatron.expert_tensor=1",
                                             "parallel.megatron.sequence_parallel=true",
                                             "parallel.megatron.cards_per_node=2"])
    write_mindformers_checkpoint(tmp_path / "ms", 1, random_mindformers_state(config.model, seed=3), None,
                                 default_common(1, config.training.global_batch_size))
    convert_checkpoint(config.model, "ms2mg", tmp_path / "ms", tmp_path / "mg", tp=2, ep=2, etp=1)
    iteration = next((tmp_path / "mg").glob("iter_*"))
    assert sorted(p.name for p in iteration.iterdir()) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000",
                                                           "mp_rank_01_001"]
    folder = tmp_path / "load_digest"
    for rank in ("mp_rank_00_000", "mp_rank_01_001"):
        model = torch.load(iteration / rank / "model_optim_rng.pt", weights_only=True)["model"]
        state = {k: v for k, v in model.items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
        write_digest(folder / f"{rank}.json", torch_digests(split_stacked_experts(state, config.model.num_experts)),
                     rank=rank)
    assert verify_load_digest(folder, tmp_path / "mg", config) > 0
    (folder / "mp_rank_01_001.json").unlink()
    with pytest.raises(LoadDigestError, match="wrote no load digest for rank mp_rank_01_001"):
        verify_load_digest(folder, tmp_path / "mg", config)


def _launcher_writes_its_digest(rank: int, world: int, folder: str, sizes: dict) -> None:
    """One rank of a gloo group at ``sizes``: the launcher's write_load_digest after a (stand-in) load."""
    from crossalign.sides.megatron.embedded.mcore_cpu import ProcessGroup, megatron_core_on_cpu
    from crossalign.sides.megatron.embedded.mcore_model import layer_specs_module

    launcher = layer_specs_module()
    with megatron_core_on_cpu(1, ProcessGroup(rank, world, f"file://{folder}/rendezvous", **sizes)):
        launcher.write_load_digest([torch.nn.Linear(2, 2)], f"{folder}/load_digest")


@pytest.mark.slow
def test_the_launcher_names_each_digest_after_the_folder_its_ranks_load(tmp_path: Path):
    """patches/megatron/pretrain_qwen35.py at TP 2 x EP 2 with ETP 1 on two ranks: one file per folder a rank
    loads, with its expert rank (mp_rank_00_000, mp_rank_01_001), as the step's verification asks for them."""
    import torch.multiprocessing as mp

    from crossalign.sides.megatron.checkpoint import loaded_rank_folders

    sizes = {"tensor": 2, "expert": 2, "expert_tensor": 1}
    mp.spawn(_launcher_writes_its_digest, nprocs=2, join=True, args=(2, str(tmp_path), sizes))
    written = sorted(p.stem for p in (tmp_path / "load_digest").glob("*.json"))
    assert written == loaded_rank_folders(2, 1, 2, 1, 2) == ["mp_rank_00_000", "mp_rank_01_001"]
