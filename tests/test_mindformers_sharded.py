"""MindFormers' own checkpoint loader (the 2.0.0 and 2.1.0 wheels) on crossalign's multi-rank MindFormers output.

mg2ms ``--tp N`` writes the MindFormers checkpoint as N ranks save it: one
``<prefix>-model-<rank>-<N>.safetensors`` each and ``metadata.json``
(``crossalign/checkpoint/mindformers.py``: ``sharded_metadata``, storage slices by
``mindformers_split_dim``). Two things are held against MindFormers' code, run in a subprocess
(tests/mindformers_upstream.py, tests/mindformers_driver.py):

- (a) its ``load_checkpoint`` (2.1.0 ``checkpoint/checkpoint.py:555``, 2.0.0 ``:469``) loads the
  N-rank output into a single-card pynative network bit for bit as it loads the single-rank output
  of the same Megatron checkpoint (and both equal the weights);
- (b) for a target layout (TP 2; EP 2 for MoE) its ``ReshardLoader``, given rank r's destination
  ShardedTensors built by its own ``get_sharded_tensor_from_strategy_metadata``, gives each rank
  exactly the slice that crossalign's Megatron sharding (``checkpoint/reshard.py: shard_tensor``,
  then the MindFormers side of the tensor's conversion rule) gives that rank, or the whole tensor
  where MindFormers' plan keeps a tensor whole that Megatron splits (named below).

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

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from crossalign.checkpoint.convert import convert_checkpoint
from crossalign.checkpoint.convert_core import mindformers_to_megatron
from crossalign.checkpoint.errors import CheckpointError
from crossalign.checkpoint.layout import mindformers_shapes
from crossalign.checkpoint.mindformers import default_common, read_mindformers_checkpoint, write_mindformers_checkpoint
from crossalign.checkpoint.reshard import shard_tensor
from crossalign.checkpoint.rules import Fuse, TransposeExperts, conversion_plan
from crossalign.config import ModelConfig, load_config
from mindformers_upstream import RELEASES, run_driver

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


def fork_only(model: ModelConfig, name: str) -> bool:
    """A GatedDeltaNet layer's mixer parameter: only a fork's Qwen3.5 model has it (see the module docstring)."""
    match = re.match(r"decoder\.layers\.(\d+)\.self_attention\.", name)
    return bool(match) and model.layer_kinds[int(match.group(1))] == "gdn"


def seeded_state(model: ModelConfig) -> dict[str, torch.Tensor]:
    """Every MindFormers weight drawn from a seeded normal (norms too, so that no two tensors look alike)."""
    generator = torch.Generator().manual_seed(2026)
    return {name: torch.randn(shape, generator=generator) for name, shape in mindformers_shapes(model).items()}


def expected_slice(rule, mg_state: dict, model: ModelConfig, rank: tuple[int, int, int], tp: int, ep: int,
                   ms_key: str) -> torch.Tensor:
    """Rank ``rank``'s part of MindFormers tensor ``ms_key`` by crossalign's Megatron sharding: the rank's
    shards of the rule's Megatron tensors (``shard_tensor``), taken back through the rule's inverse."""
    shards = [shard for key in rule.mg_keys for placed, _, shard in shard_tensor(key, mg_state[key], model, tp, 1, ep)
              if placed == rank]
    inner = rule.rule
    if isinstance(inner, TransposeExperts):  # the rank's local experts, in their global order
        inner = TransposeExperts(inner.source, inner.target, len(shards), inner.per_expert)
    assert not isinstance(inner, Fuse), "only a GatedDeltaNet in_proj fuses; it is left out"
    return inner.inverse(shards)[rule.ms_keys.index(ms_key)]


@pytest.fixture(scope="module", params=[(v, m) for v in RELEASES for m in MODELS], ids=lambda p: f"{p[0]}-{p[1]}")
def loaded(request, tmp_path_factory):
    """One Megatron checkpoint converted by mg2ms for 1 and 2 ranks, then loaded and resharded by MindFormers."""
    version, name = request.param
    model = load_config(name).model
    tmp = tmp_path_factory.mktemp(f"sharded-{version}-{name}")
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
    for n in roots:
        (tmp / f"reshard{n}").mkdir()
    job = {"holder_load": {"params": params, "checkpoints": {str(n): str(root) for n, root in roots.items()},
                           "dumps": {str(n): str(tmp / f"loaded{n}.safetensors") for n in roots}},
           "reshards": {str(n): {"checkpoint": str(checkpoints[n].directory), "params": resharded,
                                 "layouts": layouts, "out": str(tmp / f"reshard{n}")} for n in roots}}
    result, _ = run_driver(version, job, tmp / "work")
    return {"version": version, "model": model, "tmp": tmp, "weights": weights, "checkpoints": checkpoints,
            "result": result, "layouts": layouts, "work": tmp / "work"}


def test_mg2ms_refuses_four_ranks_of_the_tiny_models(tmp_path):
    model = load_config("qwen35_dense_tiny").model
    with pytest.raises(CheckpointError, match="tensor parallel size 4 does not divide model.num_query_groups = 2"):
        convert_checkpoint(model, "mg2ms", tmp_path / "mg", tmp_path / "ms4", tp=4)


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
    assert "Loading Checkpoint Finished" in (loaded["work"] / "holder_load.log").read_text()


def test_mindformers_reshards_each_rank_to_crossalign_megatron_slice(loaded):
    """(b): for each layout and rank, ReshardLoader's tensor (from the 1-rank and from the 2-rank output
    alike) is the plain chunk of the tensor along the axis MindFormers' plan cuts, and that chunk is the
    slice crossalign's Megatron sharding gives the rank, except the tensors MindFormers keeps whole."""
    model, tmp, weights = loaded["model"], loaded["tmp"], loaded["weights"]
    mg_state = mindformers_to_megatron(weights, model)
    rules = {key: rule for rule in conversion_plan(model) for key in rule.ms_keys}
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
            metas = loaded["result"]["reshards"][str(RANKS)][f"{label}-{rank}"]
            assert all(m["axis_fragmentations"] == [size if a == spec["dims"][k] else 1 for a in
                                                     range(len(m["local_shape"]))] for k, m in metas.items())
        pattern = WHOLE_IN_MINDFORMERS[(model.name, label)]
        assert whole == {key for key in spec["dims"] if key in rules and re.fullmatch(pattern, key)}, label
        split = {key for key, dim in spec["dims"].items() if dim is not None}
        assert split and not split & whole, label
