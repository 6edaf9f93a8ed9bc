"""``crossalign diagnose --npu-dump --gpu-dump`` on dumps of both EMBEDDED trainers, written by msprobe's own
PrecisionDebugger: the MindSpore trainer at TP 1 against megatron-core at TP 2 x EP 2 (ETP 1, sequence parallel),
each rank of the Megatron side dumping its own shards (``tests/helpers/embedded_msprobe_dumps.py``).

Task ``tensor``: the diagnosis merges the Megatron side's TP and EP shards into whole tensors and compares them by
msprobe's metrics (Cosine and the error ratios); shard statistics merge only into max, min and norm, which cannot
name a fault that moves rows within a tensor (in_proj's order) at its weight.

The MindSpore side does not depend on the Megatron layout or the fault: it runs once, and every fault's pair reuses
its dump (``npu_of``). ``scripts/msprobe_fault_matrix.py`` runs every fault of ``checkpoint/faults.py`` the same way.

Before anything is compared, each side is held against the config (``diagnose/msprobe_fit.py``) and the dump records
the trainers write beside msprobe's files against each other (``diagnose/msprobe_records.py``): a dump that does not
fit is refused with exit 2, naming what it implies, and nothing is written.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from crossalign.cli import app
from crossalign.config import AlignmentConfig
from crossalign.diagnose.msprobe_match import _module_of_key
from crossalign.diagnose.msprobe_run import diagnose_msprobe
from crossalign.dump_settings import RECORD_FILE
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


# ---- dumps held against the config before anything is compared ------------------------------------------------


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """The dense config's pair, megatron-core at TP 2 (statistics: refused before any tensor is read)."""
    return embedded_dump_pair("qwen35_dense_tiny", tmp_path_factory.mktemp("dense"), task="statistics")


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """The dense config's pair, megatron-core at PP 2 (rank 1 holds layers 2-3, its own numbers 0-1)."""
    return embedded_dump_pair("qwen35_dense_tiny", tmp_path_factory.mktemp("pp2"), task="tensor",
                              megatron={"pipeline": 2, "cards_per_node": 2})


def _config_file(config: AlignmentConfig, path: Path, megatron: dict | None = None, **sections) -> Path:
    """``config`` as a YAML file, its Megatron layout replaced by ``megatron`` where given."""
    raw = config.model_dump(mode="json", exclude_none=True)
    if megatron is not None:
        raw["parallel"]["megatron"] = megatron
    for section, fields in sections.items():
        raw[section].update(fields)
    path.write_text(yaml.safe_dump(raw))
    return path


def _without_records(dump: Path, to: Path) -> Path:
    """A copy of a dump as a user's own msprobe run leaves it: msprobe's files only."""
    return Path(shutil.copytree(dump, to, ignore=shutil.ignore_patterns(RECORD_FILE)))


def _diagnose_cli(config: Path, npu: Path, gpu: Path, out: Path, *options: str):
    result = CliRunner().invoke(app, ["diagnose", "--model", str(config), "--npu-dump", str(npu), "--gpu-dump",
                                      str(gpu), "--out", str(out), *options])
    return result, " ".join(result.output.split())


def _refused(config: Path, npu: Path, gpu: Path, out: Path, *expected: str) -> str:
    result, text = _diagnose_cli(config, npu, gpu, out)
    assert result.exit_code == 2, result.output
    for part in expected:
        assert part in text, text
    assert not out.exists()  # nothing written
    return text


ONE_CARD = {"tensor": 1, "cards_per_node": 1}


@pytest.mark.slow
def test_a_tp2_ep2_dump_given_with_a_one_card_config_is_refused_naming_what_does_not_fit(clean, tmp_path):
    """The dump's own shards tell its layout (a user's dump has no record); the --set options the refusal names
    make the config fit, and the pair then compares clean."""
    one_card = _config_file(clean.config, tmp_path / "one_card.yaml", ONE_CARD)
    npu, gpu = _without_records(clean.npu, tmp_path / "npu"), _without_records(clean.gpu, tmp_path / "gpu")
    settings = ("--set parallel.megatron.tensor=2 --set parallel.megatron.expert=2 "
                "--set parallel.megatron.sequence_parallel=true --set parallel.megatron.expert_tensor=1 "
                "--set parallel.megatron.cards_per_node=2")
    _refused(one_card, npu, gpu, tmp_path / "out",
             f"--gpu-dump {gpu / 'step0'}: the Megatron dump does not fit the config's layout parallel.megatron "
             f"(TP 1 x PP 1 (DP 1) on 1 x 1 cards). It implies TP 2 x PP 1 x EP 2 x ETP 1 + SP on 2 cards: 2 rank "
             f"folders (rank0, rank1)", "rank0 embedding.word_embeddings.weight is [1024, 64] of the model's "
             "[2048, 64]: TP 2", "rank0 holds 2 of the 4 routed experts of decoder.layers.0: EP 2",
             "rank1 is not a rank of the config's layout (1 card)", f"Pass {settings}")
    result, text = _diagnose_cli(one_card, npu, gpu, tmp_path / "fits", *settings.split())
    assert result.exit_code == 0, text
    assert "no weight, activation or gradient differs" in text
    assert "has no dump record (crossalign_dump.json): which run wrote it, and with which config, could not be " \
           "checked" in text
    # with the records the trainers wrote: the same refusal, and the record's layout is the one the options state
    _refused(one_card, clean.npu, clean.gpu, tmp_path / "recorded", "the Megatron dump does not fit", settings)


