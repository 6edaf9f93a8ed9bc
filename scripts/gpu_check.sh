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
#   4. runs the gated delta rule Megatron's GatedDeltaNet really runs for the config on CUDA against
#      fla's pure-torch recurrence on CPU: with --deterministic-mode (the configs' default) that is
#      Megatron's own torch_chunk_gated_delta_rule and torch's conv1d, not fla's Triton kernel;
#      without it, fla's chunk_gated_delta_rule. The check prints which.
#
# Expected environment:
#   - one NVIDIA GPU with a CUDA build of torch (>= 2.6), TransformerEngine and flash-linear-attention
#     (fla-core; Megatron imports its l2norm even in deterministic mode) importable from this Python;
#   - a Megatron-LM checkout (git clone, at the tag of the config's training.megatron_core_version:
#     core_v0.16.1 for the shipped configs): MEGATRON_LM=/path/to/Megatron-LM. The megatron-core
#     wheel holds only megatron/core; the training code (pretrain_gpt.py, gpt_builders.py,
#     megatron/training) exists only in the checkout, so copy the checkout to the GPU machine;
#   - a Python that satisfies the checkout's requires-python (>= 3.10 for core 0.16, >= 3.12 from 0.17);
#   - crossalign installed in the same Python, without the 'local' extra (the image's torch must stay).
#
# Machines without internet: on a connected machine with the same Python version and platform,
# collect wheels without torch (fla-core and megatron-core are fetched with --no-deps, since their
# dependencies would bring a torch that then replaces the image's CUDA build):
#     pip download --dest wheels /path/to/crossalign tokenizers einops
#     pip download --dest wheels --no-deps fla-core==0.6.0 megatron-core==0.16.1
# copy wheels/ and the crossalign and Megatron-LM checkouts over, then install with the image's
# torch pinned, so that nothing can replace it:
#     python -c 'import torch; print("torch==" + torch.__version__)' > keep-torch.txt
#     pip install --no-index --find-links wheels -c keep-torch.txt -e crossalign tokenizers einops
#     pip install --no-index --no-deps wheels/fla_core-*.whl wheels/megatron_core-*.whl
#
# Without TransformerEngine (--no-te): megatron-core with its local modules and fla, as crossalign's embedded
# side builds them, trains --iterations (30) in bf16 on the GPU; printed: the GPU environment check, the kernels
# that ran and the kernel probe each training ran first (every GatedDeltaNet kernel, forward and backward, against
# megatron-core's torch rule in fp32), step 1 against the fp32 reference, and the run against the same batches in
# fp32 on CPU through `crossalign compare`. No Megatron-LM checkout and no TransformerEngine needed (under 5 minutes with the tiny
# configs on one H200). --device cpu runs the same on CPU (no GPU: the check's own test does that).
#
# Usage, from any working directory (every path is made absolute: the run script changes into the
# Megatron-LM checkout):
#        MEGATRON_LM=/path/to/Megatron-LM bash scripts/gpu_check.sh [--work DIR] [--model qwen35_moe_tiny]
#        bash scripts/gpu_check.sh --skip-megatron   # only the delta-rule check (no Megatron-LM/TE needed)
#        MEGATRON_LM=... bash scripts/gpu_check.sh --dry-run   # inputs and Megatron's run script, no GPU
#        bash scripts/gpu_check.sh --no-te [--iterations 30] [--no-deterministic]   # where TE cannot be had
#        bash scripts/gpu_check.sh --no-te --device cpu --iterations 3   # the same without a GPU
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python3}"
args=("$@")
given() { [[ " ${args[*]-} " == *" $1 "* ]]; }

on_cpu=false
if given "--device cpu"; then on_cpu=true; fi
if ! given --dry-run && ! $on_cpu; then
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
fi

megatron=()
if ! given --skip-megatron && ! given --no-te; then
    : "${MEGATRON_LM:?set MEGATRON_LM to the Megatron-LM checkout (or pass --skip-megatron)}"
    checkout="$(cd "$MEGATRON_LM" && pwd)" || { echo "gpu_check: MEGATRON_LM=$MEGATRON_LM is not a folder" >&2; exit 1; }
    megatron=(--megatron "$checkout")
    if ! given --dry-run; then
        "$python" -c "import transformer_engine" || { echo "gpu_check: TransformerEngine is not importable" >&2; exit 1; }
    fi
fi
exec timeout 600 "$python" "$here/gpu_check.py" ${megatron[@]+"${megatron[@]}"} "$@"
