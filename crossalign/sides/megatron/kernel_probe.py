"""The kernel probe: the GatedDeltaNet kernels a megatron-core run is about to train with, forward and backward,
against a reference in fp32, before the run spends an hour on a machine that trains wrong numbers.

:func:`probe` runs each kernel megatron-core's GatedDeltaNet would call (``device.kernel_functions``: the delta
rule, the l2norm of q and k, the causal conv1d) on random inputs of the run's shapes (its value and key heads per
tensor-parallel rank, head widths, conv channels and sequence length) in the run's precision on its device, and the
reference on the same (rounded) inputs in fp32 on CPU: megatron-core's own ``torch_chunk_gated_delta_rule`` for the
delta rule, fla's l2norm formula in plain torch, torch's conv1d and SiLU. Each output and each input gradient is
held to its kernel's tolerance in :data:`KERNEL_TOLERANCES` by the relative error ||x - x_ref|| / ||x_ref|| (fla's
own tests' measure, fla/utils/testing.py ``get_err_ratio``). :func:`require` raises :class:`KernelDisagrees`
(an ``EnvironmentRefused``: the run's verdict is ``invalid``) naming the worst. ``scripts/gpu_check.py`` holds
its kernel checks to the same table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.nn.functional as F

from crossalign.config import AlignmentConfig
from crossalign.sides.megatron.embedded import device as devices
from crossalign.sides.protocol import EnvironmentRefused

MEGATRON_TORCH, FLA_CHUNK = "megatron torch_chunk_gated_delta_rule", "fla chunk_gated_delta_rule"
TORCH_L2NORM, FLA_L2NORM = "torch l2norm", "fla l2norm"
TORCH_CONV1D, CAUSAL_CONV1D = "torch conv1d", "causal_conv1d_fn"
DELTA_RULE_PARTS = ("output", "dq", "dk", "dv", "dg", "dbeta")
# fla's own tests of its chunk rule (tests/ops/test_gated_delta.py test_chunk, fla-org/flash-linear-attention at
# dd7867d2^, lines 162-168) in fp16: output 5e-3, dq, dk and dv 8e-3, dbeta and dg 2e-2; #640's miscompile on
# Hopper fails exactly these (PR #826: wrong db and dg, "error > 0.02")
FLA_TEST_BOUNDS = {"output": 5e-3, "dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dg": 2e-2, "dbeta": 2e-2}
BF16_OVER_FP16 = 8  # bf16 keeps 7 mantissa bits, fp16 10: its rounding unit is 2^3 times fp16's


@dataclass(frozen=True)
class Tolerance:
    """The bound on the relative error of each part a kernel is held at (``output``, then its input gradients),
    and the evidence for it."""

    bounds: Mapping[str, float]
    reason: str


def _every(bound: float, parts: tuple[str, ...]) -> dict[str, float]:
    return {part: bound for part in parts}


L2NORM_PARTS, CONV1D_PARTS = ("output", "dx"), ("output", "dx", "dweight")
# (kernel, precision) -> its tolerance. In bf16 the kernel gets its inputs in bf16 (g in fp32, as GatedDeltaNet
# computes it) and the reference the same rounded inputs in fp32: the kernel's own error, not the inputs' rounding.
KERNEL_TOLERANCES: dict[tuple[str, str], Tolerance] = {
    (MEGATRON_TORCH, "fp32"): Tolerance(_every(1e-5, DELTA_RULE_PARTS), (
        "torch matmuls in fp32: output 6.6e-7 measured on an H200 and 5.8e-7 on CPU against fla's recurrent form, "
        "gradients 1.1e-6 at most (dg) on CPU (tests/test_kernel_probe.py); a chunked algorithm in exact fp32 is at "
        "6e-7 (fla's: 6.3e-7)")),
    (MEGATRON_TORCH, "bf16"): Tolerance(_every(1e-2, DELTA_RULE_PARTS), (
        "fp32 inside, bf16 in and out (bf16 rounding alone is ~2^-9/sqrt(3) = 1.1e-3 RMS): output 1.7e-3, "
        "gradients 1.8e-3 at most measured on CPU for the tiny and the real dense config")),
    (FLA_CHUNK, "fp32"): Tolerance(FLA_TEST_BOUNDS, (
        "fla multiplies fp32 in TF32 (Triton's default tl.dot precision on sm >= 80, and "
        "fla/ops/gated_delta_rule/chunk_fwd.py lines 20-23 ask TF32 of its intra-chunk solve explicitly): output "
        "1.46e-3 measured on an H200; benchmarks/fla_tf32.py reproduces 1.462e-3 with TF32 dots in Triton's "
        "interpreter and 6.3e-7 with exact ones; TF32 keeps fp16's 10 mantissa bits, so fla's own tests' fp16 "
        "bounds hold it: output 5e-3, dq/dk/dv 8e-3, dbeta/dg 2e-2 (tests/ops/test_gated_delta.py test_chunk)")),
    (FLA_CHUNK, "bf16"): Tolerance({part: bound * BF16_OVER_FP16 if part != "output" else 1e-2
                                    for part, bound in FLA_TEST_BOUNDS.items()}, (
        "bf16 operands and output: output 1e-2, the bound of Megatron's torch rule in bf16; gradients fla's own "
        "fp16 bounds times 8, bf16's rounding unit over fp16's (not measured: Triton's interpreter does not run "
        "fla's kernels in bf16)")),
    (TORCH_L2NORM, "fp32"): Tolerance(_every(1e-5, L2NORM_PARTS), "the reference's own formula in fp32: 0 measured"),
    (TORCH_L2NORM, "bf16"): Tolerance(_every(1e-2, L2NORM_PARTS),
                                      "fp32 inside, bf16 in and out: 2.5e-3 at most measured on CPU (bf16 rounding)"),
    **{(FLA_L2NORM, precision): Tolerance(_every(5e-3, L2NORM_PARTS), (
        "fla's own tests hold y and dx to 5e-3 in fp32 and bf16 (tests/modules/test_l2norm.py lines 42-43)"))
       for precision in ("fp32", "bf16")},
    (TORCH_CONV1D, "fp32"): Tolerance(_every(1e-5, CONV1D_PARTS), "the reference itself in fp32: 0 measured on CPU"),
    (TORCH_CONV1D, "bf16"): Tolerance(_every(1e-2, CONV1D_PARTS),
                                      "bf16 in and out: 2.7e-3 at most measured on CPU (bf16 rounding)"),
    (CAUSAL_CONV1D, "fp32"): Tolerance(_every(3e-4, CONV1D_PARTS),
                                       "causal-conv1d's own tests: rtol 3e-4 in fp32 (tests/test_causal_conv1d.py "
                                       "test_causal_conv1d)"),
    (CAUSAL_CONV1D, "bf16"): Tolerance(_every(1e-2, CONV1D_PARTS),
                                       "causal-conv1d's own tests: rtol 1e-2 in bf16 (tests/test_causal_conv1d.py "
                                       "test_causal_conv1d)"),
}
# the names device.kernel_functions gives the kernels -> the table's
TABLE_NAMES = {"megatron.core torch_chunk_gated_delta_rule": MEGATRON_TORCH,
               "fla chunk_gated_delta_rule (Triton)": FLA_CHUNK, "torch l2norm (mcore_cpu)": TORCH_L2NORM,
               "fla l2norm (Triton)": FLA_L2NORM, "torch conv1d": TORCH_CONV1D,
               "causal_conv1d_fn (causal-conv1d)": CAUSAL_CONV1D}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class KernelCheck:
    """One part (output or an input gradient) of one kernel against the reference."""

    kernel: str  # as the step's manifest names it
    part: str
    precision: str
    device: str
    error: float  # ||x - x_ref|| / ||x_ref||
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.error < self.tolerance  # NaN is never ok

    def line(self) -> str:
        return (f"[{'ok  ' if self.ok else 'FAIL'}] {self.kernel} {self.part} ({self.precision} on {self.device}): "
                f"relative error {self.error:.2e} (tolerance {self.tolerance:g})")


class KernelDisagrees(EnvironmentRefused):
    """A kernel the run would train with disagrees with the reference beyond its tolerance."""


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    value, reference = value.detach().double().cpu(), reference.detach().double().cpu()
    return float((value - reference).norm() / reference.norm().clamp_min(1e-30))


def _leaves(tensors: dict[str, torch.Tensor], where: str, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Copies that gradients reach: on ``where``, in ``dtype`` (None: as they are)."""
    return {name: t.detach().to(where, dtype or t.dtype).requires_grad_(t.is_floating_point())
            for name, t in tensors.items()}


