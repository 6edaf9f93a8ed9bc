"""``crossalign diagnose --npu-dump --gpu-dump`` on dumps of both EMBEDDED trainers, written by msprobe's own
PrecisionDebugger: the MindSpore trainer at TP 1 against megatron-core at TP 2 x EP 2 (ETP 1, sequence parallel),
each rank of the Megatron side dumping its own shards (``tests/helpers/embedded_msprobe_dumps.py``).

Task ``tensor``: the diagnosis merges the Megatron side's TP and EP shards into whole tensors and compares them by
msprobe's metrics (Cosine and the error ratios); shard statistics merge only into max, min and norm, which cannot
name a fault that moves rows within a tensor (in_proj's order) at its weight.

The MindSpore side does not depend on the Megatron layout or the fault: it runs once, and every fault's pair reuses
its dump (``npu_of``). ``scripts/msprobe_fault_matrix.py`` runs every fault of ``checkpoint/faults.py`` the same way.
"""

from __future__ import annotations

import json

import pytest

from crossalign.diagnose.msprobe_match import _module_of_key
from crossalign.diagnose.msprobe_run import diagnose_msprobe
from tests.helpers.embedded_msprobe_dumps import embedded_dump_pair

pytest.importorskip("msprobe")

NAME = "qwen35_moe_tiny"
# fault -> the module its forward first diverges at, and the weight it shows at first, before any activation
FAULTS = {
    "in_proj_wrong_order": ("decoder.layers.0.self_attention.in_proj",
                            "decoder.layers.0.self_attention.in_proj.weight"),  # a fused GDN weight, TP-split segments
    # routed experts, split over the EP ranks: MindSpore's MoE cell holds them stacked, its first pair is the MoE layer
    "routed_expert_not_transposed": ("decoder.layers.0.mlp", "decoder.layers.0.mlp.experts.linear_fc1.weight0"),
    # a layout fault: EP rank 1's files hold its experts under global numbers, its first (global 2) keeps its
    # initial values
    "experts_not_renumbered": ("decoder.layers.0.mlp", "decoder.layers.0.mlp.experts.linear_fc1.weight2"),
}
# Megatron modules no MindSpore cell computes: wrappers, the local experts and router inside the routed experts'
# cell, conv1d and core attention inside MindSpore's fused mixers, the embedding's inner modules, and the norm
# Megatron keeps in front of a cross attention it does not have
UNPAIRED_MEGATRON = ("", "decoder", "mtp", "rotary_pos_emb", "embedding.word_embeddings", "embedding.embedding_dropout",
                     "cross_attention", "cross_attn_bda", "pre_cross_attn_layernorm", "mlp.router", "conv1d",
                     "core_attention", "core_attention.attention_dropout", "core_attention.scale_mask_softmax")


def _expected_unpaired(name: str) -> bool:
    module = name.split(" (")[0]
    return module in UNPAIRED_MEGATRON or module.endswith(UNPAIRED_MEGATRON[3:]) or ".mlp.experts.local_experts." \
        in module


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return embedded_dump_pair(NAME, tmp_path_factory.mktemp("clean"), task="tensor")


@pytest.mark.slow
def test_a_clean_pair_at_tp1_against_tp2_ep2_shows_no_divergence_and_lists_every_pair(clean, tmp_path):
    result = diagnose_msprobe(clean.npu, clean.gpu, clean.config, tmp_path / "out", precision="fp32")
    diagnosis = result.diagnosis
    assert not diagnosis.diverged, diagnosis.hint()
    assert {row.section for row in diagnosis.rows if row.status == "ok"} == {"weights", "forward", "backward",
                                                                              "weight gradients"}
    # every Megatron module the dump holds is either paired or named unpaired, with a reason
    paired = {megatron for _, megatron in diagnosis.mapped}
    unpaired = {name.split(" (")[0] for name in diagnosis.unmapped_megatron}
    dumped = {entry.name for entry in result.gpu.entries.values() if entry.is_module}
    assert dumped == paired | unpaired
    assert [name for name in diagnosis.unmapped_megatron if not _expected_unpaired(name)] == []
    assert all(" (its parameters go to " in name or " (its norm is fused into " in name
               for name in diagnosis.unmapped_mindspore), diagnosis.unmapped_mindspore
    for layer in range(clean.config.model.num_layers):
        for module in ("input_layernorm", "pre_mlp_layernorm", "mlp.experts", "mlp.shared_experts.linear_fc1", "mlp"):
            name = f"decoder.layers.{layer}.{module}"
            assert (name, name) in diagnosis.mapped
    assert ("decoder.layers.0.self_attention.linear_proj", "decoder.layers.0.self_attention.out_proj") \
        in diagnosis.mapped
    layouts = json.loads(result.files["msprobe_summary.json"].read_text())["layouts"]
    assert layouts["mindformers"].startswith("TP 1") and layouts["megatron"].startswith("TP 2"), layouts


@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_fault_is_named_at_its_module_across_layouts(clean, fault, tmp_path):
    module, weight = FAULTS[fault]
    pair = embedded_dump_pair(NAME, tmp_path / "pair", task="tensor", fault=fault, npu_of=clean)
    assert pair.npu == clean.npu  # the MindSpore trainer did not run again
    diagnosis = diagnose_msprobe(pair.npu, pair.gpu, pair.config, tmp_path / "out", precision="fp32").diagnosis
    forward = diagnosis.first["forward"]
    assert forward is not None and _module_of_key(forward.megatron).startswith(module), diagnosis.hint()
    assert forward.input_status != "differs"
    first = diagnosis.first_divergence
    assert (first.section, first.megatron) == ("weights", weight), diagnosis.hint()
    assert any(fault in cause.faults for cause in diagnosis.causes), diagnosis.hint()


@pytest.mark.slow
def test_a_renamed_tensor_stops_megatron_cores_strict_load_on_each_rank_naming_it(clean, tmp_path):
    """a_log under its MindSpore name has no place in the TP 2 x EP 2 rank files: each rank cuts its part from the
    one-rank file and its strict load names the key, as Megatron-LM's load does; no dump is taken."""
    with pytest.raises(RuntimeError, match=r"does not load the checkpoint: .*missing keys: "
                                           r"decoder\.layers\.0\.self_attention\.A_log.*unexpected keys: "
                                           r"decoder\.layers\.0\.self_attention\.a_log"):
        embedded_dump_pair(NAME, tmp_path / "pair", task="tensor", fault="a_log_not_renamed", npu_of=clean)
    assert not (tmp_path / "pair" / "megatron" / "msprobe_dump").exists()
