"""The gated delta rule (the GatedDeltaNet recurrence) in MindSpore, recurrent and chunked.

With per-head state S (dk x dv), for every token t (SPEC section 2):

    S   = S * exp(g_t)
    v'  = beta_t * (v_t - S^T k_t)
    S   = S + k_t v'^T
    o_t = S^T q_t * scale

The recurrent form runs those four lines token by token: it is the definition, and far too slow
in PyNative for training (hundreds of tiny ops per token). The chunked (WY) form gives the same
numbers with a handful of batched matrix products per chunk of L tokens. Inside a chunk, with
G_t the cumulative sum of g from the chunk start, D_ts = exp(G_t - G_s) for s <= t, and S0 the
state entering the chunk:

    A   = strictly_lower(beta * K K^T * D)                      (L x L)
    U   = (I + A)^-1 (beta * V) - (I + A)^-1 (beta * exp(G) * K) S0     (the v' of every token)
    O   = scale * ((exp(G) * Q) S0 + lower_incl(Q K^T * D) U)
    S_L = exp(G_L) S0 + (K * exp(G_L - G))^T U

Everything except the last three lines is computed for all chunks at once; only the state is
carried chunk to chunk. ``ops.inverse`` has a CPU kernel (``mint.inverse`` has none).

Tensors are [B, H, T, d] (q, k: d = dk; v: d = dv) and [B, H, T] for g and beta, fp32.
"""

from __future__ import annotations

from functools import lru_cache

import mindspore as ms
import numpy as np
from mindspore import Tensor, mint, ops

DEFAULT_CHUNK_SIZE = 64


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float) -> Tensor:
    """The definition, token by token; the reference the chunked form is tested against."""
    batch, heads, length, key_dim = q.shape
    value_dim = v.shape[-1]
    state = ops.zeros((batch, heads, key_dim, value_dim), q.dtype)
    outputs = []
    for t in range(length):
        state = state * mint.exp(g[:, :, t]).reshape(batch, heads, 1, 1)
        k_t = k[:, :, t].reshape(batch, heads, 1, key_dim)
        recalled = mint.matmul(k_t, state)  # S^T k_t as a row: [B, H, 1, dv]
        delta = (v[:, :, t].reshape(batch, heads, 1, value_dim) - recalled) * beta[:, :, t].reshape(batch, heads, 1, 1)
        state = state + mint.matmul(k_t.swapaxes(-1, -2), delta)
        q_t = q[:, :, t].reshape(batch, heads, 1, key_dim)
        outputs.append(mint.matmul(q_t, state) * scale)
    return mint.cat(outputs, dim=2)


def _pad_time(x: Tensor, pad: int) -> Tensor:
    """Zero-pad axis 2 (time) at the end; padded tokens have g = 0, beta = 0, k = 0: they change nothing."""
    shape = list(x.shape)
    shape[2] = pad
    return mint.cat([x, ops.zeros(tuple(shape), x.dtype)], dim=2)


@lru_cache(maxsize=None)
def _chunk_constants(length: int) -> tuple[Tensor, Tensor, Tensor]:
    """Lower-triangular mask with the diagonal, without it, and the identity, for one chunk length."""
    lower_inclusive = np.tril(np.ones((length, length), np.float32))
    strictly_lower = np.tril(np.ones((length, length), np.float32), -1)
    return Tensor(lower_inclusive), Tensor(strictly_lower), Tensor(np.eye(length, dtype=np.float32))


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                           chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tensor:
    """The same result as :func:`recurrent_gated_delta_rule`, chunk by chunk (WY form)."""
    batch, heads, length, key_dim = q.shape
    value_dim = v.shape[-1]
    chunk = min(chunk_size, length)
    pad = (-length) % chunk
    if pad:
        q, k, v = _pad_time(q, pad), _pad_time(k, pad), _pad_time(v, pad)
        g = _pad_time(g.reshape(batch, heads, length, 1), pad).reshape(batch, heads, length + pad)
        beta = _pad_time(beta.reshape(batch, heads, length, 1), pad).reshape(batch, heads, length + pad)
    chunks = (length + pad) // chunk

    q = q.reshape(batch, heads, chunks, chunk, key_dim)
    k = k.reshape(batch, heads, chunks, chunk, key_dim)
    v = v.reshape(batch, heads, chunks, chunk, value_dim)
    g = g.reshape(batch, heads, chunks, chunk)
    beta = beta.reshape(batch, heads, chunks, chunk)

    lower_inclusive, strictly_lower, identity = _chunk_constants(chunk)
    g_cum = ops.cumsum(g, axis=-1)
    # exp(G_t - G_s) only where s <= t; above the diagonal the difference is positive and could
    # overflow, so it is zeroed before the exp and the result masked after.
    diff = (g_cum.reshape(batch, heads, chunks, chunk, 1) - g_cum.reshape(batch, heads, chunks, 1, chunk))
    decay = mint.exp(diff * lower_inclusive) * lower_inclusive
    k_t = k.swapaxes(-1, -2)
    beta_col = beta.reshape(batch, heads, chunks, chunk, 1)
    a = mint.matmul(k, k_t) * decay * strictly_lower * beta_col
    solve = ops.inverse(a + identity)
    u_local = mint.matmul(solve, v * beta_col)
    growth = mint.exp(g_cum).reshape(batch, heads, chunks, chunk, 1)
    w = mint.matmul(solve, k * (beta_col * growth))
    attend = mint.matmul(q, k_t) * decay
    q_grown = q * growth
    k_to_end = k * mint.exp(g_cum[..., -1:] - g_cum).reshape(batch, heads, chunks, chunk, 1)
    chunk_decay = mint.exp(g_cum[..., -1]).reshape(batch, heads, chunks, 1, 1)

    outputs = []
    state = None
    for c in range(chunks):
        if state is None:  # nothing carried into the first chunk
            u = u_local[:, :, c]
            out = mint.matmul(attend[:, :, c], u)
            state = mint.matmul(k_to_end[:, :, c].swapaxes(-1, -2), u)
        else:
            u = u_local[:, :, c] - mint.matmul(w[:, :, c], state)
            out = mint.matmul(q_grown[:, :, c], state) + mint.matmul(attend[:, :, c], u)
            state = state * chunk_decay[:, :, c] + mint.matmul(k_to_end[:, :, c].swapaxes(-1, -2), u)
        outputs.append(out)
    out = outputs[0] if chunks == 1 else mint.cat(outputs, dim=2)
    out = out * scale
    if pad:
        out = out[:, :, :length]
    return out


# The chunked form compiled into one graph (forward and backward) per input shape. In PyNative every
# one of its ~60 small ops would pay the per-op dispatch and autograd cost; compiled, the rule's
# forward+backward takes about a sixth of the CPU time. The model calls this one; it is a plain
# function of tensors, so forward hooks on the model's cells are unaffected.
compiled_chunk_gated_delta_rule = ms.jit(chunk_gated_delta_rule)
