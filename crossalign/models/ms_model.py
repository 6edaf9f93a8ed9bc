"""Qwen3.5 (dense and MoE, with MTP) in MindSpore PyNative on CPU, fp32, in MindFormers' layout.

Written from the equations of SPEC section 2. Parameters carry exactly the names and shapes
MindFormers stores (SPEC section 3, left column: no ``model.`` prefix, interleaved dense and
shared-expert fc1 rows, experts as [E, H, 2i] / [E, i, H], conv1d as (C, 1, 1, K), ``a_log``,
the dense GDN input projection in four parts or one fused ``in_proj``), so a MindFormers
checkpoint loads without any renaming. Submodule names mirror the parameter names, so a
forward hook on ``decoder.layers.1.self_attention`` sees that module's output.

Only ops with CPU kernels are used (reference/mindformers.md section 7): ``mint`` matmul, exp,
sigmoid; ``ops`` softplus, cumsum, topk, conv1d, inverse, log_softmax, gather.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from functools import lru_cache

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, mint, nn, ops

from crossalign.models.ms_gdn import chunk_gated_delta_rule, compiled_chunk_gated_delta_rule
from crossalign.tensorio.mismatch import key_mismatches
from crossalign.config import ModelConfig

GDN_QK_NORM_EPS = 1e-6

_runtime_configured = False


def configure_cpu_runtime(threads: int | None = None) -> None:
    """Synchronous op launch and a small CPU thread pool, once per process.

    MindSpore's default is an asynchronous launch queue and 25 kernel threads; on a small,
    shared machine every op then waits milliseconds for thread hand-offs. Launching
    synchronously is about ten times faster for this model. The default pool is half the
    available cores (the Megatron stand-in trains at the same time), at most 8: one thread on
    a 2-core machine, where the tiny model's small ops gain nothing from a second one.
    """
    global _runtime_configured
    if _runtime_configured:
        return
    # MindSpore: an optional framework (the local and npu extras), needed only here
    from mindspore.device_context.cpu.op_tuning import RuntimeConf

    if not RuntimeConf.get_instance().is_op_threads_num_configured():
        default = max(1, min(len(os.sched_getaffinity(0)) // 2, 8))
        ms.device_context.cpu.op_tuning.threads_num(threads or default)
    ms.runtime.launch_blocking()
    _runtime_configured = True


class StateMismatchError(ValueError):
    """A state dict that does not match the model's parameters exactly; the message names the keys."""


def _dense(x: Tensor, weight: Tensor) -> Tensor:
    """x @ weight^T for a weight stored [out, in]."""
    return mint.nn.functional.linear(x, weight)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x * mint.rsqrt(mint.mean(x * x, dim=-1, keepdim=True) + eps) * weight


class Linear(nn.Cell):
    """A bias-free projection with its weight stored [out, in]."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.weight = Parameter(ops.zeros((out_features, in_features), ms.float32), name="weight")

    def construct(self, x: Tensor) -> Tensor:
        return _dense(x, self.weight)


class RMSNorm(nn.Cell):
    """y = x * rsqrt(mean(x^2) + eps) * w, plain gamma (no 1+w; Hugging Face's zero-centred w' is w - 1)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = Parameter(ops.ones((size,), ms.float32), name="weight")

    def construct(self, x: Tensor) -> Tensor:
        return _rms_norm(x, self.weight, self.eps)


class WeightOnly(nn.Cell):
    """A holder for one parameter called ``weight`` (router, conv1d, embedding): it gives the name its prefix."""

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.weight = Parameter(ops.zeros(shape, ms.float32), name="weight")


