#!/usr/bin/env bash
# gpu_check.sh: a real Megatron-LM step on one NVIDIA GPU against crossalign's fp32 reference.
#
# What it checks (scripts/gpu_check.py does the work; under 10 minutes with the tiny configs):
#   1. builds the tiny dataset, a random tiny MindFormers checkpoint, its bf16 cast and the
#      Megatron conversion (DAG steps 2 and 3);
#   2. trains two iterations through crossalign's real Megatron backend (run script, launcher for
#      MTP + GatedDeltaNet, log checks: failed unpickle, non-strict load, missing iterations);
#   3. compares Megatron's step-1 lm and mtp losses with our PyTorch model in fp32 on CPU on the
#      same global batch (relative error < 0.5%);
#   4. runs our PyTorch model on CUDA, where it uses fla's chunk_gated_delta_rule, against the
#      CPU naive chunk form (this part needs only torch + triton + fla-core).
#
# Expected environment:
#   - one NVIDIA GPU with a CUDA build of torch (>= 2.6), TransformerEngine and flash-linear-attention
#     (fla-core) importable from this Python;
#   - a Megatron-LM checkout whose megatron/core/package_info.py matches the config's
#     training.megatron_core_version (0.16.x for the shipped configs): MEGATRON_LM=/path/to/Megatron-LM;
#   - crossalign installed in the same Python (pip install -e /path/to/crossalign, without the
#     'local' extra: the image's torch must stay).
#
# Machines without internet: on a connected machine with the same Python version, collect wheels
#     pip download --dest wheels /path/to/crossalign fla-core einops pyyaml pydantic typer rich pandas \
#         matplotlib safetensors tokenizers
#     (add megatron-core==0.16.1 if the image has none; TransformerEngine must come from the image)
# copy wheels/ and the crossalign and Megatron-LM checkouts over, then
#     pip install --no-index --find-links wheels --no-deps wheels/*.whl && pip install --no-deps -e crossalign
#
# Usage: MEGATRON_LM=/path/to/Megatron-LM bash scripts/gpu_check.sh [--work DIR] [--model qwen35_moe_tiny]
#        bash scripts/gpu_check.sh --skip-megatron   # only the fla kernel check (no Megatron/TE needed)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python3}"

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
"$python" - <<'PY'
import importlib, sys
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device")
for name in ("triton", "fla", "crossalign"):
    importlib.import_module(name)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device {torch.cuda.get_device_name(0)}")
PY

args=("$@")
if [[ " ${args[*]-} " != *" --skip-megatron "* ]]; then
    : "${MEGATRON_LM:?set MEGATRON_LM to the Megatron-LM checkout (or pass --skip-megatron)}"
    "$python" -c "import transformer_engine" || { echo "gpu_check: TransformerEngine is not importable" >&2; exit 1; }
fi
exec timeout 600 "$python" "$here/gpu_check.py" --megatron "${MEGATRON_LM:-.}" "${args[@]}"
