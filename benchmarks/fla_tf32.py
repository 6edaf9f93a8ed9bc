"""Where fla's fp32 chunk forward differs from the recurrence: its chunked algorithm, or TF32 inside its kernels.

On a CPU, fla's Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``), which computes every
``tl.dot`` in exact fp32 whatever its ``input_precision``. That is the chunked algorithm alone. Then the
interpreter's dot is made to read its fp32 operands as a GPU's tensor cores read them under TF32 (10 mantissa
bits: the low 13 bits dropped, or rounded to nearest), on the dots a GPU runs in TF32:

- ``all``: every fp32 ``tl.dot`` without an explicit precision (Triton's default on sm >= 80 is ``tf32``,
  ``TRITON_F32_DEFAULT`` unset) and fla's explicit ``input_precision='tf32'`` of the intra-chunk solve
  (``fla/ops/gated_delta_rule/chunk_fwd.py`` lines 20-23: ``SOLVE_TRIL_DOT_PRECISION`` is ``tf32`` when
  ``IS_TF32_SUPPORTED``, i.e. on NVIDIA sm >= 80);
- with ``TRITON_F32_DEFAULT=ieee`` in the environment: only the explicit one is left.

The inputs are ``scripts/gpu_check.py``'s delta-rule check's (seed 1234, the tiny configs' GatedDeltaNet
sizes), so the figures compare with that check's on a GPU.

    TRITON_INTERPRET=1 .venv/bin/python benchmarks/fla_tf32.py [--seq 128]
    TRITON_INTERPRET=1 TRITON_F32_DEFAULT=ieee .venv/bin/python benchmarks/fla_tf32.py

Measured (fla-core 0.6.0, Triton 3.9.0 interpreter, seq 128, 2 heads of 16): exact fp32 6.3e-7; TF32 by
truncation 1.462e-3 (an H200 read 1.46e-3 for the same inputs), by rounding 4.1e-4; with
``TRITON_F32_DEFAULT=ieee`` 1.1e-5 (truncation). The H200 run read 1.46e-3 with ``TRITON_F32_DEFAULT=ieee``
too, where this predicts 1.1e-5: the variable did not reach the kernels that ran there (Triton reads it when it
compiles a kernel; a kernel compiled before it was set is reused from Triton's cache unless the variable is part
of the cache key). A GPU run with an empty ``TRITON_CACHE_DIR`` decides it.
"""

from __future__ import annotations

import argparse
import builtins
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1: fla's Triton kernels run on CPU only in Triton's interpreter")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
import triton.runtime.autotuner as autotuner  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402

import fla.ops.common.chunk_delta_h as chunk_delta_h  # noqa: E402
import fla.ops.gated_delta_rule.chunk_fwd as chunk_fwd  # noqa: E402
from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: E402
from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule  # noqa: E402


def _interpreter_can_run_fla() -> None:
    """Two things a GPU has and the interpreter lacks: a benchmarker for autotuning (every config ties, the
    first is taken), and loop indices that are tensors (fla's chunk_delta_h calls ``i_t.to(tl.int64)``)."""
    autotuner.Autotuner._bench = lambda self, *args, config, **kwargs: [0.0, 0.0, 0.0]

    def tensor_range(*args):
        for i in builtins.range(*args):
            yield tl.core.tensor(interpreter.TensorHandle(np.array(i, dtype=np.int32), tl.int32), tl.int32)

    chunk_delta_h.range = tensor_range
    # what fla sets on NVIDIA sm >= 80 (IS_TF32_SUPPORTED); the interpreter sees no GPU and sets 'ieee'
    chunk_fwd.SOLVE_TRIL_DOT_PRECISION = tl.constexpr("tf32")


def _truncated(data):
    return (np.asarray(data, dtype=np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


def _tf32_dots(to_tf32) -> None:
    """The interpreter's dot reads fp32 operands through ``to_tf32`` where the dot's precision is TF32
    (``None``: exact fp32 everywhere)."""
    exact = interpreter.InterpreterBuilder._exact_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if (to_tf32 is not None and "TF32" in str(input_precision).upper() and "X3" not in str(input_precision).upper()
                and a.dtype.scalar == tl.float32 and b.dtype.scalar == tl.float32):
            a = interpreter.TensorHandle(to_tf32(a.data), a.dtype.scalar)
            b = interpreter.TensorHandle(to_tf32(b.data), b.dtype.scalar)
        return exact(self, a, b, d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot


def inputs(seq: int, heads: int = 2, dk: int = 16, dv: int = 16, seed: int = 1234):
    """scripts/gpu_check.py delta_rule_check's inputs (q, k L2-normalised; g < 0; beta in (0, 1))."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(2, seq, heads, dk, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(2, seq, heads, dv, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(2, seq, heads, generator=gen))
    beta = torch.sigmoid(torch.randn(2, seq, heads, generator=gen))
    return q, k, v, g, beta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=128)
    options = parser.parse_args()
    _interpreter_can_run_fla()
    interpreter.InterpreterBuilder._exact_dot = interpreter.InterpreterBuilder.create_dot
    q, k, v, g, beta = inputs(options.seq)
    reference, _ = naive_recurrent_gated_delta_rule(q, k, v, beta, g, scale=q.shape[-1] ** -0.5)
    default = os.environ.get("TRITON_F32_DEFAULT") or "tf32 (Triton's default on sm >= 80)"
    print(f"fla chunk_gated_delta_rule, fp32, seq {options.seq}; TRITON_F32_DEFAULT: {default}")
    for name, to_tf32 in (("exact fp32 (the chunked algorithm alone)", None),
                          ("TF32, operands truncated to 10 mantissa bits", _truncated),
                          ("TF32, operands rounded to nearest", interpreter._round_f32_to_tf32)):
        _tf32_dots(to_tf32)
        out = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=False)[0]
        error = float((out.double() - reference.double()).norm() / reference.double().norm())
        print(f"  {name}: relative error {error:.3e} against the recurrence")


if __name__ == "__main__":
    main()