def _errors(run: Callable[[dict[str, torch.Tensor]], torch.Tensor], inputs: dict[str, torch.Tensor],
            reference: Callable[[dict[str, torch.Tensor]], torch.Tensor], device: str,
            gradients: Mapping[str, str], seed: int) -> dict[str, float]:
    """``run`` on ``inputs`` on ``device`` and ``reference`` on them in fp32 on CPU, each backward from the same
    random output gradient: the relative error of the output and of each input named in ``gradients``
    (part -> input)."""
    kernel_in, reference_in = _leaves(inputs, device), _leaves(inputs, "cpu", torch.float32)
    out = run(kernel_in)
    expected = reference(reference_in)
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(seed + 1)).to(out.dtype)
    out.backward(grad.to(device))
    expected.backward(grad.float())
    errors = {"output": relative_error(out, expected)}
    errors.update({part: relative_error(kernel_in[name].grad, reference_in[name].grad)
                   for part, name in gradients.items()})
    return errors


def _shapes(config: AlignmentConfig) -> dict[str, int]:
    model, tensor = config.model, config.parallel.megatron.tensor
    return {"T": config.training.seq_length, "H": model.linear_num_value_heads // tensor,
            "HK": model.linear_num_key_heads // tensor, "DK": model.linear_key_head_dim,
            "DV": model.linear_value_head_dim, "C": model.conv_channels // tensor, "W": model.linear_conv_kernel_dim}


def _delta_rule_inputs(s: dict[str, int], dtype: torch.dtype, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """q and k L2-normalised, v, g = -A exp softplus (< 0, fp32) and beta = sigmoid, as GatedDeltaNet hands them."""
    def randn(*shape):
        return torch.randn(1, s["T"], *shape, generator=gen)

    return {"q": F.normalize(randn(s["H"], s["DK"]), dim=-1).to(dtype),
            "k": F.normalize(randn(s["H"], s["DK"]), dim=-1).to(dtype),
            "v": randn(s["H"], s["DV"]).to(dtype), "g": -F.softplus(randn(s["H"])),
            "beta": torch.sigmoid(randn(s["H"])).to(dtype)}


def _delta_rule(rule: Callable) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    def run(x: dict[str, torch.Tensor]) -> torch.Tensor:  # GatedDeltaNet's call (core_v0.16.1 lines 370-390)
        return rule(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=None,
                    output_final_state=False, use_qk_l2norm_in_kernel=False)[0]

    return run


def _conv1d(x: dict[str, torch.Tensor]) -> torch.Tensor:
    """GatedDeltaNet's torch path: a depthwise causal Conv1d (padding W - 1, the first T outputs) and SiLU
    (core_v0.16.1 megatron/core/ssm/gated_delta_net.py lines 165-174 and 326-327)."""
    width = x["weight"].shape[-1]
    return F.silu(F.conv1d(x["x"], x["weight"], padding=width - 1, groups=x["x"].shape[1])[..., :x["x"].shape[-1]])


def probe(config: AlignmentConfig, device: str, seed: int = 1234) -> list[KernelCheck]:
    """Every part of every kernel the run on ``device`` would train with, against the fp32 reference."""
    precision = config.training.embedded_precision
    deterministic = device == "cpu" or config.training.deterministic  # on CPU megatron-core runs deterministic
    dtype, s = DTYPES[precision], _shapes(config)
    gen = torch.Generator().manual_seed(seed)
    kernels = devices.kernel_functions(device, deterministic)
    checks: list[KernelCheck] = []

    def hold(kind: str, errors: dict[str, float]) -> None:
        name = kernels[kind][0]
        bounds = KERNEL_TOLERANCES[(TABLE_NAMES[name], precision)].bounds
        checks.extend(KernelCheck(name, part, precision, device, error, bounds[part]) for part, error in errors.items())

    _, rule = kernels["delta_rule"]
    if rule is not None:
        hold("delta_rule", _errors(_delta_rule(rule), _delta_rule_inputs(s, dtype, gen),
                                   _delta_rule(devices.megatron_torch_rule()), device,
                                   {"dq": "q", "dk": "k", "dv": "v", "dg": "g", "dbeta": "beta"}, seed))
    _, l2norm = kernels["l2norm"]
    if l2norm is not None:
        from crossalign.sides.megatron.embedded.mcore_cpu import _torch_l2norm  # fla's formula in plain torch

        unnormalised = {"x": torch.randn(1, s["T"], s["HK"], s["DK"], generator=gen).to(dtype)}
        hold("l2norm", _errors(lambda x: l2norm(x["x"].contiguous()), unnormalised, lambda x: _torch_l2norm(x["x"]),
                               device, {"dx": "x"}, seed))
    _, causal = kernels["conv1d"]
    conv_in = {"x": torch.randn(1, s["C"], s["T"], generator=gen).to(dtype),
               "weight": (torch.randn(s["C"], 1, s["W"], generator=gen) / s["W"] ** 0.5).to(dtype)}
    kernel = _conv1d if causal is None else (lambda x: causal(x=x["x"], weight=x["weight"].squeeze(1), bias=None,
                                                              activation="silu"))
    hold("conv1d", _errors(kernel, conv_in, _conv1d, device, {"dx": "x", "dweight": "weight"}, seed))
    return checks


def require(config: AlignmentConfig, device: str, seed: int = 1234) -> list[KernelCheck]:
    """The probe's checks, or KernelDisagrees naming the kernel and part furthest beyond its tolerance."""
    checks = probe(config, device, seed)
    failed = [check for check in checks if not check.ok]
    if failed:
        worst = max(failed, key=lambda c: c.error / c.tolerance if c.error == c.error else float("inf"))
        raise KernelDisagrees(
            f"environment: {worst.kernel} disagrees with the reference by {worst.error:.3g} ({worst.part}, "
            f"{worst.precision} on {worst.device}; tolerance {worst.tolerance:g})",
            [check.line() for check in checks], kernel=worst.kernel, part=worst.part, error=worst.error,
            tolerance=worst.tolerance, precision=worst.precision, device=worst.device)
    return checks
