"""Read the GPU environment of this Python: the versions the known-bad table (``gpu_env``) is held against.

Standard library only (torch and the kernels' packages are imported only to ask them), so that the gpu agent's
probe can run this file with the framework's own interpreter: ``python gpu_env_read.py [FIELD ...]`` prints one
JSON line (FIELD: whose imports to try; default all).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import shutil
import sys
from pathlib import Path

# record field -> the distributions that provide it (first installed wins)
DISTRIBUTIONS = {
    "torch": ("torch",),
    "triton": ("triton", "pytorch-triton"),
    "fla": ("fla-core", "flash-linear-attention"),
    "tilelang": ("tilelang",),
    "transformer_engine": ("transformer-engine", "transformer_engine", "transformer-engine-torch"),
    "megatron_core": ("megatron-core", "megatron_core"),
    "causal_conv1d": ("causal-conv1d", "causal_conv1d"),
}
# record field -> the modules megatron-core imports from it (core_v0.16.1 megatron/core/ssm/gated_delta_net.py
# lines 39-53; megatron/core/extensions/transformer_engine.py imports transformer_engine.pytorch), and fla's
# TileLang route tilelang
IMPORTS = {
    "fla": ("fla.modules.l2norm", "fla.ops.gated_delta_rule"),
    "causal_conv1d": ("causal_conv1d",),
    "transformer_engine": ("transformer_engine.pytorch",),
    "tilelang": ("tilelang",),  # fla's TileLang route imports it at the first backward
}
# the process settings that steer fla's backend dispatch (fla-core 0.5.x fla/ops/backends/__init__.py, 0.6.0
# fla/backends.py: FLA_DISABLE_BACKEND_DISPATCH=1 bypasses every backend, FLA_TILELANG turns TileLang on or off)
FLA_SETTINGS = ("FLA_TILELANG", "FLA_DISABLE_BACKEND_DISPATCH")
CUDA_DEFAULT = "/usr/local/cuda"


def usable_nvcc(cuda_default: str = CUDA_DEFAULT) -> bool:
    """Whether fla finds an nvcc for TileLang's JIT, looked for as fla-core 0.5.2 ``has_usable_nvcc`` does
    (fla/utils/_compat.py lines 38-65; 0.6.0 fla/utils/env.py lines 125-153): CUDA_HOME or else CUDA_PATH with a
    bin/nvcc file, an nvcc on PATH, an nvcc file in the nvidia-cuda-nvcc distribution, ``cuda_default``/bin/nvcc."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home is not None and (Path(cuda_home) / "bin" / "nvcc").exists():
        return True
    if shutil.which("nvcc") is not None:
        return True
    try:
        files = importlib.metadata.files("nvidia-cuda-nvcc") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    if any(file.name in ("nvcc", "nvcc.exe") for file in files):
        return True
    return (Path(cuda_default) / "bin" / "nvcc").exists()


def installed_version(field: str) -> str | None:
    for name in DISTRIBUTIONS[field]:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def import_error(modules: tuple[str, ...]) -> str | None:
    """The first failure importing ``modules`` (an undefined symbol of an extension built for another torch,
    a moved module), or None."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # an extension's ImportError, OSError or RuntimeError alike
            return f"import {module}: {type(exc).__name__}: {exc}".splitlines()[0][:300]
    return None


def read_environment(imports: tuple[str, ...] = tuple(IMPORTS)) -> dict:
    """Versions, CUDA build, the GPU's compute capability (None without a CUDA device), whether fla would find an
    nvcc, fla's dispatch settings and the import failures of the fields in ``imports``."""
    record: dict = {field: installed_version(field) for field in DISTRIBUTIONS}
    record.update(cuda=None, capability=None, device_name=None, import_errors={}, nvcc=usable_nvcc(),
                  fla_settings={name: os.environ[name] for name in FLA_SETTINGS if name in os.environ})
    if record["torch"] is not None:
        import torch  # only when installed: this file runs in interpreters without it too

        record["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            record["capability"] = list(torch.cuda.get_device_capability(0))
            record["device_name"] = torch.cuda.get_device_name(0)
    for field, modules in IMPORTS.items():
        if field in imports and record[field] is not None:
            error = import_error(modules)
            if error:
                record["import_errors"][field] = error
    return record


if __name__ == "__main__":
    print("@@gpu_env@@" + json.dumps(read_environment(tuple(sys.argv[1:]) or tuple(IMPORTS))))
    sys.exit(0)
