"""The gpu rehearsal: a run's megatron-train launch through Megatron-LM's own pretrain() on CPU.

Needs a Megatron-LM checkout (MEGATRON_LM_PATH, e.g. a clone at tag core_v0.16.1 kept outside the
repository); without one these tests skip, saying so. The stand-ins themselves (argument changes,
self-test) are tested without it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from crossalign.sides.megatron.embedded import mcore_cpu
from crossalign.tensorio.errors import LoadDigestError
from crossalign.sides.megatron import rehearsal_cpu as megatron_cpu
from crossalign.store import RunStore

CHECKOUT = os.environ.get("MEGATRON_LM_PATH")
needs_checkout = pytest.mark.skipif(not CHECKOUT, reason="MEGATRON_LM_PATH is not set (a Megatron-LM checkout, "
                                                          "e.g. tag core_v0.16.1, kept outside the repository)")
STEPS = ("base-train", "cast-bf16", "convert", "megatron-train")
# one unit in the last printed digit of %.6E at ~6: the float sums of two runs may round the other way
PRINT_PRECISION = 1.5e-6


def test_the_cpu_arguments_replace_what_a_cpu_cannot_honour():
    generated = ["--transformer-impl", "transformer_engine", "--moe-grouped-gemm", "--moe-token-dispatcher-type",
                 "alltoall", "--bf16", "--seed", "1234"]
    args, changes = megatron_cpu.cpu_arguments(generated, fp32=True)
    assert args[:6] == ["--transformer-impl", "local", "--moe-token-dispatcher-type", "allgather", "--seed", "1234"]
    assert "--bf16" not in args and "--moe-grouped-gemm" not in args
    assert args[args.index("--distributed-backend") + 1] == "gloo"
    assert {c.flag for c in changes} >= {"--transformer-impl", "--moe-grouped-gemm", "--bf16", "--distributed-backend"}
    assert all(c.reason for c in changes)
    kept, _ = megatron_cpu.cpu_arguments(generated, fp32=False)
    assert "--bf16" in kept


def test_cuda_literals_and_moves_stay_on_the_cpu():
    """What Megatron-LM's training loop does with tensors (training.py, utils.get_batch_on_this_tp_rank)."""
    import torch

    with megatron_cpu.CudaToCpu():
        made = torch.tensor([0.0], dtype=torch.float, device="cuda")
        moved = [made.cuda(non_blocking=True), made.to("cuda"), made.to(device=torch.device("cuda:0"))]
        module = torch.nn.Linear(2, 2).cuda(0)
    assert {t.device.type for t in [made, *moved, module.weight]} == {"cpu"}


def test_every_runtime_stand_in_is_listed_with_its_reason():
    listed = dict(megatron_cpu.workarounds())
    for workaround in (*mcore_cpu.WORKAROUNDS, *megatron_cpu.TRAINING_WORKAROUNDS):
        assert listed[workaround.name] == workaround.reason


SELF_TEST = """
from crossalign.sides.megatron.embedded.mcore_cpu import MegatronCpuError, Workaround
from crossalign.sides.megatron import rehearsal_cpu as megatron_cpu
megatron_cpu.self_test()
megatron_cpu.TRAINING_WORKAROUNDS = (Workaround("megatron.legacy.fused_kernels", "load", "for the test",
                                                lambda: None, "no such upstream line"),)
try:
    megatron_cpu.self_test()
except MegatronCpuError as exc:
    print(exc)
"""