@pytest.mark.slow
@pytest.mark.parametrize("megatron, expected", [
    # the expert tensor size unset: Megatron takes the tensor size, 2 (on 4 cards: ETP 2 x EP 2); the dump's experts
    # are whole (ETP 1)
    ({"tensor": 2, "expert": 2, "sequence_parallel": True, "cards_per_node": 4},
     ["rank0 decoder.layers.0.mlp.experts.linear_fc1.weight0 is [64, 64] of the model's [64, 64]: ETP 1",
      "Pass --set parallel.megatron.expert_tensor=1"]),
    # no expert parallelism: each rank would hold all 4 routed experts
    ({"tensor": 2, "sequence_parallel": True, "cards_per_node": 2},
     ["rank0 holds 2 routed experts in decoder.layers.0; the layout gives it 4", "Pass --set parallel.megatron.expert=2"]),
])
def test_a_dump_whose_expert_layout_the_config_does_not_state_is_refused(clean, tmp_path, megatron, expected):
    batch = {"global_batch_size": megatron["cards_per_node"] // megatron["tensor"]}  # a micro batch per replica
    config = _config_file(clean.config, tmp_path / "config.yaml", megatron, training=batch)
    npu, gpu = _without_records(clean.npu, tmp_path / "npu"), _without_records(clean.gpu, tmp_path / "gpu")
    _refused(config, npu, gpu, tmp_path / "out", "the Megatron dump does not fit the config's layout", *expected)


@pytest.mark.slow
def test_a_dense_dump_given_with_the_moe_config_is_refused_as_different_models(clean, dense, tmp_path):
    moe = _config_file(clean.config, tmp_path / "moe.yaml", ONE_CARD)
    text = _refused(moe, dense.npu, dense.gpu, tmp_path / "out",
                    f"--npu-dump {dense.npu / 'step0'} is not a dump of the config's model qwen35_moe_tiny (MoE, 4 "
                    "experts, 4 layers, hidden 64): rank0 holds parameters the model does not have:",
                    f"--gpu-dump {dense.gpu / 'step0'} is not a dump of the config's model qwen35_moe_tiny",
                    "decoder.layers.0.mlp.linear_fc1.weight [192, 64]", ": different models")
    assert "likely" not in text and "conversion" not in text  # no diagnosis of a pair that is not one


@pytest.mark.slow
def test_a_dump_of_another_width_or_depth_is_refused_as_different_models(dense, tmp_path):
    """The dense dump against its config with a wider FFN (a width no layout splits differently from the rest)
    and with more layers (its first rank holds both ends of the model and 4 layers)."""
    dense_tp2 = dense.config.parallel.megatron.model_dump(mode="json", exclude_none=True)
    wider = _config_file(dense.config, tmp_path / "wider.yaml", dense_tp2, model={"ffn_hidden_size": 384})
    _refused(wider, dense.npu, dense.gpu, tmp_path / "out", "is not a dump of the config's model",
             "decoder.layers.0.mlp.linear_fc1.weight [384, 64] of [768, 64] (1/2)", "widths of another model")
    deeper = _config_file(dense.config, tmp_path / "deeper.yaml", dense_tp2, model={"num_layers": 8})
    _refused(deeper, dense.npu, dense.gpu, tmp_path / "out2", "holds the first pipeline stage and the final norm "
             "(the last stage) and 4 decoder layers: a model of 4 layers, the config's has 8", ": different models")


@pytest.mark.slow
def test_settings_whose_dumps_are_not_merged_are_refused_by_name(clean, tmp_path):
    config = _config_file(clean.config, tmp_path / "cp.yaml", parallel={"mindformers": {
        "context": 2, "cards_per_node": 2}})
    _refused(config, clean.npu, clean.gpu, tmp_path / "out", "parallel.mindformers.context is 2: context-parallel "
             "dumps are not merged")


# ---- which run wrote each rank folder ---------------------------------------------------------------------------


def _rewrite_record(path: Path, **fields) -> None:
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, **fields}))


