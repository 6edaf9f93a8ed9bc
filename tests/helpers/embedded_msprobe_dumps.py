"""msprobe dumps of both embedded TRAINERS of a run, written by msprobe's own writer (mindstudio-probe 26.2.0).

:func:`embedded_dump_pair` runs each embedded trainer one iteration, in a process of its own (msprobe's
PrecisionDebugger is one per process), with the run's ``diagnose.dump`` setting (``TrainRequest.dump``): the
MindSpore trainer (PyNative, one process: ``rank0``) and megatron-core in a Megatron layout (TP 2 x EP 2 for a
MoE config, TP 2 for a dense one: one spawned process per rank, ``rank{R}``), from the same MindFormers checkpoint
converted by crossalign's rules (optionally with a fault of ``crossalign/checkpoint/faults.py``, on the Megatron
side only), trained on the same batch. One iteration of one micro batch: ``msprobe_dump/step0``. Nothing here
writes the msprobe format itself.

Example (a consumer's test)::

    pair = embedded_dump_pair("qwen35_moe_tiny", tmp_path, task="tensor", fault="gate_up_swapped")
    pair.npu  # <tmp>/mindspore/msprobe_dump: step0/rank0/{dump.json, construct.json, stack.json, dump_tensor_data/}
    pair.gpu  # <tmp>/megatron/msprobe_dump: step0/rank0..rank{W-1}/...
    pair.config  # the AlignmentConfig both trained with (its parallel.megatron is the GPU dump's layout)

Module names as the real runs dump them: ``Cell.<path>.<Class>...`` (the MindSpore model given to msprobe) and
``Module.0.module.<path>.<Class>...`` (Megatron's list of model chunks, the DDP wrapper's ``module``; under bf16
Megatron's Float16Module adds one more ``module.``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from crossalign.checkpoint.convert import convert_checkpoint
from crossalign.checkpoint.faults import LAYOUT_FAULTS, inject_layout_fault
from crossalign.config import AlignmentConfig, load_config
from crossalign.tensorio.errors import CheckpointError
from crossalign.data.files import DatasetFiles
from crossalign.diagnose.ranks import read_as_megatron_loads
from crossalign.dump_settings import DUMP_DIR, DumpSettings
from crossalign.models.layout import random_mindformers_state
from crossalign.sides.megatron.checkpoint import (iteration_dir_name, read_megatron_checkpoint,
                                                  write_megatron_checkpoint)
from crossalign.sides.mindformers.checkpoint import default_common, write_mindformers_checkpoint
from crossalign.sides.protocol import TrainRequest

REPO = Path(__file__).resolve().parents[2]

# one iteration of one micro batch (msprobe's forward.0 and backward.0 of each module), a short sequence
ONE_STEP = ["training.train_iters=1", "training.lr_warmup_iters=0", "training.seq_length=16",
            "training.global_batch_size=1", "training.micro_batch_size=1"]
TP2_EP2 = {"tensor": 2, "expert": 2, "expert_tensor": 1, "sequence_parallel": True, "cards_per_node": 2}
TP2 = {"tensor": 2, "sequence_parallel": True, "cards_per_node": 2}


@dataclass(frozen=True)
class DumpPair:
    npu: Path  # the MindSpore trainer's msprobe dump root (step0/rank0/...)
    gpu: Path  # megatron-core's (step0/rank{R}/... for each rank of config.parallel.megatron)
    config: AlignmentConfig


def embedded_dump_pair(config_name: str, out: Path, *, task: str = "statistics", level: str = "L0",
                       megatron: dict | None = None, fault: str | None = None, seed: int = 11,
                       npu_of: DumpPair | None = None, run_id: str | None = None, settings: tuple[str, ...] = (),
                       timeout_s: float = 900) -> DumpPair:
    """Both embedded trainers one iteration under msprobe, from one checkpoint and one batch (see the module).

    ``megatron``: the Megatron layout (``parallel.megatron`` fields; default TP 2 x EP 2 for a MoE config, TP 2
    for a dense one); ``fault``: a conversion fault or a layout fault of ``crossalign/checkpoint/faults.py``,
    injected into the Megatron side's checkpoint only. megatron-core loads strictly: a fault that renames a
    tensor (``a_log_not_renamed``, ``wrong_mtp_prefix``) stops its load, naming the tensor. Rank files that do
    not fit together (``experts_not_renumbered``) are trained as Megatron's ranks hold them after their lenient
    load (``crossalign/diagnose/ranks.py``, experts split over the layout's expert tensor size).

    ``npu_of``: an earlier pair of the same config, seed, task and level whose MindSpore dump this pair shares (the
    MindSpore side does not depend on the Megatron layout or fault): the MindSpore trainer is not run again.

    ``settings``: more ``--set`` overrides of the config both train with (``training.embedded_precision=bf16``: the
    Megatron side computes in bf16, the MindSpore side in fp32 whatever it says).

    ``run_id``: the run both trainings' dump records name (``crossalign_dump.json`` in each rank folder; default
    ``<config>-<seed>``, which a pair sharing another's MindSpore dump shares too)."""
    out = Path(out)
    model = load_config(config_name).model
    layout = megatron if megatron is not None else (TP2_EP2 if model.is_moe else TP2)
    config = load_config(config_name, ONE_STEP + [f"parallel.megatron.{key}={str(value).lower()}"
                                                  for key, value in layout.items()] + list(settings))
    m = config.parallel.megatron
    write_mindformers_checkpoint(out / "mindformers", 1, random_mindformers_state(config.model, seed), None,
                                 default_common(1, config.training.global_batch_size))
    in_layout = fault in LAYOUT_FAULTS
    # a conversion fault is a single-rank converter's (convert_checkpoint injects it at TP 1 x PP 1 only): its whole
    # state is then cut into the layout's rank files as they are, so that Megatron's ranks load the fault
    one_rank = fault is not None and not in_layout
    report = convert_checkpoint(config.model, "ms2mg", out / "mindformers", out / "converted",
                                core_version=config.training.megatron_core_version, dtype="fp32",
                                tp=1 if one_rank else m.tensor, pp=1 if one_rank else m.pipeline,
                                ep=1 if one_rank else m.expert, etp=None if one_rank else m.expert_tensor,
                                fault=None if in_layout else fault)
    if one_rank:
        whole = read_megatron_checkpoint(out / "converted", config.model).state
        try:
            write_megatron_checkpoint(out / "sharded", report.iteration, whole, model=config.model, tp=m.tensor,
                                      pp=m.pipeline, ep=m.expert, etp=m.expert_tensor)
            (out / "megatron_checkpoint.txt").write_text("sharded")
        except CheckpointError:
            # a key no rank file has a place for (a_log under its MindSpore name): each rank cuts its part from the
            # one-rank file instead, and its strict load names the key
            shutil.rmtree(out / "sharded", ignore_errors=True)
    if in_layout:
        inject_layout_fault(out / "converted" / iteration_dir_name(report.iteration), fault, config.model,
                            m.tensor, m.pipeline, m.expert)
        # the embedded trainer cuts each rank's part from one whole state, which rank files that do not fit
        # together (experts still under their global numbers) do not give: the whole state is the one Megatron's
        # ranks end up holding after their own loads (keys a rank cannot place keep their initial values,
        # crossalign/diagnose/ranks.py), written again in the layout so that each rank's load digest holds
        loaded = read_as_megatron_loads(out / "converted", config.model, config.training.megatron_core_version,
                                        expert_tensor=m.expert_tensor_size)
        write_megatron_checkpoint(out / "as_loaded", report.iteration, loaded.state, model=config.model,
                                  tp=m.tensor, pp=m.pipeline, ep=m.expert, etp=m.expert_tensor)
        (out / "megatron_checkpoint.txt").write_text("as_loaded")
    tokens = np.random.default_rng(seed).integers(0, config.model.vocab_size,
                                                  (1, 1, config.training.seq_length + 1), dtype=np.int64)
    np.save(out / "batches.npy", tokens)
    (out / "config.json").write_text(config.model_dump_json())
    (out / "dump_settings.json").write_text(DumpSettings(step=0, level=level, task=task).model_dump_json())
    (out / "run_id.txt").write_text(run_id or f"{config_name}-{seed}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    if npu_of is not None:
        _check_same_mindspore_side(npu_of, out)
    for side in ("mindformers", "megatron") if npu_of is None else ("megatron",):
        result = subprocess.run([sys.executable, "-m", "tests.helpers.embedded_msprobe_dumps", side, str(out)],
                                cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        if result.returncode != 0:
            raise RuntimeError(f"the embedded {side} trainer's msprobe dump of {config_name} ({task}, {level}, "
                               f"fault {fault}) failed:\n{result.stderr[-4000:]}")
    npu = out / "mindspore" / DUMP_DIR if npu_of is None else npu_of.npu
    return DumpPair(npu=npu, gpu=out / "megatron" / DUMP_DIR, config=config)


def _check_same_mindspore_side(earlier: DumpPair, out: Path) -> None:
    """An earlier pair's MindSpore dump stands for this pair's only where it trained the same config (but for the
    Megatron layout) from the same checkpoint on the same batch with the same dump settings."""
    before = earlier.npu.parents[1]
    files = ["batches.npy", "dump_settings.json", "run_id.txt"] + [str(f.relative_to(out)) for f in (out / "mindformers").rglob("*")
                                                     if f.is_file()]
    differs = [name for name in files if not (before / name).is_file() or
               (before / name).read_bytes() != (out / name).read_bytes()]
    if _but_megatron(earlier.config) != _but_megatron(_read_config(out)):
        differs.append("config.json")
    if differs:
        raise ValueError(f"npu_of: the MindSpore dump of {before} is not this pair's ({', '.join(differs)} differ)")


def _but_megatron(config: AlignmentConfig) -> dict:
    """What the MindSpore side trains with: the config less the Megatron layout and the embedded megatron-train's
    precision (the MindSpore trainer computes in fp32 whatever it says)."""
    settings = config.model_dump(mode="json")
    settings["parallel"].pop("megatron")
    settings["training"].pop("embedded_precision")
    return settings


def _read_config(out: Path) -> AlignmentConfig:
    return AlignmentConfig.model_validate_json((out / "config.json").read_text())


def _train_embedded(side: str, out: Path) -> None:
    """One side of :func:`embedded_dump_pair`, in this process (msprobe's debugger is one per process)."""
    config = _read_config(out)
    dump = DumpSettings.model_validate_json((out / "dump_settings.json").read_text())
    batches = list(np.load(out / "batches.npy"))
    run_id = (out / "run_id.txt").read_text()
    data = DatasetFiles(out / "data", out / "tokenizer.json")  # unused: the trainers get the batches
    if side == "mindformers":
        from crossalign.sides.mindformers.embedded.trainer import train_on_batches

        train_on_batches(TrainRequest(config=config, side="mindformers", mode="align", data=data,
                                      output_dir=out / "mindspore", init_checkpoint=out / "mindformers",
                                      dump=dump, run_id=run_id), batches)
        return
    from crossalign.sides.megatron.embedded.trainer import run_training

    chosen = out / "megatron_checkpoint.txt"
    source = out / (chosen.read_text() if chosen.exists() else "converted")
    checkpoint = read_megatron_checkpoint(source, config.model)
    run_training(TrainRequest(config=config, side="megatron", mode="align", data=data, output_dir=out / "megatron",
                              init_checkpoint=source, dump=dump, run_id=run_id),
                 checkpoint.state, checkpoint.iteration, batches)


if __name__ == "__main__":
    _train_embedded(sys.argv[1], Path(sys.argv[2]))
