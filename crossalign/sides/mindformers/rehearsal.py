"""The npu rehearsal: a run's pynative-train YAML read by the site's MindFormers, as far as a CPU goes.

The YAML is generated as the step generates it (:func:`mindformers_yaml`, the same arguments as
``MindFormersBackend.train``) and loaded by MindFormers' own config loader in the framework's
interpreter, with the checkout first on PYTHONPATH: ``TrainConfig.load_from_yaml`` where the
release has it (the pynative trainer's, 2.1.0), else ``MindFormerConfig`` (every release). The
model build, the load and the training need the NPU (and CANN): they are not rehearsed here.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from crossalign.config import AlignmentConfig
from crossalign.data.files import DatasetFiles
from crossalign.sides.mindformers.yaml import dump_yaml, mindformers_yaml

# Run by the framework's interpreter: load the YAML with the release's own loader, say which one.
LOAD_WITH_MINDFORMERS = """
import sys
path = sys.argv[1]
try:
    from mindformers.pynative.config import TrainConfig
except ImportError:
    TrainConfig = None
if TrainConfig is not None and hasattr(TrainConfig, "load_from_yaml"):
    TrainConfig.load_from_yaml(path)
    print("loaded by mindformers.pynative.config.TrainConfig.load_from_yaml")
else:
    from mindformers.tools.register import MindFormerConfig
    MindFormerConfig(path)
    print("loaded by mindformers.tools.register.MindFormerConfig")
"""


class NpuRehearsalError(RuntimeError):
    """MindFormers' own loader refused the generated YAML (or could not be run); says why."""


@dataclass
class NpuRehearsal:
    yaml: Path
    loader: str


def rehearse_npu(config: AlignmentConfig, data: DatasetFiles, load_dir: Path, mindformers: Path, python: str,
                 folder: Path) -> NpuRehearsal:
    """Write the pynative-train YAML of a run of ``config`` on ``data`` from ``load_dir`` (the run's bf16 checkpoint)
    into ``folder`` and load it with the MindFormers checkout's own loader."""
    folder.mkdir(parents=True, exist_ok=True)
    yaml_data = mindformers_yaml(config, mode="align", data_prefix=data.prefix.absolute(), tokenizer=data.tokenizer,
                                 load_dir=load_dir.absolute())
    path = dump_yaml(yaml_data, folder / "align_train.yaml")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(mindformers),
                                                                     os.environ.get("PYTHONPATH"))))}
    try:
        done = subprocess.run([python, "-c", LOAD_WITH_MINDFORMERS, str(path)], capture_output=True, text=True,
                              env=env, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NpuRehearsalError(f"{python} could not run MindFormers' config loader: {exc}") from None
    if done.returncode != 0:
        raise NpuRehearsalError(f"MindFormers ({mindformers}) does not load {path}: "
                                f"{(done.stderr or done.stdout).strip()[-1500:]}")
    return NpuRehearsal(yaml=path, loader=done.stdout.strip().splitlines()[-1])
