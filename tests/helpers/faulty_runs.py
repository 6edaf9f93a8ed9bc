"""A run with a conversion fault committed at step 3, for the tests that watch a training stop on it."""

from __future__ import annotations

import subprocess

from crossalign.checkpoint.convert import convert_checkpoint
from crossalign.request import RunRequest
from crossalign.tasks.command import step_argv, step_command
from crossalign.tasks.prepare import prepare_run

TINY = ["training.base_train_iters=3", "training.lr_warmup_iters=2", "training.seq_length=64",
        "training.global_batch_size=2", "training.micro_batch_size=2"]
FAULT = "dense_fc1_not_deinterleaved"  # a value fault: the checkpoint loads strictly, every loss is off
RUN_TIMEOUT_S = 600


def faulty_run(embedded, run_id: str, overrides: list[str], fault: str, timeout_s: float):
    """A run whose steps 1 and 2 are done as usual (each in its own process, as an agent runs it) and whose step 3
    committed a conversion with ``fault``; ``embedded`` holds the run store and the environment of the steps."""
    run = prepare_run(RunRequest(config="qwen35_dense_tiny", run_id=run_id, overrides=overrides,
                                 store=str(embedded["store"]), mode="embedded").resolve())
    for step in ("base-train", "cast-bf16"):
        done = subprocess.run(step_argv(str(run.store.root), run_id, step, embedded=True), env=embedded["env"],
                              capture_output=True, text=True, timeout=timeout_s)
        assert done.returncode == 0, done.stdout + done.stderr
    config = run.config
    with run.commit("convert", command=step_command(run, "convert")) as out:
        convert_checkpoint(config.model, "ms2mg", run.step_dir("cast-bf16") / "checkpoint", out.dir / "checkpoint",
                           core_version=config.training.megatron_core_version, fault=fault)
    return run