@pytest.mark.slow
def test_rank_folders_and_sides_from_different_runs_are_refused(clean, tmp_path):
    config = _config_file(clean.config, tmp_path / "config.yaml")
    mixed = Path(shutil.copytree(clean.gpu, tmp_path / "mixed"))
    _rewrite_record(mixed / "step0" / "rank1" / RECORD_FILE, run_id="another-run")
    _refused(config, clean.npu, mixed, tmp_path / "out", f"--gpu-dump {mixed / 'step0'}: rank1 and rank0 come from "
             "different runs (their records differ in run_id: run_id 'another-run' vs 'qwen35_moe_tiny-11')")
    half = Path(shutil.copytree(clean.gpu, tmp_path / "half"))
    (half / "step0" / "rank1" / RECORD_FILE).unlink()
    _refused(config, clean.npu, half, tmp_path / "out", "rank1 has no dump record (crossalign_dump.json) beside "
             "msprobe's files while rank0 has one: not written by one run")
    other = Path(shutil.copytree(clean.gpu, tmp_path / "other"))
    for rank in ("rank0", "rank1"):
        _rewrite_record(other / "step0" / rank / RECORD_FILE, run_id="another-run")
    _refused(config, clean.npu, other, tmp_path / "out", f"was written by run 'qwen35_moe_tiny-11' and --gpu-dump "
             f"{other / 'step0'} by run 'another-run': compare the two sides of one run")


@pytest.mark.slow
def test_records_of_a_layout_the_config_does_not_state_are_refused(clean, tmp_path):
    """What the shards cannot show, the records do: the run's two ranks were dumped from a run on 2 x 2 cards."""
    config = _config_file(clean.config, tmp_path / "config.yaml")
    wider = Path(shutil.copytree(clean.gpu, tmp_path / "wider"))
    for rank in ("rank0", "rank1"):
        layout = json.loads((wider / "step0" / rank / RECORD_FILE).read_text())["layout"]
        _rewrite_record(wider / "step0" / rank / RECORD_FILE, layout={**layout, "nodes": 2})
    _refused(config, clean.npu, wider, tmp_path / "out", f"--gpu-dump {wider / 'step0'}: its record says it was "
             "dumped in the layout parallel.megatron", "which the config does not state: pass --set "
             "parallel.megatron.nodes=2")


@pytest.mark.slow
def test_records_of_another_model_config_are_refused_and_of_other_training_settings_noted(clean, tmp_path):
    other_model = _config_file(clean.config, tmp_path / "model.yaml", model={"norm_topk_prob": False})
    _refused(other_model, clean.npu, clean.gpu, tmp_path / "out", "its record says it was trained with another "
             "model config", "give the config the run trained with")
    other_seed = _config_file(clean.config, tmp_path / "seed.yaml", training={"seed": 99})
    result, text = _diagnose_cli(other_seed, clean.npu, clean.gpu, tmp_path / "seed")
    assert result.exit_code == 0, text
    assert "was trained with a config (digest" in text and "differs from the one given outside its model and " \
           "layouts" in text


# ---- msprobe's own compare, on every rank pair it takes --------------------------------------------------------


