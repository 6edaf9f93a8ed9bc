"""The gpu rehearsal: a run's megatron-train step launched as the GPU would launch it, on this machine's CPU.

The step's launch is written by the real backend (``MegatronBackend.write_launch``: the
generated arguments and ``run_megatron.sh``), then run by torchrun with one process, through
``patches/megatron/pretrain_qwen35.py`` and the site's Megatron-LM checkout, that is Megatron's
own ``pretrain()``. What a CPU cannot do is stood in for, and listed in the report:
the argument changes and runtime workarounds of :mod:`crossalign.sides.megatron.rehearsal_cpu`, and
the checkpoint handed to Megatron under the local-module names (``te_local.py``).

Precision: a run whose config trains in bf16 (``training.bf16``) is launched with ``--bf16``. The
rehearsal drops it by default and trains in fp32, the embedded megatron-core step's default
precision, so that its losses can be held against that step's to print precision; the report
says so (:attr:`GpuRehearsal.precision_statement`). With ``fp32=False`` (``crossalign rehearse
--bf16``) it keeps ``--bf16`` and Megatron trains in bf16 on the CPU as on the GPU: its
Float16Module casts the model to bf16, the optimizer keeps fp32 main weights, and the load digest
holds the bf16 parameters against the checkpoint rounded to bf16. After the run,
the step's own checks run on it: the log (:func:`verify_megatron_log`) and the load digest
(:func:`verify_load_digest`, against the converted checkpoint under its TE names).
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from crossalign.sides.protocol import TrainRequest
from crossalign.sides.launch import RunScript, run_script_locally, write_run_script
from crossalign.sides.megatron.backend import ARGS_FILE, DATA_CACHE_DIR, MegatronBackend
from crossalign.sides.megatron.load_digest import LOAD_DIGEST_DIR, verify_load_digest
from crossalign.sides.megatron.log_checks import parse_iteration_line, verify_megatron_log
from crossalign.sides.megatron import rehearsal_cpu as megatron_cpu
from crossalign.site import FrameworkSite, SiteConfig
from crossalign.config import AlignmentConfig
from crossalign.data.files import DatasetFiles
from crossalign.dump_settings import DUMP_DIR, DumpSettings, collected_dump
from crossalign.models.layout import split_stacked_experts
from crossalign.patching import megatron_core_version
from crossalign.sides.megatron.te_local import te_to_local

SCRIPT = "rehearse_megatron.sh"
LOCAL_CHECKPOINT = "checkpoint_local_names"


@dataclass
class GpuRehearsal:
    """What a gpu rehearsal ran, what it stood in for, and the losses it logged."""

    folder: Path
    log: Path
    checkout: Path
    megatron_core: str
    argument_changes: list[megatron_cpu.ArgumentChange]
    workarounds: list[tuple[str, str]]
    losses: dict[int, dict[str, float]] = field(default_factory=dict)
    digest_tensors: int = 0
    core_differences: list[str] = field(default_factory=list)  # .py files unlike the installed megatron-core's
    precision: str = "fp32"            # what Megatron trained in here: "bf16" (--bf16 kept) or "fp32"
    generated_precision: str = "fp32"  # what the step's generated launch trains in ("bf16": it passes --bf16)
    dump: dict | None = None  # what msprobe dumped (crossalign.dump_settings.collected_dump), with a dump asked

    @property
    def precision_statement(self) -> str:
        """The report's line on precision: what the launch asks for, what ran, and what was stood in."""
        if self.precision == self.generated_precision == "bf16":
            return ("precision: bf16, as the generated launch (--bf16 kept: Megatron's Float16Module and fp32 main "
                    "weights, in bf16 on the CPU)")
        if self.precision == self.generated_precision:
            return "precision: fp32, as the generated launch (no --bf16)"
        return ("precision: fp32 stood in for the generated --bf16 (dropped, so the losses can be held against "
                "the embedded fp32 run; crossalign rehearse --bf16 keeps it)")

    def embedded_comparison(self, embedded: dict[int, dict[str, float]], embedded_precision: str) -> str:
        """The report's line holding these losses against the run's embedded megatron-core step's."""
        diffs = ", ".join(f"{name} {value:.1e}" for name, value in sorted(max_abs_diff(self.losses, embedded).items()))
        if embedded_precision == self.precision:
            return f"against the run's embedded megatron-core step ({embedded_precision} both), max |diff|: {diffs}"
        return (f"against the run's embedded megatron-core step, which trained in {embedded_precision} while this "
                f"rehearsal trained in {self.precision} (not comparable to print precision), max |diff|: {diffs}")


def logged_losses(log: Path) -> dict[int, dict[str, float]]:
    """Iteration -> the losses a Megatron log printed for it (lm_loss, mtp_1_loss, aux_loss), as printed."""
    out: dict[int, dict[str, float]] = {}
    with open(log, encoding="utf-8", errors="replace") as lines:
        for line in lines:
            parsed = parse_iteration_line(line)
            if parsed:
                out[parsed[0]] = {k: v for k, v in parsed[2].items() if k.endswith("_loss")}
    return out


def core_differences(checkout: Path) -> list[str]:
    """The ``.py`` files of the checkout's ``megatron/core`` that differ from the installed megatron-core's.

    The run script puts the checkout first on PYTHONPATH, so Megatron runs the checkout's own
    megatron/core (it has the Makefile and helpers.cpp the wheel lacks); the CPU workarounds and
    the embedded run are the installed wheel's: they must be the same code (core_v0.16.1 and the
    0.16.1 wheel are).
    """
    installed = Path(importlib.util.find_spec("megatron.core").submodule_search_locations[0])
    ours = checkout / "megatron" / "core"
    names = ({p.relative_to(ours) for p in ours.rglob("*.py")}
             | {p.relative_to(installed) for p in installed.rglob("*.py")})
    return sorted(str(name) for name in names
                  if not (ours / name).exists() or not (installed / name).exists()
                  or (ours / name).read_bytes() != (installed / name).read_bytes())


