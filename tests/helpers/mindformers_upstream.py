"""Run MindFormers' own code (the released wheels) on this machine's MindSpore, for the tests.

``scripts/setup.sh --dev`` downloads the wheels of the releases crossalign is checked against into
``.cache/mindformers-wheels/`` (no dependencies: each release pins another MindSpore, and its
pure-Python imports are in the ``dev`` extra). A wheel is a zip: it is unpacked once into
``.cache/mindformers/<version>/`` and run in a subprocess with that tree and the ``hyper_parallel``
stand-in (``tests/mindformers_stub``) first on PYTHONPATH. Tests skip, naming the missing wheel,
when it was not downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from crossalign.config import load_config
from crossalign.models.layout import mindformers_buffers, mindformers_shapes
from crossalign.sides.mindformers.yaml import dump_yaml, mindformers_yaml

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / ".cache" / "mindformers-wheels"
UNPACKED = ROOT / ".cache" / "mindformers"
STUB = Path(__file__).resolve().parents[1] / "mindformers_stub"
DRIVER = Path(__file__).resolve().parent / "mindformers_driver.py"
RELEASES = ("2.0.0", "2.1.0")  # the releases crossalign supports (training.mindformers_version)
TIMEOUT_S = 600


def wheel(version: str) -> Path:
    return WHEELS / f"mindformers-{version}-py3-none-any.whl"


def unpacked(version: str) -> Path:
    """The unpacked wheel of ``version`` (unpacked on first use); skips the test when the wheel is missing."""
    target = UNPACKED / version
    if (target / "mindformers" / "__init__.py").exists():
        return target
    if not wheel(version).exists():
        pytest.skip(f"{wheel(version)} is missing: scripts/setup.sh --dev downloads the MindFormers wheels")
    staging = UNPACKED / f".{version}.{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    with zipfile.ZipFile(wheel(version)) as archive:
        archive.extractall(staging)
    try:
        staging.rename(target)
    except OSError:  # another process unpacked it first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def run_driver(version: str, job: dict, workdir: Path, tree: Path | None = None) -> tuple[dict, Path]:
    """Run ``mindformers_driver.py`` on ``job`` with MindFormers ``version`` (or the given tree); returns
    its result and the file holding everything it printed (MindFormers' logger writes to stdout)."""
    tree = tree or unpacked(version)
    workdir.mkdir(parents=True, exist_ok=True)
    job_file, result_file, log_file = workdir / "job.json", workdir / "result.json", workdir / "driver.log"
    job_file.write_text(json.dumps({**job, "result": str(result_file)}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(STUB)]),
           "LOG_MF_PATH": str(workdir / "mf_log"), "GLOG_v": "3"}
    with open(log_file, "w") as out:
        status = subprocess.run([sys.executable, str(DRIVER), str(job_file)], cwd=workdir, env=env, stdout=out,
                                stderr=subprocess.STDOUT, timeout=TIMEOUT_S).returncode
    if status != 0 or not result_file.exists():
        tail = "".join(log_file.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise AssertionError(f"MindFormers {version} driver exited with status {status}:\n{tail}")
    return json.loads(result_file.read_text()), log_file


def generated(tmp: Path, name: str, mode: str = "align") -> str:
    config = load_config(name)
    kwargs = {"load_dir": "/ckpt"} if mode == "align" else {"save_dir": "/out"}
    data = mindformers_yaml(config, mode=mode, data_prefix="/data/p", **kwargs)
    return str(dump_yaml(data, tmp / f"{name}_{mode}.yaml"))


def expected_public(name: str) -> dict[str, tuple[int, ...]]:
    """crossalign's MindFormers layout of the model, as public MindFormers can build it: every layer is
    full attention (no GatedDeltaNet) and linear_qkv has no output-gate rows (nh * head_dim fewer)."""
    m = load_config(name).model
    expected = {**mindformers_shapes(m), **mindformers_buffers(m)}
    first = f"decoder.layers.{m.layer_kinds.index('attention')}."
    attention = {key.removeprefix(first): shape for key, shape in expected.items()
                 if key.startswith(first + "self_attention.")}
    out = {key: shape for key, shape in expected.items()
           if not (key.startswith("decoder.layers.") and ".self_attention." in key)}
    for i in range(m.num_layers):
        out.update({f"decoder.layers.{i}.{key}": shape for key, shape in attention.items()})
    gate_rows = m.num_attention_heads * m.kv_channels
    return {key: (shape[0] - gate_rows, shape[1]) if key.endswith("linear_qkv.weight") else shape
            for key, shape in out.items()}
