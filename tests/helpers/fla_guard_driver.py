"""Run fla-core releases' own ``chunk_bwd_dqkwg`` (``fla/ops/common/chunk_o.py``) under given versions and a
given GPU, and say which way it went; run by ``tests/helpers/fla_wheels.py`` as ``python fla_guard_driver.py``
with a JSON list of cases on stdin (each naming the unpacked release), one JSON line out per case.

Each case sets, before the release's modules are imported afresh: ``triton.__version__`` (fla computes its
TRITON_ABOVE_* flags from it at import), the GPU Triton's driver and torch report (fla's IS_NVIDIA_HOPPER reads
torch.cuda's device name and capability at import), whether a ``tilelang`` package can be found (an empty stand-in
on sys.path) and the process environment fla reads (PATH, CUDA_HOME, FLA_TILELANG, ...). The location fla checks
last for nvcc, ``/usr/local/cuda``, is read through ``fake_cuda`` instead, so that a machine with a CUDA toolkit
can play one without. The call gets the tensors GatedDeltaNet's backward hands it (gated, as many key as value
heads, h in q's dtype) on CPU; nothing runs on a GPU, so the call always ends in an exception, and where it was
raised tells the route:

- ``guard``: fla's own RuntimeError naming #640, raised in chunk_bwd_dqkwg (the run stops at its first backward);
- ``tilelang``: fla's dispatch handed the call to its TileLang backend;
- ``triton``: past every guard into Triton's launch of the kernel.
"""

from __future__ import annotations

import glob
import importlib
import json
import os
import sys
import traceback
import types
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget

class GpuDriver:
    """What fla asks Triton's active driver at import and before a launch, for one simulated GPU."""

    def __init__(self, capability: tuple[int, int]):
        self.capability = capability

    def get_current_target(self):
        return GPUTarget("cuda", 10 * self.capability[0] + self.capability[1], 32)

    class utils:  # noqa: N801 (the driver's attribute)
        @staticmethod
        def get_device_properties(index):
            return {"max_shared_mem": 232448, "multiprocessor_count": 132}


def simulate_gpu(name: str, capability: tuple[int, int]) -> None:
    triton.runtime.driver.set_active(GpuDriver(capability))
    torch.cuda.get_device_name = lambda *args: name
    torch.cuda.get_device_capability = lambda *args: capability
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0


def fresh_release(wheel: str) -> None:
    """Forget every fla module, then make fla, fla.ops and fla.ops.common bare packages of the release: their
    __init__ files import every op of the release, which this Triton may not compile the decorators of."""
    for name in [n for n in sys.modules if n == "fla" or n.startswith("fla.") or n == "tilelang"
                 or n.startswith("tilelang.")]:
        del sys.modules[name]
    importlib.invalidate_caches()
    for name in ("fla", "fla.ops", "fla.ops.common"):
        module = types.ModuleType(name)
        module.__path__ = [os.path.join(wheel, *name.split("."))]
        sys.modules[name] = module
    metadata = Path(glob.glob(os.path.join(wheel, "fla_core-*.dist-info", "METADATA"))[0]).read_text()
    sys.modules["fla"].__version__ = metadata.split("\nVersion: ", 1)[1].split()[0]


def read_cuda_default_through(fake_cuda: str) -> None:
    """fla's nvcc search (``has_usable_nvcc``, from 0.5.2) reads ``/usr/local/cuda`` last: through ``fake_cuda``."""
    import fla.utils

    finder = getattr(fla.utils, "has_usable_nvcc", None)
    if finder is None:
        return
    module = sys.modules[finder.__module__]
    real = Path

    def remapped(*parts):
        path = real(*parts)
        text = str(path)
        return real(fake_cuda + text[len("/usr/local/cuda"):]) if text.startswith("/usr/local/cuda") else path

    module.Path = remapped


def route(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    files = [frame.filename for frame in frames]
    if any(f"{os.sep}backends{os.sep}tilelang{os.sep}" in name for name in files):
        return "tilelang"
    if isinstance(error, RuntimeError) and "#640" in str(error) and files[-1].endswith("chunk_o.py"):
        return "guard"
    triton_dir = os.path.dirname(triton.__file__)
    chunk_o = [i for i, name in enumerate(files) if name.endswith(os.path.join("common", "chunk_o.py"))]
    if chunk_o and any(name.startswith(triton_dir) for name in files[chunk_o[-1]:]):
        return "triton"
    return "unknown: " + "".join(traceback.format_exception(error))[-1500:]


def run(case: dict) -> dict:
    os.environ.clear()
    os.environ.update(case["environ"])
    sys.path[:] = [entry for entry in sys.path if entry not in case["all_extra_paths"]] + case["extra_paths"]
    triton.__version__ = case["triton"]
    simulate_gpu(case["device_name"], tuple(case["capability"]))
    fresh_release(case["release"])
    read_cuda_default_through(case["fake_cuda"])
    import fla.utils

    nvcc = getattr(fla.utils, "has_usable_nvcc", None)
    usable_nvcc = None if nvcc is None else bool(nvcc())
    from fla.ops.common import chunk_o

    B, T, H, K, V = 1, 64, 2, 16, 16
    q, k, w = (torch.randn(B, T, H, K) for _ in range(3))
    v, do, dv = (torch.randn(B, T, H, V) for _ in range(3))
    h, dh = (torch.randn(B, 1, H, K, V) for _ in range(2))
    g = -torch.rand(B, T, H)
    try:
        chunk_o.chunk_bwd_dqkwg(q=q, k=k, v=v, do=do, h=h, dh=dh, w=w, g=g, dv=dv, scale=K ** -0.5)
    except BaseException as error:  # noqa: BLE001 (the route is told by what was raised, and where)
        return {"route": route(error), "has_usable_nvcc": usable_nvcc}
    return {"route": "returned", "has_usable_nvcc": usable_nvcc}


if __name__ == "__main__":
    saved_environ = dict(os.environ)
    for case in json.load(sys.stdin):
        print(json.dumps(run(case)), flush=True)
    os.environ.update(saved_environ)