def _msprobe_compare(npu_json: Path, gpu_json: Path, mapping: Path, out: Path) -> list[dict]:
    """msprobe's compare (its CLI) of two rank folders' dump.json, paired by ``mapping``: the rows it paired."""
    import pandas as pd

    out.mkdir(parents=True)
    run = subprocess.run([str(Path(sys.executable).with_name("msprobe")), "compare", "-tp", str(npu_json), "-gp",
                          str(gpu_json), "-o", str(out), "-dm", str(mapping)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (table,) = out.glob("compare_result_*.csv")
    rows = pd.read_csv(table, keep_default_na=False)
    return [row for row in rows.to_dict("records") if row["Bench Name"] != "N/A"]


def _every_pair_passes_msprobes_rule(result, npu: Path, gpu: Path, tmp_path: Path) -> dict[str, int]:
    """Each rank pair's data_mapping.yaml, given to msprobe's own compare of those two rank folders: every tensor it
    pairs has the same shape (size-1 axes aside) and passes msprobe's own rule. Returns the tensors per pair."""
    from msprobe.core.compare.multiprocessing_compute import check_accuracy

    paired = {}
    for npu_folder, gpu_folder, folder in result.mappings.pairs:
        rows = _msprobe_compare(npu / "step0" / npu_folder / "dump.json", gpu / "step0" / gpu_folder / "dump.json",
                                result.files["msprobe_compare"].parent / folder / "data_mapping.yaml",
                                tmp_path / folder)
        failed = [row["NPU Name"] for row in rows if check_accuracy(row["Cosine"], row["MaxAbsErr"]) != "Yes"]
        assert rows and not failed, (folder, failed)
        paired[f"{npu_folder}-{gpu_folder}"] = len(rows)
    return paired


@pytest.mark.slow
def test_every_rank_pair_gets_msprobes_mapping_files_and_msprobe_passes_them(clean, tmp_path):
    """One MindSpore rank against megatron-core's two: msprobe's compare of the two step folders refuses different
    numbers of ranks, so each dump.json pair is compared alone, rank0 against each Megatron rank. Each pair's file
    maps only what is the same tensor on those two ranks (here the weights every rank holds whole)."""
    result = diagnose_msprobe(clean.npu, clean.gpu, clean.config, tmp_path / "out")
    assert [(n, g) for n, g, _ in result.mappings.pairs] == [("rank0", "rank0"), ("rank0", "rank1")]
    assert not result.mappings.distributed
    paired = _every_pair_passes_msprobes_rule(result, clean.npu, clean.gpu, tmp_path)
    assert paired["rank0-rank0"] == paired["rank0-rank1"] > 0
    summary = json.loads(result.files["msprobe_summary.json"].read_text())
    assert [p["files"] for p in summary["msprobe_compare"]["rank_pairs"]] == [
        "msprobe_compare/npu_rank0-gpu_rank0", "msprobe_compare/npu_rank0-gpu_rank1"]


@pytest.mark.slow
def test_a_pipeline_parallel_dump_compares_clean_and_maps_each_stage_for_msprobe(pipeline, tmp_path):
    """PP 2: each stage numbers its layers from 0; the merge and each rank pair's mapping number them as the stage
    does, and the calls of the output layer (the main model's and the MTP block's, in another order on each side)
    are paired as the comparison pairs them. Given as one card, the dump is refused naming PP 2."""
    result = diagnose_msprobe(pipeline.npu, pipeline.gpu, pipeline.config, tmp_path / "out")
    assert not result.diagnosis.diverged, result.diagnosis.hint()
    paired = _every_pair_passes_msprobes_rule(result, pipeline.npu, pipeline.gpu, tmp_path)
    assert paired["rank0-rank1"] > paired["rank0-rank0"] > 0  # the last stage also holds the output layer and MTP
    one_card = _config_file(pipeline.config, tmp_path / "one_card.yaml", {"cards_per_node": 1})
    _refused(one_card, _without_records(pipeline.npu, tmp_path / "npu"),
             _without_records(pipeline.gpu, tmp_path / "gpu"), tmp_path / "refused",
             "It implies TP 1 x PP 2 on 2 cards", "rank0 holds 2 of the 4 decoder layers and not the final norm: PP 2",
             "Pass --set parallel.megatron.pipeline=2 --set parallel.megatron.cards_per_node=2")


@pytest.mark.slow
def test_mixed_precision_takes_the_looser_sides_thresholds_and_says_so(clean, tmp_path):
    """megatron-core computing in bf16 (fp32 main weights) against the MindSpore trainer in fp32: --precision auto
    reads both dumps' dtypes and takes bf16's thresholds, the looser side's, saying why."""
    pair = embedded_dump_pair(NAME, tmp_path / "pair", task="tensor", npu_of=clean,
                              settings=("training.embedded_precision=bf16",))
    npu, gpu = _without_records(pair.npu, tmp_path / "npu"), _without_records(pair.gpu, tmp_path / "gpu")
    result = diagnose_msprobe(npu, gpu, pair.config, tmp_path / "out")
    chosen = result.diagnosis.precision
    assert chosen.precision == "bf16", chosen.reason
    assert "mixed precision" in chosen.reason and "the looser side's thresholds, bf16's (Megatron)" in chosen.reason
    assert "the MindFormers dump records float32 only" in chosen.reason
    assert "the Megatron dump records bfloat16" in chosen.reason
    summary = json.loads(result.files["msprobe_summary.json"].read_text())
    assert summary["thresholds"]["precision"] == "bf16" and summary["thresholds"]["why"] == chosen.reason
