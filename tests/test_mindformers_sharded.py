"""MindFormers' own checkpoint loader (the 2.0.0 and 2.1.0 wheels) on crossalign's multi-rank MindFormers output.

mg2ms ``--tp N`` writes the MindFormers checkpoint as N ranks save it: one
``<prefix>-model-<rank>-<N>.safetensors`` each and ``metadata.json``
(``crossalign/sides/mindformers/checkpoint.py``: ``sharded_metadata``, storage slices by
``mindformers_split_dim``). Two things are held against MindFormers' code, run in a subprocess
(tests/helpers/mindformers_upstream.py, tests/helpers/mindformers_driver.py):

- (a) its ``load_checkpoint`` (2.1.0 ``checkpoint/checkpoint.py:555``, 2.0.0 ``:469``) loads the
  N-rank output into a single-card pynative network bit for bit as it loads the single-rank output
  of the same Megatron checkpoint (and both equal the weights);
- (b) for a target layout (TP 2; EP 2 for MoE) its ``ReshardLoader``, given rank r's destination
  ShardedTensors built by its own ``get_sharded_tensor_from_strategy_metadata``, gives each rank
  exactly the slice that crossalign's Megatron sharding (``checkpoint/reshard.py: shard_tensor``,
  then the MindFormers side of the tensor's conversion rule) gives that rank, or the whole tensor
  where MindFormers' plan keeps a tensor whole that Megatron splits (named below);
- (c) crossalign's metadata.json is the one MindFormers' own save path writes for that save;
- (d) crossalign reads 4-rank saves as MindFormers writes them (data parallel x TP, EP x TP).

Stood in, because hyper_parallel (Huawei's parallel library) is not installed:

- the network of (a) is a cell holding crossalign's MindFormers parameters under their names
  (``mindformers_driver.holder``): public MindFormers has no Qwen3.5 model (no GatedDeltaNet, no
  gated linear_qkv), and load_checkpoint asks the network only for its parameters;
- the per-parameter layout hyper_parallel's ``get_current_layout`` would report in (b): written from
  the placement MindFormers 2.1.0's pynative plan gives each parameter (``mindformers_placement``,
  with file:line), then converted to ``ms.Layout`` by MindFormers' own code. The GatedDeltaNet
  parameters are left out of (b): only a fork's model has them, so no public plan places them.
  2.0.0's pynative plan (``pynative/base_models/gpt/parallelize.py``) is a different, DTensor-based
  one; the same 2.1.0 placements are given to both releases, so for 2.0.0 this checks its loader
  (ShardedTensor, ReshardLoader, metadata reading), not its plan.

The tiny configs have 2 query groups and 2 GDN key heads, so N = 4 does not divide them: mg2ms
refuses it, naming the size (checked below), and only N = 2 is loaded.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from crossalign.checkpoint.convert import convert_checkpoint, mindformers_to_megatron
from crossalign.tensorio.errors import CheckpointError
from crossalign.models.layout import mindformers_buffers, mindformers_shapes
from crossalign.sides.mindformers.checkpoint import DEFAULT_PREFIX, METADATA, default_common, read_mindformers_checkpoint, \
    write_mindformers_checkpoint
from crossalign.sides.megatron.sharding import mindformers_split_dim, shard_tensor
from crossalign.checkpoint.rules import Fuse, TransposeExperts, conversion_plan
from crossalign.config import ModelConfig, load_config
from helpers.mindformers_upstream import RELEASES, run_driver

MODELS = ("qwen35_dense_tiny", "qwen35_moe_tiny")
RANKS = 2  # mg2ms --tp: the most that the tiny shapes divide
MS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "I64": "int64", "I32": "int32"}
# Target layouts: (mesh axis name, size). MindFormers 2.1.0 parallelises TP and EP on meshes of their own
# (pynative/base_models/gpt/parallelize.py:1938-1975 _apply_spmd_parallelism: get_mesh("tp"), get_mesh("ep")).
LAYOUTS = {"qwen35_dense_tiny": {"tp2": ("tp", 2)}, "qwen35_moe_tiny": {"tp2": ("tp", 2), "ep2": ("ep", 2)}}
# Tensors MindFormers' plan keeps whole on every rank where Megatron splits them (crossalign's reshard.py):
# the shared expert (SequenceParallel, parallelize.py:1050-1054: "replicated over TP"), the MTP eh_proj
# (SequenceParallel, parallelize.py:1127-1140) and, at TP without EP, the routed experts (Replicate,
# parallelize.py:1040-1047). At EP both split the experts alike and hold everything else whole.
WHOLE_IN_MINDFORMERS = {
    ("qwen35_dense_tiny", "tp2"): r"mtp\.layers\.\d+\.eh_proj\.weight",
    ("qwen35_moe_tiny", "tp2"): r"mtp\.layers\.\d+\.eh_proj\.weight|.*mlp\.shared_experts\.linear_fc[12]\.weight"
                                r"|.*mlp\.experts\.weight[12]",
    ("qwen35_moe_tiny", "ep2"): r"$^",
}


def mindformers_placement(name: str, axis: str) -> int | None:
    """The axis MindFormers 2.1.0's pynative plan cuts parameter ``name`` along on mesh ``axis`` (None: Replicate).

    TP (apply_non_moe_tp, parallelize.py:1079 and _apply_layers_tp, :973, also run on the MTP's
    transformer layer): the embedding RowwiseParallel, a VocabEmbedding's Shard(0) (:1097-1103,
    distributed/style.py:933-934); the output layer ColwiseParallel, Shard(0) (:1111, style.py:837-838);
    linear_qkv ColwiseParallel, Shard(0) of its group-interleaved rows (:790-811); linear_proj
    RowwiseParallel, Shard(1) (style.py:927-928); the dense MLP's fc1 Shard(0) and fc2 Shard(1)
    (:963-970); norms, router, tokens_per_expert, shared experts and the MTP's own modules Replicate.
    EP (apply_moe_ep_tp, :1147, ExpertParallel): the routed experts weight1/weight2 Shard(0) on the expert
    axis (distributed/expert_parallel.py:621-630); everything else Replicate.
    """
    if axis == "ep":
        return 0 if re.fullmatch(r".*mlp\.experts\.weight[12]", name) else None
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0
    if name.endswith(("self_attention.linear_qkv.weight", ".mlp.linear_fc1.weight")):
        return 0
    if name.endswith(("self_attention.linear_proj.weight", ".mlp.linear_fc2.weight")):
        return 1
    return None


# Multi-rank saves as MindFormers writes them (its own ShardedTensors, ReshardLoader slices, file names and
# save_metadata), on 2-D meshes: data parallel x TP with the TP plan above, and (MoE) EP x TP with the routed
# experts cut on two axes at once (on the expert axis over "ep" and on their output axis over "tp"), which
# MindFormers' layout format allows but its pynative plan does not make: it checks the slice numbering of a
# tensor cut along two axes.
SAVES = {"qwen35_dense_tiny": {"dp2xtp2": [["dp", "tp"], [2, 2]]},
         "qwen35_moe_tiny": {"dp2xtp2": [["dp", "tp"], [2, 2]], "ep2xtp2": [["ep", "tp"], [2, 2]]}}


def save_placement(name: str, label: str) -> list:
    """Per tensor axis the mesh axis it is cut along (None: whole) in the ``SAVES`` layout ``label``."""
    ndim = len(mindformers_shapes_or_buffer(name))
    if label == "ep2xtp2" and re.fullmatch(r".*mlp\.experts\.weight[12]", name):
        return ["ep", None, "tp"] if name.endswith("weight1") else ["ep", "tp", None]
    axis = mindformers_placement(name, "tp")
    return ["tp" if a == axis else None for a in range(ndim)]


def fork_only(model: ModelConfig, name: str) -> bool:
    """A GatedDeltaNet layer's mixer parameter: only a fork's Qwen3.5 model has it (see the module docstring)."""
    match = re.match(r"decoder\.layers\.(\d+)\.self_attention\.", name)
    return bool(match) and model.layer_kinds[int(match.group(1))] == "gdn"


def mindformers_shapes_or_buffer(name: str) -> tuple[int, ...]:
    """The shape of a MindFormers weight or buffer of either tiny model."""
    for model_name in MODELS:
        model = load_config(model_name).model
        shapes = {**mindformers_shapes(model), **mindformers_buffers(model)}
        if name in shapes:
            return shapes[name]
    raise KeyError(name)


def seeded_state(model: ModelConfig) -> dict[str, torch.Tensor]:
    """Every MindFormers weight drawn from a seeded normal (norms too, so that no two tensors look alike)."""
    generator = torch.Generator().manual_seed(2026)
    return {name: torch.randn(shape, generator=generator) for name, shape in mindformers_shapes(model).items()}


def expected_slice(rule, mg_state: dict, model: ModelConfig, rank: tuple[int, int, int], tp: int, ep: int,
                   ms_key: str) -> torch.Tensor:
    """Rank ``rank``'s part of MindFormers tensor ``ms_key`` by crossalign's Megatron sharding: the rank's
    shards of the rule's Megatron tensors (``shard_tensor``), taken back through the rule's inverse."""
    shards = [shard for key in rule.target_keys for placed, _, shard in shard_tensor(key, mg_state[key], model, tp, 1, ep)
              if placed == rank]
    inner = rule.rule
    if isinstance(inner, TransposeExperts):  # the rank's local experts, in their global order
        inner = TransposeExperts(inner.source, inner.target, len(shards), inner.per_expert)
    assert not isinstance(inner, Fuse), "only a GatedDeltaNet in_proj fuses; it is left out"
    return inner.inverse(shards)[rule.source_keys.index(ms_key)]


def prepare(name: str, tmp: Path) -> tuple[dict, dict]:
    """One Megatron checkpoint converted by mg2ms for 1 and 2 ranks, and the driver's job on it:
    (what the tests need, the job's parts)."""
    model = load_config(name).model
    weights = seeded_state(model)
    write_mindformers_checkpoint(tmp / "source", 3, weights, None, default_common(3))
    convert_checkpoint(model, "ms2mg", tmp / "source", tmp / "mg")
    roots = {n: tmp / f"ms{n}" for n in (1, RANKS)}
    for n, root in roots.items():
        convert_checkpoint(model, "mg2ms", tmp / "mg", root, tp=n)
    checkpoints = {n: read_mindformers_checkpoint(root) for n, root in roots.items()}
    assert checkpoints[RANKS].world_size == RANKS and checkpoints[1].world_size == 1
    entries = {**checkpoints[1].model_entries(), **checkpoints[1].buffer_entries()}
    params = {key: [list(info.shape), MS_DTYPES[info.dtype]] for key, info in entries.items()}
    resharded = {key: value for key, value in params.items() if not fork_only(model, key)}
    layouts = {label: {"mesh": list(mesh), "dims": {key: mindformers_placement(key, mesh[0]) for key in resharded}}
               for label, mesh in LAYOUTS[name].items()}
    for folder in [f"reshard{n}" for n in roots] + [f"saved-{label}" for label in SAVES[name]]:
        (tmp / folder).mkdir()
    job = {"holder_loads": [{"params": params, "checkpoints": {str(n): str(root) for n, root in roots.items()},
                             "dumps": {str(n): str(tmp / f"loaded{n}.safetensors") for n in roots},
                             "log": f"holder_load_{name}.log"}],
           "reshards": {f"{name}-{n}": {"checkpoint": str(checkpoints[n].directory), "params": resharded,
                                        "layouts": layouts, "out": str(tmp / f"reshard{n}")} for n in roots},
           "metadata": [{"params": params, "mesh": ["tp", RANKS], "prefix": DEFAULT_PREFIX,
                         "dims": {key: mindformers_split_dim(key, tuple(shape)) for key, (shape, _) in params.items()},
                         "path": str(tmp / "mindformers_metadata.json")}],
           "saves": [{"checkpoint": str(checkpoints[1].directory), "params": params, "mesh": mesh,
                      "dims": {key: save_placement(key, label) for key in params}, "prefix": DEFAULT_PREFIX,
                      "out": str(tmp / f"saved-{label}"), "log": f"sharded_save_{name}.log"}
                     for label, mesh in SAVES[name].items()]}
    return {"model": model, "tmp": tmp, "weights": weights, "checkpoints": checkpoints, "layouts": layouts}, job


@pytest.fixture(scope="module", params=RELEASES)
def release(request, tmp_path_factory):
    """Both tiny models prepared, and one run of the release's code on both: {model name: what the tests need}."""
    version = request.param
    tmp = tmp_path_factory.mktemp(f"sharded-{version}")
    prepared, job = {}, {}
    for name in MODELS:
        prepared[name], parts = prepare(name, tmp / name)
        for key, value in parts.items():
            job[key] = {**job.get(key, {}), **value} if isinstance(value, dict) else job.get(key, []) + value
    result, _ = run_driver(version, job, tmp / "work")
    return {name: {**context, "version": version, "work": tmp / "work",
                   "reshards": {n: result["reshards"][f"{name}-{n}"] for n in (1, RANKS)}}
            for name, context in prepared.items()}


@pytest.fixture(params=MODELS)
def loaded(release, request):
    return release[request.param]


def test_mg2ms_refuses_four_ranks_of_the_tiny_models(tmp_path):
    model = load_config("qwen35_dense_tiny").model
    with pytest.raises(CheckpointError, match="tensor parallel size 4 does not divide model.num_query_groups = 2"):
        convert_checkpoint(model, "mg2ms", tmp_path / "mg", tmp_path / "ms4", tp=4)


@pytest.mark.slow
def test_the_two_rank_output_loads_bit_for_bit_as_the_single_rank_one(loaded):
    """(a): load_checkpoint of the 2-rank output into a single-card network equals its load of the
    single-rank output, tensor for tensor and bit for bit, and both are the weights converted."""
    one = load_file(loaded["tmp"] / "loaded1.safetensors")
    two = load_file(loaded["tmp"] / f"loaded{RANKS}.safetensors")
    state = loaded["checkpoints"][1]
    assert set(one) == set(two) == set(state.model_entries()) | set(state.buffer_entries())
    for key in one:
        assert one[key].dtype == two[key].dtype and torch.equal(one[key], two[key]), key
    for key, weight in loaded["weights"].items():
        assert torch.equal(two[key], weight), key
    # the 2-rank output really is cut: most tensors are stored as two slices
    pieces = loaded["checkpoints"][RANKS].pieces
    assert sum(len(p) == RANKS for p in pieces.values()) > len(pieces) // 2
    assert "Loading Checkpoint Finished" in (loaded["work"] / f"holder_load_{loaded['model'].name}.log").read_text()


def test_mindformers_reshards_each_rank_to_crossalign_megatron_slice(loaded):
    """(b): for each layout and rank, ReshardLoader's tensor (from the 1-rank and from the 2-rank output
    alike) is the plain chunk of the tensor along the axis MindFormers' plan cuts, and that chunk is the
    slice crossalign's Megatron sharding gives the rank, except the tensors MindFormers keeps whole."""
    model, tmp, weights = loaded["model"], loaded["tmp"], loaded["weights"]
    mg_state = mindformers_to_megatron(weights, model)
    rules = {key: rule for rule in conversion_plan(model) for key in rule.source_keys}
    full = loaded["checkpoints"][1]
    for label, spec in loaded["layouts"].items():
        alias, size = spec["mesh"]
        whole = set()
        for rank in range(size):
            from_one = load_file(tmp / "reshard1" / f"{label}-{rank}.safetensors")
            from_two = load_file(tmp / f"reshard{RANKS}" / f"{label}-{rank}.safetensors")
            assert set(from_one) == set(from_two) == set(spec["dims"]), label
            megatron_rank = (rank, 0, 0) if alias == "tp" else (0, 0, rank)
            tp, ep = (size, 1) if alias == "tp" else (1, size)
            for key, dim in spec["dims"].items():
                assert torch.equal(from_one[key], from_two[key]), (label, rank, key)
                tensor = full.tensor(key)
                chunk = tensor if dim is None else tensor.chunk(size, dim=dim)[rank]
                assert torch.equal(from_two[key], chunk), (label, rank, key)
                if key not in rules:  # a buffer (tokens_per_expert): no Megatron tensor
                    assert dim is None, key
                    continue
                expected = expected_slice(rules[key], mg_state, model, megatron_rank, tp, ep, key)
                if not torch.equal(from_two[key], expected):
                    assert dim is None and torch.equal(from_two[key], tensor), (label, rank, key)
                    whole.add(key)
            metas = loaded["reshards"][RANKS][f"{label}-{rank}"]
            assert all(m["axis_fragmentations"] == [size if a == spec["dims"][k] else 1 for a in
                                                     range(len(m["local_shape"]))] for k, m in metas.items())
        pattern = WHOLE_IN_MINDFORMERS[(model.name, label)]
        assert whole == {key for key in spec["dims"] if key in rules and re.fullmatch(pattern, key)}, label
        split = {key for key, dim in spec["dims"].items() if dim is not None}
        assert split and not split & whole, label


def test_the_metadata_is_what_mindformers_own_save_writes_and_each_reads_the_other(loaded, tmp_path):
    """(c): crossalign's metadata.json for the 2-rank output is the one MindFormers' own save path
    (``save_metadata`` on every rank's ShardedTensors of a 2-rank "tp" mesh cut as mindformers_split_dim
    cuts) writes, and crossalign's reader reads the output with MindFormers' file as with its own."""
    ours = loaded["checkpoints"][RANKS]
    theirs = json.loads((loaded["tmp"] / "mindformers_metadata.json").read_text())
    assert json.loads((ours.directory / METADATA).read_text()) == theirs
    copy = tmp_path / ours.directory.name
    shutil.copytree(ours.directory, copy)
    (copy / METADATA).write_text(json.dumps(theirs))
    reread = read_mindformers_checkpoint(copy)
    for key, weight in loaded["weights"].items():
        assert torch.equal(reread.tensor(key), weight), key


def test_crossalign_reads_multi_rank_saves_as_mindformers_writes_them(loaded):
    """(d): a 4-rank save on each ``SAVES`` mesh, each file holding one rank's local tensors and
    metadata.json from MindFormers' own save_metadata, is read by crossalign as the weights."""
    for label in SAVES[loaded["model"].name]:
        saved = read_mindformers_checkpoint(loaded["tmp"] / f"saved-{label}")
        assert saved.world_size == 4, label
        for key, weight in loaded["weights"].items():
            assert torch.equal(saved.tensor(key), weight), (label, key)
        buffers = loaded["checkpoints"][1].buffer_state()
        assert set(saved.buffer_entries()) == set(buffers), label
        for key, buffer in buffers.items():
            assert torch.equal(saved.tensor(key), buffer), (label, key)
        cut_twice = [key for key, pieces in saved.pieces.items() if len(pieces) == 4]
        assert bool(cut_twice) == (label == "ep2xtp2"), (label, cut_twice)
