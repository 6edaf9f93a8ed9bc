"""Delta rules that compute wrong, for the kernel probe's tests: named in ``$CROSSALIGN_TEST_DELTA_RULE``
(``crossalign.sides.megatron.embedded.device.DELTA_RULE_SEAM``) they become megatron-core's delta rule.

Each is megatron-core's own torch_chunk_gated_delta_rule with one thing wrong: ``gate_gradients_scaled`` returns
the right output and scales the gradients of g and beta by 1.25, as Triton [3.4.0, 3.7.1) does to fla's chunk
backward on Hopper (fla-org/flash-linear-attention#640: wrong db and dg, the forward unaffected);
``output_scaled`` scales the output by 1.01.
"""

from __future__ import annotations

import torch

from crossalign.sides.megatron.embedded.device import megatron_torch_rule

SCALE = 1.25


class _GateGradientsScaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta):
        ctx.save_for_backward(q, k, v, g, beta)
        with torch.no_grad():
            return megatron_torch_rule()(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                                         use_qk_l2norm_in_kernel=False)[0]

    @staticmethod
    def backward(ctx, grad):
        inputs = [t.detach().requires_grad_() for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = megatron_torch_rule()(*inputs[:3], g=inputs[3], beta=inputs[4], initial_state=None,
                                        output_final_state=False, use_qk_l2norm_in_kernel=False)[0]
            dq, dk, dv, dg, dbeta = torch.autograd.grad(out, inputs, grad)
        return dq, dk, dv, dg * SCALE, dbeta * SCALE


def gate_gradients_scaled(q, k, v, g, beta, **_):
    return _GateGradientsScaled.apply(q, k, v, g, beta), None


def output_scaled(q, k, v, g, beta, **kwargs):
    out, state = megatron_torch_rule()(q, k, v, g=g, beta=beta, **kwargs)
    return out * 1.01, state