@needs_checkout
@pytest.mark.timeout(300)
def test_self_test_passes_on_the_checkout_and_names_a_moved_workaround():
    """In its own process, with the checkout first on PYTHONPATH as the run script puts it."""
    done = subprocess.run([sys.executable, "-c", SELF_TEST], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": CHECKOUT})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "megatron.legacy.fused_kernels.load: 'no such upstream line' is no longer in" in done.stdout


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> RunStore:
    return RunStore(tmp_path_factory.mktemp("store"))


def embedded_run(store: RunStore, config: str, run_id: str, overrides: tuple[str, ...] = (),
                 site: Path | None = None):
    """A run whose steps 1-4 ran embedded: its converted checkpoint, dataset and megatron-core losses
    (``site``: the site config the steps run with)."""
    from crossalign.request import RunRequest
    from crossalign.tasks.prepare import prepare_run

    run = prepare_run(RunRequest(config=config, run_id=run_id, store=str(store.root), mode="embedded", overrides=[
        "training.train_iters=5", "training.lr_warmup_iters=2", "training.base_train_iters=3", *overrides]).resolve())
    for step in STEPS:
        subprocess.run([sys.executable, "-m", "crossalign.tasks", "--store", str(store.root), "--run", run_id,
                        "--step", step, "--embedded", *(["--site", str(site)] if site else [])],
                       check=True, capture_output=True, timeout=900)
    return run


@needs_checkout
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("config", ["qwen35_dense_tiny", "qwen35_moe_tiny"])
def test_rehearsal_trains_five_iterations_as_the_embedded_run_does(store: RunStore, config: str, tmp_path: Path):
    from crossalign.cli.rehearse import embedded_losses
    from crossalign.sides.megatron.rehearsal import max_abs_diff, rehearse_gpu

    run = embedded_run(store, config, config.replace("_", "-"))
    shared_cache = Path(run.dataset.prefix).parent / "cache"
    before = sorted(shared_cache.rglob("*")) if shared_cache.exists() else []
    result = rehearse_gpu(run.config, run.dataset, run.step_dir("convert") / "checkpoint", Path(CHECKOUT),
                          tmp_path / "gpu")
    assert sorted(result.losses) == [1, 2, 3, 4, 5]
    assert result.digest_tensors > 0
    assert result.core_differences == []  # the checkout's megatron/core is the installed wheel's (core_v0.16.1)
    names = {"lm_loss", "mtp_1_loss"} | ({"aux_loss"} if "moe" in config else set())
    assert set(result.losses[1]) == names
    embedded = embedded_losses(run)
    assert embedded is not None and sorted(embedded) == [1, 2, 3, 4, 5]
    diffs = max_abs_diff(result.losses, embedded)
    assert set(diffs) == names and max(diffs.values()) <= PRINT_PRECISION, diffs
    # the run trains in bf16 (training.bf16, the launch passes --bf16): the report says fp32 stood in for it
    assert (result.generated_precision, result.precision) == ("bf16", "fp32")
    assert "--bf16" in {change.flag for change in result.argument_changes}
    assert result.precision_statement.startswith("precision: fp32 stood in for the generated --bf16")
    assert "(fp32 both)" in result.embedded_comparison(embedded, run.config.training.embedded_precision)
    # the step's own launch, unchanged but for the listed argument changes: its script is next to ours
    assert (tmp_path / "gpu" / "run_megatron.sh").exists()
    args = (tmp_path / "gpu" / "megatron_args.txt").read_text().split()
    assert args[args.index("--data-cache-path") + 1] == str(tmp_path / "gpu" / "data_cache")
    assert any((tmp_path / "gpu" / "data_cache").rglob("*-document_index.npy"))
    # Megatron wrote nothing into the shared dataset's folder
    assert (sorted(shared_cache.rglob("*")) if shared_cache.exists() else []) == before


@needs_checkout
@pytest.mark.timeout(1800)
def test_a_renamed_and_a_missing_expert_tensor_fail_the_rehearsal_naming_both(store: RunStore, tmp_path: Path):
    """Megatron itself prints 'load_return: None' and 'successfully loaded checkpoint' and trains on."""
    from crossalign.sides.megatron.checkpoint import read_megatron_checkpoint, write_megatron_checkpoint
    from crossalign.sides.megatron.rehearsal import rehearse_gpu

    run = embedded_run(store, "qwen35_moe_tiny", "qwen35-moe-tiny")
    converted = read_megatron_checkpoint(run.step_dir("convert") / "checkpoint")
    state = dict(converted.state)
    renamed = "decoder.layers.1.mlp.experts.linear_fc1.weight2"
    missing = "decoder.layers.3.mlp.experts.linear_fc2.weight0"
    state[renamed + "_renamed"] = state.pop(renamed)
    del state[missing]
    write_megatron_checkpoint(tmp_path / "faulty", converted.iteration, state)
    with pytest.raises(LoadDigestError) as caught:
        rehearse_gpu(run.config, run.dataset, tmp_path / "faulty", Path(CHECKOUT), tmp_path / "gpu")
    message = str(caught.value)
    assert f"left at its initial value: {renamed}, {missing}" in message
    assert f"never loaded (extra or renamed): {renamed}_renamed" in message
    log = (tmp_path / "gpu" / "train.log").read_text().splitlines()
    # what core_v0.16.1 prints after the failed strict load (the fixture logs carry this exact line)
    at = log.index("load_return: None")
    assert any("successfully loaded checkpoint" in line for line in log[at:at + 5])


def _rehearsal(precision: str, generated: str) -> "GpuRehearsal":
    from crossalign.sides.megatron.rehearsal import GpuRehearsal

    return GpuRehearsal(folder=Path("r"), log=Path("r/train.log"), checkout=Path("m"), megatron_core="0.16.1",
                        argument_changes=[], workarounds=[], losses={1: {"lm_loss": 7.312234}},
                        precision=precision, generated_precision=generated)


def test_the_report_says_in_which_precision_the_rehearsal_trained_and_what_stood_in():
    assert _rehearsal("bf16", "bf16").precision_statement.startswith("precision: bf16, as the generated launch")
    assert _rehearsal("fp32", "fp32").precision_statement == "precision: fp32, as the generated launch (no --bf16)"
    assert "fp32 stood in for the generated --bf16" in _rehearsal("fp32", "bf16").precision_statement
    embedded = {1: {"lm_loss": 7.312124}}
    assert "which trained in fp32 while this rehearsal trained in bf16 (not comparable to print precision)" in \
        _rehearsal("bf16", "bf16").embedded_comparison(embedded, "fp32")
    assert "(bf16 both), max |diff|: lm_loss 1.1e-04" in _rehearsal("bf16", "bf16").embedded_comparison(embedded, "bf16")
    # the one stand-in only --bf16 needs is listed where it applied
    assert "CpuTensorTypesAsCuda" in dict(megatron_cpu.workarounds(bf16=True))
    assert "CpuTensorTypesAsCuda" not in dict(megatron_cpu.workarounds())


@needs_checkout
@pytest.mark.timeout(1800)
def test_a_bf16_run_rehearsed_with_its_bf16_trains_in_bf16_on_the_cpu(store: RunStore, tmp_path: Path):
    """--bf16 kept (crossalign rehearse --bf16): Megatron's Float16Module and bf16 optimizer run on the CPU, the load
    digest holds the bf16 parameters against the checkpoint rounded to bf16, and the losses are the embedded
    megatron-core step's in bf16 (training.embedded_precision) where no update has changed the weights yet."""
    from crossalign.cli.rehearse import embedded_losses
    from crossalign.sides.megatron.rehearsal import max_abs_diff, rehearse_gpu

    run = embedded_run(store, "qwen35_dense_tiny", "dense-tiny-bf16", ("training.embedded_precision=bf16",))
    result = rehearse_gpu(run.config, run.dataset, run.step_dir("convert") / "checkpoint", Path(CHECKOUT),
                          tmp_path / "gpu", fp32=False)
    assert (result.generated_precision, result.precision) == ("bf16", "bf16")
    assert "--bf16" not in {change.flag for change in result.argument_changes}
    assert "CpuTensorTypesAsCuda" in dict(result.workarounds)
    assert "--bf16" in (tmp_path / "gpu" / "rehearse_megatron.sh").read_text()
    log = (tmp_path / "gpu" / "train.log").read_text()
    assert "  bf16 ............................................ True" in log
    assert sorted(result.losses) == [1, 2, 3, 4, 5] and result.digest_tensors > 0
    embedded = embedded_losses(run)
    # the embedded TransformerConfig takes Megatron-LM's defaults (fused bias-swiglu, softmax not in fp32): every
    # iteration equals Megatron-LM's --bf16 to print precision, after the updates too (with the dataclass's
    # defaults they drifted by 1e-4 from iteration 3 on)
    assert max(max_abs_diff(result.losses, embedded).values()) <= PRINT_PRECISION
    assert "(bf16 both)" in result.embedded_comparison(embedded, run.config.training.embedded_precision)


@needs_checkout
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_dump_enabled_launch_runs_through_rehearse_and_msprobe_compares_it_with_the_embedded_dump(
        store: RunStore, tmp_path: Path):
    """``crossalign rehearse --dump``: Megatron-LM's pretrain() with the launcher's PrecisionDebugger writes the dump
    step, and msprobe's own compare reads it beside the embedded megatron-core step's dump (the site's
    diagnose.dump) and passes every tensor: the same modules under the same names, the same numbers."""
    import csv

    site = tmp_path / "site.yaml"
    site.write_text("diagnose:\n  dump: {step: 1, level: L0, task: statistics}\n")
    run = embedded_run(store, "qwen35_dense_tiny", "dense-dump", ("training.train_iters=2", "training.lr_warmup_iters=1"),
                       site=site)
    embedded = run.manifest("megatron-train")["details"]["msprobe_dump"]
    assert (embedded["step"], embedded["rank_folders"]) == (1, ["rank0"])
    crossalign = str(Path(sys.executable).with_name("crossalign"))
    done = subprocess.run([crossalign, "rehearse", run.run_id, "--store", str(store.root), "--megatron", CHECKOUT,
                           "--out", str(tmp_path / "rehearsal"), "--dump"], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "CROSSALIGN_SITE": str(site)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    dump = tmp_path / "rehearsal" / "gpu" / "msprobe_dump"
    assert f"gpu: msprobe dumped iteration 1 (L0, statistics): rank0 in {dump} (4 files)" in done.stdout
    # msprobe's three files and the launcher's record of the run, of rank 0 of the run's own Megatron layout
    from crossalign.dump_settings import RECORD_FILE, DumpRecord

    record = DumpRecord.model_validate_json((dump / "step1" / "rank0" / RECORD_FILE).read_text())
    assert (record.step, record.side, record.rank) == (1, "megatron", 0)
    assert record.layout == run.config.parallel.megatron.model_dump(mode="json")
    embedded_record = DumpRecord.model_validate_json(
        (run.step_dir("megatron-train") / "msprobe_dump" / "step1" / "rank0" / RECORD_FILE).read_text())
    assert embedded_record.run_id == run.run_id and embedded_record.config_digest == record.config_digest
    compared = subprocess.run([str(Path(sys.executable).with_name("msprobe")), "compare", "-tp", str(dump / "step1"),
                               "-gp", str(run.step_dir("megatron-train") / "msprobe_dump" / "step1"),
                               "-o", str(tmp_path / "compare")], capture_output=True, text=True, timeout=300)
    assert compared.returncode == 0, compared.stdout[-3000:] + compared.stderr[-3000:]
    (table,) = (tmp_path / "compare").glob("compare_result_*.csv")
    rows = list(csv.DictReader(table.open()))
    names = {row["NPU Name"] for row in rows}
    assert "Module.0.module.decoder.layers.0.self_attention.in_proj.ColumnParallelLinear.forward.0.output.0" in names
    assert any(".backward.0." in name for name in names)
    assert {row["Bench Name"] for row in rows} == names  # every module of the rehearsal found in the embedded dump
    assert {row["Result"] for row in rows} == {"pass"}, [row["NPU Name"] for row in rows if row["Result"] != "pass"]


@needs_checkout
@pytest.mark.timeout(1800)
def test_megatron_lm_loads_the_torch_dist_checkpoint_crossalign_streamed(store: RunStore, tmp_path: Path):
    """A run whose Megatron checkpoint format is torch_dist: the convert step streams it without the model,
    Megatron-LM's own pretrain() loads it with --ckpt-format torch_dist (under the local model's sharded keys),
    every rank's load digest matches its shard of the checkpoint, and the losses are the embedded run's."""
    import json

    from crossalign.cli.rehearse import embedded_losses
    from crossalign.sides.megatron.rehearsal import LOCAL_CHECKPOINT, max_abs_diff, rehearse_gpu

    run = embedded_run(store, "qwen35_moe_tiny", "moe-torch-dist", ("training.megatron_ckpt_format=torch_dist",))
    converted = run.step_dir("convert") / "checkpoint"
    assert json.loads(next(converted.glob("iter_*/metadata.json")).read_text())["sharded_backend"] == "torch_dist"
    result = rehearse_gpu(run.config, run.dataset, converted, Path(CHECKOUT), tmp_path / "gpu")
    args = (tmp_path / "gpu" / "megatron_args.txt").read_text().split()
    assert args[args.index("--ckpt-format") + 1] == "torch_dist"
    local = next((tmp_path / "gpu" / LOCAL_CHECKPOINT).glob("iter_*"))
    assert (local / ".metadata").exists() and not list(local.glob("mp_rank_*"))
    assert "successfully loaded checkpoint" in result.log.read_text()
    assert result.digest_tensors > 0
    diffs = max_abs_diff(result.losses, embedded_losses(run))
    assert sorted(result.losses) == [1, 2, 3, 4, 5] and max(diffs.values()) <= PRINT_PRECISION, diffs
