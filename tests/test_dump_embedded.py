"""Both embedded trainers dump through msprobe's own PrecisionDebugger when the run's dump setting is on: the
MindSpore trainer in one process (``rank0``), megatron-core in its Megatron layout (one ``rank{R}`` per gloo
rank). The dumps are msprobe's writer's, read back by crossalign's reader; the numbers are the runs' own."""

from __future__ import annotations

import math

import numpy as np
import pytest

from crossalign.diagnose.msprobe_dump import read_dump
from crossalign.config import load_config
from crossalign.dump_settings import RECORD_FILE, DumpRecord, DumpSettings, DumpStepError, write_msprobe_config
from crossalign.sides.mindformers.checkpoint import read_mindformers_checkpoint
from tests.helpers.embedded_msprobe_dumps import embedded_dump_pair


@pytest.mark.slow
def test_a_moe_run_dumps_mindspore_at_tp1_and_megatron_core_at_tp2_ep2(tmp_path):
    pair = embedded_dump_pair("qwen35_moe_tiny", tmp_path, task="statistics")
    npu, gpu = read_dump(pair.npu), read_dump(pair.gpu)
    assert (npu.framework, npu.step, sorted(npu.ranks)) == ("mindspore", 0, [0])
    assert (gpu.framework, gpu.step, sorted(gpu.ranks)) == ("pytorch", 0, [0, 1])  # TP 2 x EP 2 on 2 ranks

    # the embedding output of the batch, from the checkpoint itself: MindSpore's whole, Megatron's sequence shards
    state = read_mindformers_checkpoint(tmp_path / "mindformers").model_state()
    table = np.asarray(state["embedding.word_embeddings.weight"], dtype=np.float64)
    tokens = np.load(tmp_path / "batches.npy")[0][:, :-1]
    expected = table[tokens]
    (ms_out,) = npu.ranks[0].entries["Cell.embedding.Embedding.forward.0"].outputs
    assert ms_out.shape == (1, 16, 64)
    assert ms_out.stats["Max"] == pytest.approx(expected.max(), rel=1e-6)
    assert ms_out.stats["Norm"] == pytest.approx(np.linalg.norm(expected), rel=1e-5)
    shards = [rank.entries["Module.0.module.embedding.LanguageModelEmbedding.forward.0"].outputs[0]
              for rank in gpu.ranks.values()]
    assert [shard.shape for shard in shards] == [(8, 1, 64), (8, 1, 64)]  # [s/TP, b, h] under sequence parallel
    assert max(shard.stats["Max"] for shard in shards) == pytest.approx(expected.max(), rel=1e-6)
    assert math.hypot(*(shard.stats["Norm"] for shard in shards)) == pytest.approx(np.linalg.norm(expected), rel=1e-5)

    # each rank folder holds the record of the run beside msprobe's files, with its own rank and its side's layout
    for dump, side, section in ((npu, "mindformers", pair.config.parallel.mindformers),
                                (gpu, "megatron", pair.config.parallel.megatron)):
        for rank, folder in dump.ranks.items():
            record = DumpRecord.model_validate_json((folder.path / RECORD_FILE).read_text())
            assert (record.run_id, record.step, record.side, record.rank) == ("qwen35_moe_tiny-11", 0, side, rank)
            assert record.layout == section.model_dump(mode="json")
            assert record == DumpRecord.of(pair.config, side, "qwen35_moe_tiny-11", 0).model_copy(update={"rank": rank})

    # forward and backward of the routed experts on every expert rank, and of the MindSpore cells
    for rank in gpu.ranks.values():
        experts = {entry.direction for entry in rank.entries.values() if entry.name.endswith("mlp.experts")}
        assert experts == {"forward", "backward"}
    assert {entry.direction for entry in npu.ranks[0].entries.values()} >= {"forward", "backward"}


def test_a_dump_step_the_training_never_reaches_is_refused_before_it_starts(tmp_path):
    record = DumpRecord.of(load_config("qwen35_dense_tiny"), "megatron", "r1", 3)
    with pytest.raises(DumpStepError, match=r"diagnose.dump.step: 3 .* 3 iterations"):
        write_msprobe_config(DumpSettings(step=3), tmp_path, iterations=3, record=record)
    assert not list(tmp_path.iterdir())


def test_a_training_that_left_no_dump_of_its_step_is_named(tmp_path):
    from crossalign.dump_settings import DumpMissingError, collected_dump

    (tmp_path / "msprobe_dump" / "step0" / "rank0").mkdir(parents=True)  # msprobe made the folder, wrote nothing
    with pytest.raises(DumpMissingError, match=r"msprobe_dump/step0: .* dump of step 0 on ranks \[3\] .* no rank"):
        collected_dump(DumpSettings(step=0, ranks=(3,)), tmp_path)