class RotaryEmbedding:
    """Partial, non-interleaved RoPE on the first ``rotary_dim`` channels of each head (positions 0..T-1)."""

    def __init__(self, rotary_dim: int, base: float):
        self.rotary_dim = rotary_dim
        exponents = np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)
        self.inv_freq = (1.0 / (np.float32(base) ** exponents)).astype(np.float32)
        self._cache: dict[int, tuple[Tensor, Tensor]] = {}

    def cos_sin(self, length: int) -> tuple[Tensor, Tensor]:
        """cos and sin of shape [1, T, 1, rotary_dim] (broadcast over batch and heads)."""
        if length not in self._cache:
            freqs = np.outer(np.arange(length, dtype=np.float32), self.inv_freq).astype(np.float32)
            angles = np.concatenate([freqs, freqs], axis=-1)
            shape = (1, length, 1, self.rotary_dim)
            self._cache[length] = (Tensor(np.cos(angles).reshape(shape)), Tensor(np.sin(angles).reshape(shape)))
        return self._cache[length]

    def apply(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x: [B, T, heads, head_dim]; channels past rotary_dim pass through unchanged."""
        rotary, passthrough = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        half = self.rotary_dim // 2
        rotated_half = mint.cat([-rotary[..., half:], rotary[..., :half]], dim=-1)
        rotary = rotary * cos + rotated_half * sin
        if passthrough.shape[-1] == 0:
            return rotary
        return mint.cat([rotary, passthrough], dim=-1)


class SelfAttention(nn.Cell):
    """Gated full attention: per query group rows [q heads | gate heads | k | v], q/k RMSNorm, partial RoPE,
    causal GQA softmax attention, output times sigmoid(gate), output projection."""

    def __init__(self, model: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.groups = model.num_query_groups
        self.heads_per_group = model.heads_per_group
        self.heads = model.num_attention_heads
        self.head_dim = model.kv_channels
        self.rotary = rotary
        self.linear_qkv = Linear(model.qkv_rows, model.hidden_size)
        self.q_layernorm = RMSNorm(model.kv_channels, model.norm_epsilon)
        self.k_layernorm = RMSNorm(model.kv_channels, model.norm_epsilon)
        self.linear_proj = Linear(model.hidden_size, model.attention_output_size)

    def construct(self, x: Tensor, cos: Tensor, sin: Tensor, causal_bias: Tensor) -> Tensor:
        batch, length, _ = x.shape
        per_group = self.linear_qkv(x).reshape(batch, length, self.groups, 2 * self.heads_per_group + 2, self.head_dim)
        hpg = self.heads_per_group
        q = per_group[:, :, :, :hpg].reshape(batch, length, self.heads, self.head_dim)
        gate = per_group[:, :, :, hpg: 2 * hpg].reshape(batch, length, self.heads, self.head_dim)
        k = per_group[:, :, :, 2 * hpg]
        v = per_group[:, :, :, 2 * hpg + 1]
        q = self.rotary.apply(self.q_layernorm(q), cos, sin)
        k = self.rotary.apply(self.k_layernorm(k), cos, sin)
        q = q.swapaxes(1, 2)  # [B, heads, T, d]
        k = k.swapaxes(1, 2)  # [B, groups, T, d]
        v = v.swapaxes(1, 2)
        if hpg > 1:
            k = ops.repeat_interleave(k, hpg, axis=1)
            v = ops.repeat_interleave(v, hpg, axis=1)
        scores = mint.matmul(q, k.swapaxes(-1, -2)) * (1.0 / math.sqrt(self.head_dim)) + causal_bias
        context = mint.matmul(ops.softmax(scores, axis=-1), v).swapaxes(1, 2)  # [B, T, heads, d]
        context = context * mint.sigmoid(gate)
        return self.linear_proj(context.reshape(batch, length, self.heads * self.head_dim))


class GatedDeltaNet(nn.Cell):
    """Linear attention: in_proj [q|k|v|z|beta|alpha], causal depthwise conv1d + SiLU over [q|k|v],
    L2-normalised q/k, gated delta rule, per-head RMSNorm gated by silu(z), output projection."""

    def __init__(self, model: ModelConfig):
        super().__init__()
        self.fused = model.in_proj_layout == "fused"
        self.key_heads = model.linear_num_key_heads
        self.value_heads = model.linear_num_value_heads
        self.key_dim = model.linear_key_head_dim
        self.value_dim = model.linear_value_head_dim
        self.kernel = model.linear_conv_kernel_dim
        self.channels = model.conv_channels
        self.compiled_rule = True  # the gated delta rule as one ms.jit graph (False: op by op, see eager_rule)
        hidden = model.hidden_size
        if self.fused:
            self.in_proj = Linear(model.in_proj_rows, hidden)
        else:
            self.in_proj_qkv = Linear(model.conv_channels, hidden)
            self.linear_g = Linear(model.gdn_value_dim, hidden)
            self.linear_b = Linear(model.linear_num_value_heads, hidden)
            self.linear_a = Linear(model.linear_num_value_heads, hidden)
        self.conv1d = WeightOnly((model.conv_channels, 1, 1, model.linear_conv_kernel_dim))
        self.a_log = Parameter(ops.zeros((model.linear_num_value_heads,), ms.float32), name="a_log")
        self.dt_bias = Parameter(ops.zeros((model.linear_num_value_heads,), ms.float32), name="dt_bias")
        self.out_norm = RMSNorm(model.linear_value_head_dim, model.norm_epsilon)
        self.linear_proj = Linear(hidden, model.gdn_value_dim)

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        if not self.fused:
            return self.in_proj_qkv(x), self.linear_g(x), self.linear_b(x), self.linear_a(x)
        rows = self.in_proj(x)
        z_end = self.channels + self.value_heads * self.value_dim
        return (rows[..., : self.channels], rows[..., self.channels: z_end],
                rows[..., z_end: z_end + self.value_heads], rows[..., z_end + self.value_heads:])

    def _causal_conv(self, qkv: Tensor) -> Tensor:
        """Depthwise causal conv over time, then SiLU: out_t = sum_j w[:, j] * x_{t - (K-1) + j}.

        The same as a grouped conv1d with padding K-1 keeping the first T outputs, written as one
        gather of the K shifted windows and a weighted sum: MindSpore's CPU conv1d is many times slower.
        """
        batch, length, channels = qkv.shape
        padded = mint.cat([ops.zeros((batch, self.kernel - 1, channels), qkv.dtype), qkv], dim=1)
        windows = ops.gather(padded, _window_index(length, self.kernel), 1)  # [B, T, K, C]
        taps = self.conv1d.weight.reshape(channels, self.kernel).swapaxes(0, 1)  # [K, C]
        return ops.silu(mint.sum(windows * taps, dim=2))

    @staticmethod
    def _l2_normalise(x: Tensor) -> Tensor:
        return x * mint.rsqrt(mint.sum(x * x, dim=-1, keepdim=True) + GDN_QK_NORM_EPS)

    def construct(self, x: Tensor) -> Tensor:
        batch, length, _ = x.shape
        qkv, z, b, a = self._project(x)
        qkv = self._causal_conv(qkv)
        key_width = self.key_heads * self.key_dim
        q = self._l2_normalise(qkv[..., :key_width].reshape(batch, length, self.key_heads, self.key_dim))
        k = self._l2_normalise(qkv[..., key_width: 2 * key_width].reshape(batch, length, self.key_heads, self.key_dim))
        v = qkv[..., 2 * key_width:].reshape(batch, length, self.value_heads, self.value_dim)
        repeat = self.value_heads // self.key_heads
        if repeat > 1:
            q = ops.repeat_interleave(q, repeat, axis=2)
            k = ops.repeat_interleave(k, repeat, axis=2)
        g = -mint.exp(self.a_log) * ops.softplus(a + self.dt_bias)  # [B, T, nv]
        beta = mint.sigmoid(b)
        rule = compiled_chunk_gated_delta_rule if self.compiled_rule else chunk_gated_delta_rule
        out = rule(q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2), g.swapaxes(1, 2), beta.swapaxes(1, 2),
                   scale=1.0 / math.sqrt(self.key_dim))
        out = self.out_norm(out.swapaxes(1, 2))  # [B, T, nv, dv], one weight shared across heads
        out = out * ops.silu(z.reshape(batch, length, self.value_heads, self.value_dim))
        return self.linear_proj(out.reshape(batch, length, self.value_heads * self.value_dim))


@lru_cache(maxsize=None)
def _window_index(length: int, kernel: int) -> Tensor:
    """Row t holds the padded positions t .. t+K-1: the K inputs of causal-conv output t."""
    return Tensor((np.arange(length)[:, None] + np.arange(kernel)[None, :]).astype(np.int32))


def _swiglu_interleaved(rows: Tensor) -> Tensor:
    """MindFormers' interleaved fc1 output: even rows are the gate, odd rows the up projection."""
    pairs = rows.reshape(*rows.shape[:-1], rows.shape[-1] // 2, 2)
    return ops.silu(pairs[..., 0]) * pairs[..., 1]


class MLP(nn.Cell):
    """Dense SwiGLU with MindFormers' interleaved fc1 rows [g0, u0, g1, u1, ...]."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.linear_fc1 = Linear(2 * ffn, hidden)
        self.linear_fc2 = Linear(hidden, ffn)

    def construct(self, x: Tensor) -> Tensor:
        return self.linear_fc2(_swiglu_interleaved(self.linear_fc1(x)))


class SharedExperts(MLP):
    """The shared expert: an interleaved SwiGLU MLP whose output is scaled by sigmoid(x @ gate^T)."""

    def __init__(self, hidden: int, ffn: int, gated: bool):
        super().__init__(hidden, ffn)
        self.gated = gated
        if gated:
            self.shared_experts_gate = Linear(1, hidden)

    def construct(self, x: Tensor) -> Tensor:
        out = super().construct(x)
        if self.gated:
            out = out * mint.sigmoid(self.shared_experts_gate(x))
        return out


class Experts(nn.Cell):
    """Routed experts in the PyNative layout: weight1 [E, H, 2i] (x @ weight1 = [gate | up]), weight2 [E, i, H]."""

    def __init__(self, experts: int, hidden: int, ffn: int):
        super().__init__()
        self.ffn = ffn
        self.weight1 = Parameter(ops.zeros((experts, hidden, 2 * ffn), ms.float32), name="weight1")
        self.weight2 = Parameter(ops.zeros((experts, ffn, hidden), ms.float32), name="weight2")

    def construct(self, tokens: Tensor, combine: Tensor) -> Tensor:
        """tokens [N, H]; combine [N, E] routing weights (0 for experts a token is not sent to).

        Every expert runs on every token and the combine weights select: with a handful of
        experts this costs a few small matmuls instead of a gather/scatter per expert, and the
        result and gradients are the same (unselected experts get weight 0 and no gradient).
        """
        hidden = mint.matmul(tokens.reshape(1, *tokens.shape), self.weight1)  # [E, N, 2i]
        act = ops.silu(hidden[..., : self.ffn]) * hidden[..., self.ffn:]
        out = mint.matmul(act, self.weight2)  # [E, N, H]
        return mint.matmul(combine.reshape(combine.shape[0], 1, -1), out.swapaxes(0, 1)).reshape(tokens.shape)


class MoE(nn.Cell):
    """Softmax top-k router (fp32), routed experts, gated shared expert, switch load-balancing loss."""

    def __init__(self, model: ModelConfig):
        super().__init__()
        self.experts_count = model.num_experts
        self.topk = model.moe_router_topk
        self.norm_topk_prob = model.norm_topk_prob
        self.topk_scale = model.moe_router_topk_scaling_factor
        self.aux_coeff = model.moe_aux_loss_coeff
        self.router = WeightOnly((model.num_experts, model.hidden_size))
        self.experts = Experts(model.num_experts, model.hidden_size, model.moe_ffn_hidden_size)
        self.shared_experts = SharedExperts(model.hidden_size, model.moe_shared_expert_intermediate_size,
                                            model.moe_shared_expert_gate)

    def route(self, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(combine weights [N, E], expert mask [N, E] of 0/1, full softmax scores [N, E])."""
        logits = _dense(tokens, self.router.weight)
        scores = ops.softmax(logits, axis=-1)
        if self.norm_topk_prob:
            top_logits, top_index = ops.topk(logits, self.topk)
            probs = ops.softmax(top_logits, axis=-1)  # softmax over the k kept = softmax then renormalise
        else:
            probs, top_index = ops.topk(scores, self.topk)
        one_hot = ops.one_hot(top_index, self.experts_count, Tensor(1.0, ms.float32), Tensor(0.0, ms.float32))
        combine = mint.sum(one_hot * (probs * self.topk_scale).reshape(*probs.shape, 1), dim=1)
        mask = mint.sum(one_hot, dim=1)
        return combine, mask, scores

    def load_balancing_loss(self, mask: Tensor, scores: Tensor) -> Tensor:
        """E * coeff / (k * N^2) * sum_i (sum over tokens of score_i) * (tokens routed to i)."""
        tokens = scores.shape[0]
        routed = ops.stop_gradient(mint.sum(mask, dim=0))
        scale = self.experts_count * self.aux_coeff / (self.topk * tokens * tokens)
        return mint.sum(mint.sum(scores, dim=0) * routed) * scale

    def construct(self, x: Tensor) -> tuple[Tensor, Tensor]:
        tokens = x.reshape(-1, x.shape[-1])
        combine, mask, scores = self.route(tokens)
        out = self.experts(tokens, combine) + self.shared_experts(tokens)
        return out.reshape(x.shape), self.load_balancing_loss(mask, scores)


class TransformerLayer(nn.Cell):
    """Pre-norm residual block: token mixer (full attention or GDN), then FFN (dense or MoE).

    Returns (hidden, aux_loss) where aux_loss is the coefficient-scaled load-balancing loss (0 for dense)."""

    def __init__(self, model: ModelConfig, kind: str, rotary: RotaryEmbedding):
        super().__init__()
        self.kind = kind
        self.is_moe = model.is_moe
        self.input_layernorm = RMSNorm(model.hidden_size, model.norm_epsilon)
        self.self_attention = SelfAttention(model, rotary) if kind == "attention" else GatedDeltaNet(model)
        self.pre_mlp_layernorm = RMSNorm(model.hidden_size, model.norm_epsilon)
        self.mlp = MoE(model) if model.is_moe else MLP(model.hidden_size, model.ffn_hidden_size)

    def construct(self, x: Tensor, cos: Tensor, sin: Tensor, causal_bias: Tensor) -> tuple[Tensor, Tensor | None]:
        normed = self.input_layernorm(x)
        if self.kind == "attention":
            x = x + self.self_attention(normed, cos, sin, causal_bias)
        else:
            x = x + self.self_attention(normed)
        normed = self.pre_mlp_layernorm(x)
        if self.is_moe:
            out, aux = self.mlp(normed)
            return x + out, aux
        return x + self.mlp(normed), None


class Decoder(nn.Cell):
    def __init__(self, model: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.layers = nn.CellList([TransformerLayer(model, kind, rotary) for kind in model.layer_kinds])
        self.final_layernorm = RMSNorm(model.hidden_size, model.norm_epsilon)


class MTPLayer(nn.Cell):
    """h' = final_layernorm(layer(eh_proj(cat(enorm(embedding of rolled ids), hnorm(h)))))."""

    def __init__(self, model: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.enorm = RMSNorm(model.hidden_size, model.norm_epsilon)
        self.hnorm = RMSNorm(model.hidden_size, model.norm_epsilon)
        self.eh_proj = Linear(model.hidden_size, 2 * model.hidden_size)
        self.transformer_layer = TransformerLayer(model, "attention", rotary)
        self.final_layernorm = RMSNorm(model.hidden_size, model.norm_epsilon)

    def construct(self, embedded: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor,
                  causal_bias: Tensor) -> tuple[Tensor, Tensor | None]:
        x = self.eh_proj(mint.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        x, aux = self.transformer_layer(x, cos, sin, causal_bias)
        return self.final_layernorm(x), aux


class MultiTokenPrediction(nn.Cell):
    def __init__(self, model: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.layers = nn.CellList([MTPLayer(model, rotary) for _ in range(model.mtp_num_layers)])


class Embedding(nn.Cell):
    def __init__(self, model: ModelConfig):
        super().__init__()
        self.word_embeddings = WeightOnly((model.padded_vocab_size, model.hidden_size))

    def construct(self, ids: Tensor) -> Tensor:
        return ops.gather(self.word_embeddings.weight, ids, 0)


def _roll_left(x: Tensor) -> Tensor:
    """Shift left by one along time, filling the vacated last position with 0 (Megatron's MTP roll)."""
    return mint.cat([x[:, 1:], ops.zeros((x.shape[0], 1), x.dtype)], dim=1)


def _masked_cross_entropy(logits: Tensor, labels: Tensor, loss_mask: Tensor) -> Tensor:
    """sum(mask * CE) / sum(mask): the token-weighted mean."""
    log_probs = ops.log_softmax(logits, axis=-1)
    picked = ops.gather_elements(log_probs, -1, labels.reshape(*labels.shape, 1)).reshape(labels.shape)
    return -mint.sum(picked * loss_mask) / mint.sum(loss_mask)


class Qwen35Model(nn.Cell):
    """The whole model. Forward: (input_ids [B,T], labels [B,T], loss_mask [B,T]) ->
    (logits [B,T,V], lm_loss, mtp_losses [mtp_num_layers] unscaled, aux_loss summed over MoE layers)."""

    def __init__(self, model: ModelConfig, seed: int | None = 0):
        """``seed`` draws a simple random initialisation; None leaves zeros and unit norms, for a
        caller that loads a full state next (drawing 600M numbers for the real configs takes a while)."""
        super().__init__()
        ms.set_context(mode=ms.PYNATIVE_MODE)
        configure_cpu_runtime()
        self.config = model
        rotary = RotaryEmbedding(model.rotary_dim, model.rotary_base)
        self.rotary = rotary
        self.embedding = Embedding(model)
        self.decoder = Decoder(model, rotary)
        if model.mtp_num_layers:
            self.mtp = MultiTokenPrediction(model, rotary)
        self.output_layer = Linear(model.padded_vocab_size, model.hidden_size)
        for name, param in self.parameters_and_names():
            param.name = name  # the full path, as MindFormers saves it
        if seed is not None:
            _initialise(self, model, seed)
        self._causal_bias: dict[int, Tensor] = {}

    def causal_bias(self, length: int) -> Tensor:
        if length not in self._causal_bias:
            bias = np.triu(np.full((length, length), -1e30, np.float32), 1)
            self._causal_bias[length] = Tensor(bias)
        return self._causal_bias[length]

    def eager_rule(self) -> None:
        """Run every GatedDeltaNet's gated delta rule op by op (PyNative) instead of as its compiled graph: the same
        computation, for a tool that wraps each MindSpore API, which a graph compiled by ms.jit cannot parse
        (msprobe's dump at level mix: ``Unsupported statement 'Try'`` in its API wrapper)."""
        for _, cell in self.cells_and_names():
            if isinstance(cell, GatedDeltaNet):
                cell.compiled_rule = False

    def construct(self, input_ids: Tensor, labels: Tensor, loss_mask: Tensor):
        length = input_ids.shape[1]
        cos, sin = self.rotary.cos_sin(length)
        causal_bias = self.causal_bias(length)
        aux_losses = []
        hidden = self.embedding(input_ids)
        for layer in self.decoder.layers:
            hidden, aux = layer(hidden, cos, sin, causal_bias)
            if aux is not None:
                aux_losses.append(aux)
        hidden = self.decoder.final_layernorm(hidden)
        logits = self.output_layer(hidden)
        lm_loss = _masked_cross_entropy(logits, labels, loss_mask)

        mtp_losses = []
        ids, mtp_labels, mtp_mask = input_ids, labels, loss_mask
        for layer in (self.mtp.layers if self.config.mtp_num_layers else []):
            ids, mtp_labels, mtp_mask = _roll_left(ids), _roll_left(mtp_labels), _roll_left(mtp_mask)
            hidden, aux = layer(self.embedding(ids), hidden, cos, sin, causal_bias)
            if aux is not None:
                aux_losses.append(aux)
            mtp_losses.append(_masked_cross_entropy(self.output_layer(hidden), mtp_labels, mtp_mask))

        mtp_losses = ops.stack(mtp_losses) if mtp_losses else ops.zeros((0,), ms.float32)
        aux_loss = sum(aux_losses[1:], aux_losses[0]) if aux_losses else Tensor(0.0, ms.float32)
        return logits, lm_loss, mtp_losses, aux_loss


def _initialise(net: Qwen35Model, model: ModelConfig, seed: int) -> None:
    """A usable starting point for a net built on its own (the trainers load a full state instead):
    normal(0, init_method_std) matrices, unit norms, A_log = log(uniform(1, 16)), dt in [1e-3, 1e-1]."""
    rng = np.random.default_rng(seed)
    for name, param in net.parameters_and_names():
        shape = tuple(param.shape)
        if name.endswith("a_log"):
            value = np.log(rng.uniform(1.0, 16.0, shape))
        elif name.endswith("dt_bias"):
            dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), shape))
            value = dt + np.log(-np.expm1(-dt))  # softplus^-1(dt)
        elif len(shape) == 1:
            value = np.ones(shape)
        else:
            value = rng.normal(0.0, model.init_method_std, shape)
        param.set_data(Tensor(value.astype(np.float32)))


def _as_float32_array(value) -> np.ndarray:
    """torch (any float dtype, bf16 included) or numpy -> fp32 numpy."""
    if isinstance(value, np.ndarray):
        return value.astype(np.float32, copy=False)
    return value.detach().float().cpu().numpy()  # a torch tensor


def load_mindformers_state(net: Qwen35Model, state: Mapping[str, object]) -> None:
    """Load a MindFormers-layout state strictly: every parameter present with its exact shape, nothing extra."""
    params = dict(net.parameters_and_names())
    problems = key_mismatches({name: tuple(value.shape) for name, value in state.items()},
                              {name: tuple(param.shape) for name, param in params.items()})
    if problems:
        raise StateMismatchError(f"state does not match the {net.config.name} MindSpore model: {problems}")
    for name, param in params.items():
        param.set_data(Tensor(np.ascontiguousarray(_as_float32_array(state[name]))))


def mindformers_state(net: Qwen35Model) -> dict[str, np.ndarray]:
    """The net's parameters by MindFormers name, fp32 numpy (copies)."""
    return {name: param.asnumpy().copy() for name, param in net.parameters_and_names()}