def write_local_checkpoint(init: Path, folder: Path, config: AlignmentConfig) -> Path:
    """The converted checkpoint under megatron-core's local-module names (what the CPU model holds), in the run's
    Megatron checkpoint format: legacy rank files, or torch_dist under the local model's sharded keys."""
    # loads torch, which an agent that only launches Megatron may lack
    from crossalign.sides.megatron.checkpoint import (read_megatron_checkpoint, write_megatron_checkpoint,
                                                      write_torch_dist_checkpoint)
    from crossalign.sides.megatron.torch_dist_layout import torch_dist_layout
    from crossalign.tensorio.torch_file import TensorSpec

    model, core_version = config.model, config.training.megatron_core_version
    checkpoint = read_megatron_checkpoint(init, model, core_version)
    state = split_stacked_experts(checkpoint.state, model.num_experts)
    target = folder / LOCAL_CHECKPOINT
    shutil.rmtree(target, ignore_errors=True)
    if config.training.megatron_ckpt_format == "torch_dist":
        specs = {key: TensorSpec(tuple(tensor.shape), tensor.dtype) for key, tensor in state.items()}
        write_torch_dist_checkpoint(target, checkpoint.iteration, specs, state.items(),
                                    torch_dist_layout(model, core_version, "per_expert", names="local"))
    else:
        write_megatron_checkpoint(target, checkpoint.iteration, te_to_local(state, model, core_version))
    return target


def _replace_value(args: list[str], flag: str, value: str) -> list[str]:
    index = args.index(flag)
    return [*args[: index + 1], value, *args[index + 2:]]


def rehearse_gpu(config: AlignmentConfig, data: DatasetFiles, init_checkpoint: Path, checkout: Path, folder: Path, *,
                 fp32: bool = True, on_line=lambda line: None, dump: DumpSettings | None = None) -> GpuRehearsal:
    """Rehearse the megatron-train step of a run of ``config`` on ``data`` from ``init_checkpoint`` (the run's
    converted checkpoint) in ``folder`` with the Megatron-LM ``checkout``; raises on failure. With ``dump``, the
    launch is the dump-enabled one (msprobe's config.json, the launcher's PrecisionDebugger) and the rehearsal
    fails unless msprobe wrote the dump step (``folder``/msprobe_dump/step{N}/rank{R}/)."""
    folder = folder.absolute()
    for previous in (LOCAL_CHECKPOINT, LOAD_DIGEST_DIR, DATA_CACHE_DIR, DUMP_DIR):  # a rehearsal starts from nothing
        shutil.rmtree(folder / previous, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    init = Path(init_checkpoint).absolute()
    site = SiteConfig(backends={"gpu": "megatron"},
                      megatron=FrameworkSite(path=checkout, python=sys.executable, nproc_per_node=1))
    backend = MegatronBackend(site)
    request = TrainRequest(config=config, side="megatron", mode="align", data=data, output_dir=folder,
                           init_checkpoint=init, save=False, dump=dump)
    backend.write_launch(request)  # run_megatron.sh and megatron_args.txt, as the step writes them
    generated = (folder / ARGS_FILE).read_text().split()
    real = backend.run_script(request, generated)
    args, changes = megatron_cpu.cpu_arguments(generated, fp32=fp32)
    generated_precision = "bf16" if "--bf16" in generated else "fp32"
    precision = "bf16" if "--bf16" in args else "fp32"
    args = _replace_value(args, "--load", str(write_local_checkpoint(init, folder, config)))
    entry = Path(real.command[real.command.index("--nproc_per_node") + 2])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc_per_node", "1",
               "-m", "crossalign.sides.megatron.rehearsal_cpu", str(entry), *args]
    script = RunScript(command=command, cwd=real.cwd, env=dict(real.env), path_prepend=real.path_prepend,
                       required_files=real.required_files, checks=real.checks,
                       title=f"rehearsal on CPU of: {real.title}")
    write_run_script(folder / SCRIPT, script)
    log = folder / "train.log"
    status = run_script_locally(folder / SCRIPT, log, on_line)
    verify_megatron_log(log, iterations=request.iterations, loaded=True, exit_status=status)
    tensors = verify_load_digest(folder / LOAD_DIGEST_DIR, init, config)
    dumped = collected_dump(dump, folder) if dump is not None else None
    return GpuRehearsal(folder=folder, log=log, checkout=checkout,
                        megatron_core=".".join(map(str, megatron_core_version(checkout) or ())),
                        argument_changes=changes, workarounds=megatron_cpu.workarounds(bf16=precision == "bf16"),
                        losses=logged_losses(log), digest_tensors=tensors,
                        core_differences=core_differences(checkout), precision=precision,
                        generated_precision=generated_precision, dump=dumped)



def max_abs_diff(ours: dict[int, dict[str, float]], theirs: dict[int, dict[str, float]]) -> dict[str, float]:
    """Per loss name, the largest |difference| over the iterations both logged (printed values, %.6E)."""
    out: dict[str, float] = {}
    for iteration in sorted(set(ours) & set(theirs)):
        for name in set(ours[iteration]) & set(theirs[iteration]):
            out[name] = max(out.get(name, 0.0), abs(ours[iteration][name] - theirs[iteration][name]))
    return out
