"""Dumps written by msprobe's own writer (mindstudio-probe 26.2.0) from crossalign's embedded models.

The PyTorch side runs crossalign's torch reference model (Megatron's parameter layout) one training step under
msprobe's ``PrecisionDebugger``; nothing here writes the msprobe format itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from crossalign.config import ModelConfig
from crossalign.diagnose.references import Batch
from crossalign.models.torch_model import Qwen35Model, load_megatron_state

REPO = Path(__file__).resolve().parents[2]


def write_msprobe_config(path: Path, dump_path: Path, task: str, level: str, steps: list[int] | None = None) -> Path:
    """msprobe's config.json dumping ``steps`` (default step 0; its schema: msprobe/config.json in the installed
    package)."""
    config = {"task": task, "dump_path": str(dump_path), "rank": [], "step": [0] if steps is None else steps,
              "level": level, "async_dump": False,
              task: {"scope": [], "list": [], "data_mode": ["all"], "summary_mode": "statistics"}}
    if task == "md5":
        config = {**config, "task": "statistics",
                  "statistics": {"scope": [], "list": [], "data_mode": ["all"], "summary_mode": "md5"}}
        config.pop("md5")
    path.write_text(json.dumps(config))
    return path


def torch_dump(model: ModelConfig, state, batch: Batch, out: Path, task: str = "statistics",
               level: str = "L0") -> Path:
    """One forward+backward of the torch reference model under msprobe; returns the dump root (step0/rank/...)."""
    from msprobe.pytorch import PrecisionDebugger  # heavy optional framework, imported only when dumping

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    net = Qwen35Model(model)
    if state is not None:
        load_megatron_state(net, state)
    debugger = PrecisionDebugger(config_path=str(write_msprobe_config(out / "config.json", out / "dump", task, level)))
    debugger.start(model=net)
    _, loss, mtp, aux = net(torch.from_numpy(batch.input_ids), torch.from_numpy(batch.labels),
                            torch.from_numpy(batch.loss_mask))
    (loss + aux).backward()
    debugger.stop()
    debugger.step()
    return out / "dump"


def torch_dump_subprocess(config_name: str, out: Path, task: str = "statistics", level: str = "L0",
                          seq: int = 8, batch: int = 1) -> Path:
    """``torch_dump`` in a fresh process: msprobe's PrecisionDebugger is a process-wide singleton, so each
    dump with another task or level needs its own interpreter."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "tests.helpers.msprobe_dumps", config_name, str(out), task, level,
                             str(seq), str(batch)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"msprobe dump of {config_name} ({task}, {level}) failed:\n{result.stderr[-4000:]}")
    return out / "dump"


if __name__ == "__main__":
    from crossalign.config import load_config
    from crossalign.diagnose.references import random_batch

    name, folder, task_arg, level_arg, seq_arg, batch_arg = sys.argv[1:7]
    config = load_config(name)
    torch_dump(config.model, None, random_batch(config.model, int(seq_arg), int(batch_arg), seed=5),
               Path(folder), task_arg, level_arg)
