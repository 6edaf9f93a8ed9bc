"""The embedded GPU side at production layouts: megatron-core trains in several processes (gloo on CPU) from the
checkpoint converted into that layout, against the single-process MindSpore side, and the loss does not depend on
the layout beyond reduction order.

Each layout: step 1 agrees with MindSpore at Megatron's print precision, and the mean error over the run stays
within the fp32 floor that the one-process run (TP 1) measures against the same MindSpore run. The slower layouts
share a test per model, so that each model's MindSpore run and floor are measured once.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from crossalign.data.files import DatasetFiles
from crossalign.sides.protocol import TrainRequest
from crossalign.checkpoint.convert import convert_checkpoint
from crossalign.models.layout import random_mindformers_state
from crossalign.sides.megatron.checkpoint import read_megatron_checkpoint
from crossalign.sides.mindformers.checkpoint import default_common, write_mindformers_checkpoint
from crossalign.config import ConfigError, MegatronParallel, load_config
from crossalign.sides.megatron.log_parser import parse_megatron_log

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ITERATIONS = 6
SHORT = [f"training.train_iters={ITERATIONS}", "training.lr_warmup_iters=1", "training.seq_length=32",
         "training.global_batch_size=4", "training.micro_batch_size=2"]
LAYOUTS = {
    "qwen35_dense_tiny": {
        "TP 2 + SP": ["tensor=2", "sequence_parallel=true", "cards_per_node=2"],
        "PP 2": ["pipeline=2", "cards_per_node=2"],
        "TP 2 x PP 2 + SP": ["tensor=2", "pipeline=2", "sequence_parallel=true", "cards_per_node=4"],
    },
    "qwen35_moe_tiny": {
        "EP 2": ["expert=2", "cards_per_node=2"],
        "TP 2 x EP 2 + SP (alltoall)": ["tensor=2", "expert=2", "expert_tensor=1", "sequence_parallel=true",
                                        "cards_per_node=2"],
    },
}


def printed(value: float) -> float:
    """A loss as Megatron prints it (``%E``: 7 significant digits)."""
    return float(f"{value:E}")


def print_unit(value: float) -> float:
    """One unit in the last place Megatron prints."""
    return 10.0 ** (np.floor(np.log10(abs(value))) - 6)


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    """name -> (base config, MindFormers checkpoint, batches, MindSpore lm losses), each made once."""
    from crossalign.sides.mindformers.embedded.trainer import train_on_batches

    cache = {}

    def get(name: str):
        if name not in cache:
            root = tmp_path_factory.mktemp(name)
            config = load_config(name, SHORT)
            state = random_mindformers_state(config.model, seed=11)
            write_mindformers_checkpoint(root / "mindformers", 1, state, None,
                                         default_common(1, config.training.global_batch_size))
            batches = list(np.random.default_rng(0).integers(0, config.model.vocab_size, (ITERATIONS, 4, 33),
                                                             dtype=np.int64))
            request = TrainRequest(config=config, side="mindformers", mode="align",
                                   data=DatasetFiles(root / "data", root / "tokenizer.json"),
                                   output_dir=root / "mindspore", init_checkpoint=root / "mindformers")
            lines = train_on_batches(request, batches).log_path.read_text().splitlines()
            losses = [float(line.split("lm_loss: ")[1].split(",")[0]) if "lm_loss: " in line else
                      float(line.split("loss: ")[1].split(",")[0]) for line in lines if "loss: " in line]
            cache[name] = config, root, batches, np.asarray(losses)
        return cache[name]
    return get


def train_megatron(name: str, sides, label: str, layout: list[str], refused: str | None = None):
    """Convert into the layout, train megatron-core in it; the per-step lm loss as the log prints it, the log.

    A layout the config refuses (``refused``: the refusal's text) is checked to be refused, then trained
    anyway, to show what the refusal prevents."""
    from crossalign.sides.megatron.embedded.trainer import run_training

    base, root, batches, _ = sides(name)
    settings = [f"parallel.megatron.{setting}" for setting in layout]
    if refused is None:
        config = load_config(name, SHORT + settings)
    else:
        with pytest.raises(ConfigError, match=refused):
            load_config(name, SHORT + settings)
        unchecked = MegatronParallel(**{k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in layout)})
        config = base.model_copy(update={"parallel": base.parallel.model_copy(update={"megatron": unchecked})})
    m = config.parallel.megatron
    out = root / label.replace(" ", "_")
    convert_checkpoint(config.model, "ms2mg", root / "mindformers", out / "converted",
                       core_version=config.training.megatron_core_version, dtype="fp32", tp=m.tensor, pp=m.pipeline,
                       ep=m.expert, etp=m.expert_tensor)
    checkpoint = read_megatron_checkpoint(out / "converted", config.model)
    assert (checkpoint.tp, checkpoint.pp, checkpoint.ep) == (m.tensor, m.pipeline, m.expert)
    request = TrainRequest(config=config, side="megatron", mode="align",
                           data=DatasetFiles(root / "data", root / "tokenizer.json"), output_dir=out / "megatron",
                           init_checkpoint=out / "converted", save=True)
    result = run_training(request, checkpoint.state, checkpoint.iteration, batches)
    frame = parse_megatron_log(result.log_path, config.training.megatron_core_version)
    return config, result, frame["lm_loss"].to_numpy()


def errors(ours: np.ndarray, mindspore: np.ndarray) -> tuple[float, float]:
    """(step-1 error, mean error over the run) of printed losses."""
    diff = np.abs(np.array([printed(v) for v in ours]) - np.array([printed(v) for v in mindspore]))
    return float(diff[0]), float(diff.mean())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_layout_trains_from_its_own_checkpoint_as_the_one_process_run(name, sides, capsys):
    _, _, _, mindspore = sides(name)
    _, _, single = train_megatron(name, sides, "TP 1", [])
    first_floor, floor = errors(single, mindspore)
    unit = print_unit(mindspore[0])
    assert first_floor <= unit
    measured = {"TP 1": (first_floor, floor, float(np.abs(single - single).max()))}
    for label, layout in LAYOUTS[name].items():
        config, result, losses = train_megatron(name, sides, label, layout)
        first, mean = errors(losses, mindspore)
        measured[label] = (first, mean, float(np.abs(losses - single).max()))
        assert first <= unit, f"{label}: step 1 {losses[0]!r} vs MindSpore {mindspore[0]!r}"
        assert mean <= max(2 * floor, unit), f"{label}: mean error {mean:.2e} above the TP 1 floor {floor:.2e}"
        # the log is the last rank's, as Megatron prints it; the trained weights are saved in the layout
        m = config.parallel.megatron
        text = result.log_path.read_text()
        assert f"tensor-model-parallel size: {m.tensor}, pipeline-model-parallel size: {m.pipeline}" in text
        assert f"[ t {m.tensor}/{m.tensor}, p {m.pipeline}/{m.pipeline} ]" in text
        if m.expert_tensor_size == m.tensor:
            saved = read_megatron_checkpoint(result.checkpoint_dir, config.model)
            assert (saved.tp, saved.pp, saved.ep, saved.iteration) == (m.tensor, m.pipeline, m.expert, ITERATIONS)
        else:  # the expert ranks fold onto the tensor ranks: each process saves its (tensor, expert) rank, as Megatron
            folders = sorted(path.name for path in (Path(result.checkpoint_dir) / "iter_0000006").iterdir())
            assert folders == ["mp_rank_00_000", "mp_rank_01_001"]
    with capsys.disabled():
        for label, (first, mean, vs_single) in measured.items():
            print(f"\n{name} {label}: step-1 error {first:.1e}, mean error {mean:.2e} vs MindSpore; "
                  f"max {vs_single:.1e} vs TP 1")


@pytest.mark.slow
def test_tensor_parallel_without_sequence_parallel_lets_gdn_out_norm_replicas_drift(sides):
    """megatron-core 0.16.1 sums over the tensor ranks the grads of sequence-parallel weights and of q/k_layernorm
    only (megatron/core/distributed/finalize_model_grads.py:354-356): GatedDeltaNet's out_norm, replicated but fed
    by each rank's own heads, then trains apart on each rank. The embedded side reproduces it, and reading the
    saved checkpoint back names the tensor; the config refuses the layout."""
    from crossalign.tensorio.errors import CheckpointError

    config, result, _ = train_megatron("qwen35_dense_tiny", sides, "TP 2 no SP", ["tensor=2", "cards_per_node=2"],
                                       refused="sequence_parallel: required with tensor 2 on a model with GatedDeltaNet")
    with pytest.raises(CheckpointError, match=r"out_norm\.weight.* differs between tensor-parallel ranks 0 and 1"):
        read_megatron_checkpoint(result.checkpoint_dir, config.model)
    rank = torch.load(Path(result.checkpoint_dir) / "iter_0000006" / "mp_rank_01" / "model_optim_rng.pt")
    assert "decoder.layers.0.self_attention.out_norm.weight" in rank["model"]


@pytest.mark.parametrize("name, fault, layout, shows", [
    ("qwen35_dense_tiny", "in_proj_split_as_one_block", (2, 1, 1), "decoder.layers.0.self_attention"),
    ("qwen35_moe_tiny", "experts_not_renumbered", (1, 1, 2), "mlp.experts.linear_fc1.weight"),
])
def test_a_fault_of_the_layout_fails_the_selfcheck_in_that_layout_naming_where(name, fault, layout, shows):
    """Faults a single-rank checkpoint cannot have: the converted ranks do not assemble into the source model."""
    from crossalign.diagnose.selfcheck import selfcheck

    config = load_config(name)
    assert selfcheck(config, seq=16, batch=2, layout=layout).passed
    report = selfcheck(config, fault=fault, seq=16, batch=2, layout=layout)
    assert not report.passed
    assert shows in (report.departure or "") + " ".join(report.load_errors)


def test_the_self_test_names_a_class_workaround_whose_upstream_moved():
    from crossalign.sides.megatron.embedded import mcore_cpu

    moved = mcore_cpu.Workaround("megatron.core.transformer.moe.token_dispatcher", "cuda_dtoh_stream", "a reason",
                                 lambda: None, "torch.cuda.Stream(priority=1)", owner="MoEAlltoAllTokenDispatcher")
    with pytest.raises(mcore_cpu.MegatronCpuError, match=r"token_dispatcher\.MoEAlltoAllTokenDispatcher\."
                                                         r"cuda_dtoh_stream: 'torch\.cuda\.Stream\(priority=1\)'"):
        mcore_cpu.self_test((moved,))


def test_sequence_parallel_norms_are_marked_for_the_tensor_rank_reduction():
    """As TE's norms are: finalize_model_grads sums the grads of weights marked sequence_parallel."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from crossalign.sides.megatron.embedded.mcore_cpu import megatron_core_on_cpu
    from crossalign.sides.megatron.embedded.mcore_model import transformer_config

    config = load_config("qwen35_dense_tiny", ["parallel.megatron.tensor=2", "parallel.megatron.cards_per_node=2",
                                               "parallel.megatron.sequence_parallel=true"])
    with megatron_core_on_cpu(seed=1):
        norm = WrappedTorchNorm(config=transformer_config(config.model, config.training,
                                                          layout=config.parallel.megatron), hidden_size=8)
        assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel is True


def test_each_data_parallel_rank_takes_its_micro_batches_as_megatrons_sampler_deals_them():
    from crossalign.sides.megatron.embedded.trainer import data_parallel_share

    tokens = torch.arange(8).view(8, 1)
    assert [t.view(-1).tolist() for t in data_parallel_share(tokens, 2, 2, 1)] == [[2, 3], [6, 7]]
    assert [t.view(-1).tolist() for t in data_parallel_share(tokens, 2, 1, 0)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.slow
def test_a_rank_that_loaded_other_tensors_than_its_file_holds_fails_naming_the_tensor_and_the_rank_file(tmp_path):
    """EP 2: each rank records what it loaded and the printing rank holds every record against that rank's own
    file of the sharded checkpoint, before the first step. Here the run is handed the full state while its
    checkpoint's mp_rank_00_001 lacks one routed expert: that rank's record names it."""
    import shutil

    from crossalign.sides.megatron.embedded.torch_trainer import TrainingError
    from crossalign.sides.megatron.embedded.trainer import run_training
    from crossalign.sides.megatron.checkpoint import MODEL_FILE

    config = load_config("qwen35_moe_tiny", [f"training.train_iters=2", *SHORT[1:], "parallel.megatron.expert=2",
                                             "parallel.megatron.cards_per_node=2"])
    write_mindformers_checkpoint(tmp_path / "mindformers", 1, random_mindformers_state(config.model, seed=11), None,
                                 default_common(1, config.training.global_batch_size))
    convert_checkpoint(config.model, "ms2mg", tmp_path / "mindformers", tmp_path / "converted",
                       core_version=config.training.megatron_core_version, dtype="fp32", ep=2)
    state = read_megatron_checkpoint(tmp_path / "converted", config.model).state
    shutil.copytree(tmp_path / "converted", tmp_path / "faulty")
    rank_file = next((tmp_path / "faulty").glob("iter_*")) / "mp_rank_00_001" / MODEL_FILE
    saved = torch.load(rank_file, weights_only=False)
    missing = "decoder.layers.1.mlp.experts.linear_fc2.weight1"  # EP rank 1's local expert 1 (global expert 5)
    del saved["model"][missing]
    torch.save(saved, rank_file)

    batches = list(np.random.default_rng(0).integers(0, config.model.vocab_size, (2, 4, 33), dtype=np.int64))
    request = TrainRequest(config=config, side="megatron", mode="align",
                           data=DatasetFiles(tmp_path / "data", tmp_path / "tokenizer.json"),
                           output_dir=tmp_path / "megatron", init_checkpoint=tmp_path / "faulty")
    with pytest.raises(TrainingError) as caught:
        run_training(request, state, 1, batches)
    message = str(caught.value)
    assert (f"Megatron rank mp_rank_00_001 ({tmp_path / 'megatron' / 'load_digest' / 'mp_rank_00_001.json'}) vs the "
            f"checkpoint {tmp_path / 'faulty'}") in message
    assert f"1 not in the checkpoint, so left at its initial value: {missing}" in message
    assert "never loaded" not in message and "other values" not in message
    assert " iteration        1/" not in (tmp_path / "megatron" / "train.log").read_text()  # before the first step
