"""Run the fla-core releases' own code for the GPU environment check's tests (no GPU needed).

``scripts/setup.sh --dev`` downloads the fla-core wheels of :data:`RELEASES` into ``.cache/fla-wheels/`` (no
dependencies). A wheel is a zip: it is unpacked once into ``.cache/fla/<version>/`` and its ``chunk_bwd_dqkwg``
run by ``fla_guard_driver.py`` in a subprocess for each :class:`GpuCase` asked of it (the Triton version, the
GPU, whether tilelang is installed, where an nvcc is, fla's settings). :class:`Sandbox` makes the
folders a case points the process at. Tests skip, naming the missing wheel, when it was not downloaded.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / ".cache" / "fla-wheels"
UNPACKED = ROOT / ".cache" / "fla"
DRIVER = Path(__file__).resolve().parent / "fla_guard_driver.py"
RELEASES = ("0.4.0", "0.4.1", "0.4.2", "0.5.0", "0.5.1", "0.5.2", "0.6.0")
NEWEST = RELEASES[-1]
TIMEOUT_S = 600
HOPPER = ("NVIDIA H100 80GB HBM3", (9, 0))
AMPERE = ("NVIDIA A100-SXM4-80GB", (8, 0))
NVCC_PLACES = (None, "PATH", "CUDA_HOME", "CUDA_PATH", "nvidia-cuda-nvcc", "/usr/local/cuda")


def wheel(version: str) -> Path:
    return WHEELS / f"fla_core-{version}-py3-none-any.whl"


def unpacked(version: str) -> Path:
    """The release's files, unpacked from its wheel once; skips the test when the wheel is missing."""
    folder = UNPACKED / version
    if (folder / "fla").is_dir():
        return folder
    if not wheel(version).is_file():
        pytest.skip(f"{wheel(version)} is missing: scripts/setup.sh --dev downloads it")
    partial = folder.with_name(f".{version}.partial-{os.getpid()}")
    with zipfile.ZipFile(wheel(version)) as archive:
        archive.extractall(partial)
    partial.replace(folder)
    return folder


@dataclass(frozen=True)
class GpuCase:
    """One machine: the Triton version, the GPU, tilelang installed or not, where an nvcc is (one of
    :data:`NVCC_PLACES`; None: nowhere) and fla's settings."""

    triton: str
    device: tuple[str, tuple[int, int]] = HOPPER
    tilelang: bool = False
    nvcc: str | None = None
    fla_settings: tuple[tuple[str, str], ...] = ()  # (name, value) pairs: FLA_TILELANG, FLA_DISABLE_BACKEND_DISPATCH

    def without_tilelang(self) -> "GpuCase":
        return GpuCase(self.triton, self.device, False, self.nvcc, self.fla_settings)


# what fla's modules touch of tilelang when they are imported (0.6.0 fla/ops/utils/sinkhorn/tilelang.py decorates
# its kernels with tilelang.jit); nothing of it runs a kernel
TILELANG_STAND_IN = """
class PassConfigKey:
    TL_DEVICE_COMPILE_FLAGS = "tl.device_compile_flags"


def jit(*args, **kwargs):
    return args[0] if args and callable(args[0]) else (lambda function: function)
"""


class Sandbox:
    """The folders a case points a process at: a PATH folder with an nvcc and one without, a CUDA home with
    bin/nvcc, a distribution nvidia-cuda-nvcc that lists an nvcc, a stand-in for /usr/local/cuda with and one
    without bin/nvcc, and a findable, importable ``tilelang`` stand-in (:data:`TILELANG_STAND_IN`)."""

    def __init__(self, root: Path):
        self.root = root
        for folder in ("path_nvcc", "path_empty", "cuda_home/bin", "cuda_default/bin", "no_cuda", "tilelang_site/tilelang",
                       "nvcc_wheel_site/nvidia_cuda_nvcc-13.0.88.dist-info"):
            (root / folder).mkdir(parents=True, exist_ok=True)
        for nvcc in ("path_nvcc/nvcc", "cuda_home/bin/nvcc", "cuda_default/bin/nvcc"):
            (root / nvcc).write_text("#!/bin/sh\nexit 0\n")
            (root / nvcc).chmod(0o755)
        (root / "tilelang_site" / "tilelang" / "__init__.py").write_text(TILELANG_STAND_IN)
        (root / "tilelang_site" / "tilelang" / "language.py").write_text("")
        info = root / "nvcc_wheel_site" / "nvidia_cuda_nvcc-13.0.88.dist-info"
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nvidia-cuda-nvcc\nVersion: 13.0.88\n")
        (info / "RECORD").write_text("nvidia/cu13/bin/nvcc,,\nnvidia_cuda_nvcc-13.0.88.dist-info/METADATA,,\n")

    def extra_paths(self, case: GpuCase) -> list[str]:
        return ([str(self.root / "tilelang_site")] if case.tilelang else []) + (
            [str(self.root / "nvcc_wheel_site")] if case.nvcc == "nvidia-cuda-nvcc" else [])

    def all_extra_paths(self) -> list[str]:
        return [str(self.root / "tilelang_site"), str(self.root / "nvcc_wheel_site")]

    def environ(self, case: GpuCase) -> dict[str, str]:
        environ = {"HOME": os.environ.get("HOME", str(self.root)), **dict(case.fla_settings),
                   "PATH": str(self.root / ("path_nvcc" if case.nvcc == "PATH" else "path_empty"))}
        if case.nvcc in ("CUDA_HOME", "CUDA_PATH"):
            environ[case.nvcc] = str(self.root / "cuda_home")
        return environ

    def cuda_default(self, case: GpuCase) -> str:
        """What stands in for /usr/local/cuda."""
        return str(self.root / ("cuda_default" if case.nvcc == "/usr/local/cuda" else "no_cuda"))

    def record(self, case: GpuCase) -> dict:
        name, capability = case.device
        return {"triton": case.triton, "device_name": name, "capability": list(capability),
                "environ": self.environ(case), "extra_paths": self.extra_paths(case),
                "all_extra_paths": self.all_extra_paths(), "fake_cuda": self.cuda_default(case)}


def run_cases(cases: list[tuple[str, GpuCase]], sandbox: Sandbox) -> list[dict]:
    """Each (release, case) through the release's own chunk_bwd_dqkwg, in one process: {"route": guard |
    tilelang | triton, "has_usable_nvcc": the release's own answer (None before 0.5.2)}."""
    records = [{**sandbox.record(case), "release": str(unpacked(version))} for version, case in cases]
    done = subprocess.run([sys.executable, str(DRIVER)], input=json.dumps(records), capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or len(lines) != len(cases):
        raise AssertionError(f"the fla driver failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in lines]


def run_cases_split(cases: list[tuple[str, GpuCase]], sandbox: Sandbox, processes: int = 2) -> list[dict]:
    """:func:`run_cases` in ``processes`` processes side by side, in the order given."""
    for version, _ in cases:
        unpacked(version)  # skips before any process starts
    shares = [cases[i::processes] for i in range(processes)]
    with ThreadPoolExecutor(max_workers=processes) as pool:
        done = list(pool.map(lambda share: run_cases(share, sandbox), shares))
    results: list[dict] = [{}] * len(cases)
    for i, share in enumerate(done):
        results[i::processes] = share
    return results