def test_a_rerun_with_dump_records_which_trainings_dump_and_a_plain_rerun_clears_it(tmp_path):
    """What ``crossalign rerun --dump`` (and the rerun deployment's ``dump``) leaves in run.json for the workers, and
    what the training step then takes: the request, else the site's diagnose.dump."""
    from crossalign.config import load_config
    from crossalign.dag import downstream
    from crossalign.site import SiteConfig
    from crossalign.store import RunStore
    from crossalign.tasks.training import dump_settings, request_dumps

    run = RunStore(tmp_path).create_run("r1", load_config("qwen35_dense_tiny"), config_source="qwen35_dense_tiny",
                                        parameters={}, code_version={"crossalign": "test"})
    asked = DumpSettings(step=2, level="mix", task="tensor")
    assert request_dumps(run, downstream("convert"), asked) == ["megatron-train"]  # pynative-train reads cast-bf16
    assert dump_settings(run, "megatron-train", SiteConfig()) == asked
    site = SiteConfig(diagnose={"dump": {"step": 1}})
    assert dump_settings(run, "pynative-train", site) == DumpSettings(step=1)
    assert dump_settings(run, "pynative-train", SiteConfig()) is None
    with pytest.raises(ValueError, match="redoing compare trains neither"):
        request_dumps(run, downstream("compare"), asked)
    assert run.dump_request("megatron-train") == asked.model_dump(mode="json")  # a refused request changes nothing
    assert request_dumps(run, downstream("megatron-train"), None) == []
    assert dump_settings(run, "megatron-train", SiteConfig()) is None


MINDSPORE_MIX = """
import sys
from pathlib import Path
import numpy as np
from crossalign.config import load_config
from crossalign.data.files import DatasetFiles
from crossalign.dump_settings import DumpSettings
from crossalign.models.layout import random_mindformers_state
from crossalign.sides.mindformers.checkpoint import default_common, write_mindformers_checkpoint
from crossalign.sides.mindformers.embedded.trainer import train_on_batches
from crossalign.sides.protocol import TrainRequest
out = Path(sys.argv[1])
config = load_config("qwen35_dense_tiny", ["training.train_iters=1", "training.lr_warmup_iters=0",
    "training.seq_length=8", "training.global_batch_size=1", "training.micro_batch_size=1"])
write_mindformers_checkpoint(out / "ckpt", 1, random_mindformers_state(config.model, 1), None, default_common(1, 1))
batches = list(np.random.default_rng(0).integers(0, config.model.vocab_size, (1, 1, 9), dtype=np.int64))
train_on_batches(TrainRequest(config=config, side="mindformers", mode="align", data=DatasetFiles(out / "d", out / "t"),
    output_dir=out / "run", init_checkpoint=out / "ckpt", dump=DumpSettings(level="mix", task="md5")), batches)
"""


@pytest.mark.slow
def test_the_mindspore_trainer_dumps_at_level_mix_with_the_gated_delta_rule_run_op_by_op(tmp_path):
    """msprobe's mix level wraps every MindSpore API, which the gated delta rule's ms.jit graph cannot parse
    (``Unsupported statement 'Try'``): under a mix dump the rule runs op by op, and its APIs are dumped."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", MINDSPORE_MIX, str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    dump = read_dump(tmp_path / "run" / "msprobe_dump")
    (rank,) = dump.ranks.values()
    assert (rank.level, rank.mode) == ("mix", "md5")
    assert any(entry.is_module for entry in rank.entries.values())
    assert any(not entry.is_module and "matmul" in entry.name.lower() for entry in rank.entries.values())


@pytest.mark.slow
def test_megatron_core_dumps_at_level_mix_with_swiglu_unfused_and_diagnose_reads_it(tmp_path):
    """msprobe's mix level wraps torch.nn.functional.silu, which megatron-core's fused SwiGLU refuses ("Only support
    fusion of gelu and swiglu"): under a mix dump the MLPs run it unfused and the log says so. (The unfused MLP calls
    the silu it was built with, not msprobe's wrapper: that one call is not among the dumped APIs.)"""
    from crossalign.diagnose.msprobe_run import diagnose_msprobe
    from crossalign.sides.megatron.args import UNFUSED_FOR_MIX

    pair = embedded_dump_pair("qwen35_dense_tiny", tmp_path, task="statistics", level="mix")
    gpu = read_dump(pair.gpu)
    assert {rank.level for rank in gpu.ranks.values()} == {"mix"} and sorted(gpu.ranks) == [0, 1]
    apis = {entry.name for rank in gpu.ranks.values() for entry in rank.entries.values() if not entry.is_module}
    assert any("matmul" in name.lower() for name in apis), sorted(apis)[:20]
    assert UNFUSED_FOR_MIX in (tmp_path / "megatron" / "train.log").read_text()
    diagnosis = diagnose_msprobe(pair.npu, pair.gpu, pair.config, tmp_path / "out", precision="fp32").diagnosis
    assert any(row.section == "forward" for row in diagnosis.rows)
    assert any("an API call at level mix" in name for name in diagnosis.unmapped_megatron)


def test_a_megatron_launch_dumping_at_level_mix_runs_swiglu_unfused():
    from crossalign.config import load_config
    from crossalign.sides.megatron.args import megatron_args, swiglu_fusion_under

    config = load_config("qwen35_dense_tiny")
    plain = megatron_args(config, data_prefix="/d", tokenizer=None, load_dir="/ckpt")
    mix = megatron_args(config, data_prefix="/d", tokenizer=None, load_dir="/ckpt",
                        swiglu_fusion=swiglu_fusion_under(DumpSettings(level="mix")))
    assert "--no-bias-swiglu-fusion" not in plain and sorted(mix) == sorted([*plain, "--no-bias-swiglu-fusion"])
    assert swiglu_fusion_under(DumpSettings(level="L0")) and swiglu_fusion_under(None)
