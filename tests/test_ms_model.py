"""The MindSpore Qwen3.5: MindFormers layout, GDN forms, routing, RoPE, causality, MTP roll, strict loading."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

ms = pytest.importorskip("mindspore")
from mindspore import Tensor  # noqa: E402

from crossalign.models.ms_gdn import (  # noqa: E402
    chunk_gated_delta_rule,
    compiled_chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from crossalign.models.ms_model import (  # noqa: E402
    MoE,
    Qwen35Model,
    RotaryEmbedding,
    StateMismatchError,
    configure_cpu_runtime,
    load_mindformers_state,
    mindformers_state,
)
from crossalign.models.layout import mindformers_shapes, random_mindformers_state  # noqa: E402
from crossalign.config import load_config  # noqa: E402

configure_cpu_runtime()


@pytest.fixture(scope="module", params=["qwen35_dense_tiny", "qwen35_moe_tiny"])
def model_and_net(request):
    model = load_config(request.param).model
    net = Qwen35Model(model)
    load_mindformers_state(net, random_mindformers_state(model, 7))
    return model, net


def _inputs(model, batch=2, length=12, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, model.vocab_size, (batch, length + 1))
    return tokens[:, :-1].astype(np.int32), tokens[:, 1:].astype(np.int32), np.ones((batch, length), np.float32)


def _run(net, ids, labels, mask):
    logits, lm, mtp, aux = net(Tensor(ids), Tensor(labels), Tensor(mask))
    return logits.asnumpy(), float(lm.asnumpy()), mtp.asnumpy(), float(aux.asnumpy())


def test_parameters_have_mindformers_names_and_shapes(model_and_net):
    model, net = model_and_net
    got = {name: tuple(param.shape) for name, param in net.parameters_and_names()}
    assert got == mindformers_shapes(model)
    assert all(param.name == name for name, param in net.parameters_and_names())


def test_in_proj_layout_follows_the_config():
    dense = load_config("qwen35_dense_tiny").model
    fused = dense.model_copy(update={"gdn_in_proj_layout": "fused"})
    names = {name for name, _ in Qwen35Model(fused).parameters_and_names()}
    assert "decoder.layers.0.self_attention.in_proj.weight" in names
    assert "decoder.layers.0.self_attention.in_proj_qkv.weight" not in names
    assert names == set(mindformers_shapes(fused))


def _gdn_inputs(batch, heads, length, key_dim, value_dim, seed):
    rng = np.random.default_rng(seed)

    def unit(x):
        return x / np.sqrt((x ** 2).sum(-1, keepdims=True) + 1e-6)

    q = unit(rng.standard_normal((batch, heads, length, key_dim)))
    k = unit(rng.standard_normal((batch, heads, length, key_dim)))
    v = rng.standard_normal((batch, heads, length, value_dim))
    g = -rng.uniform(0.01, 1.0, (batch, heads, length))
    beta = rng.uniform(0.0, 1.0, (batch, heads, length))
    return [Tensor(x.astype(np.float32)) for x in (q, k, v, g, beta)]


@pytest.mark.parametrize("chunk_size", [8, 16, 64])
def test_chunked_gated_delta_rule_equals_the_recurrence(chunk_size):
    q, k, v, g, beta = _gdn_inputs(2, 2, 37, 8, 6, seed=chunk_size)  # 37: several chunks and a padded tail
    reference = recurrent_gated_delta_rule(q, k, v, g, beta, scale=8 ** -0.5).asnumpy()
    chunked = chunk_gated_delta_rule(q, k, v, g, beta, scale=8 ** -0.5, chunk_size=chunk_size).asnumpy()
    assert chunked.shape == reference.shape
    np.testing.assert_allclose(chunked, reference, atol=1e-5, rtol=1e-5)


def test_compiled_chunked_rule_used_by_the_model_equals_the_recurrence():
    q, k, v, g, beta = _gdn_inputs(1, 2, 20, 8, 6, seed=11)
    reference = recurrent_gated_delta_rule(q, k, v, g, beta, scale=0.25).asnumpy()
    compiled = compiled_chunk_gated_delta_rule(q, k, v, g, beta, scale=0.25, chunk_size=8).asnumpy()
    np.testing.assert_allclose(compiled, reference, atol=1e-5, rtol=1e-5)


def test_recurrence_matches_the_equations_in_numpy():
    q, k, v, g, beta = _gdn_inputs(1, 1, 6, 4, 3, seed=3)
    qn, kn, vn, gn, bn = (x.asnumpy()[0, 0] for x in (q, k, v, g, beta))
    state = np.zeros((4, 3))
    expected = []
    for t in range(6):
        state = state * math.exp(gn[t])
        delta = bn[t] * (vn[t] - state.T @ kn[t])
        state = state + np.outer(kn[t], delta)
        expected.append(state.T @ qn[t] * 0.5)
    got = recurrent_gated_delta_rule(q, k, v, g, beta, scale=0.5).asnumpy()[0, 0]
    np.testing.assert_allclose(got, np.array(expected), atol=1e-6)


def test_gradients_are_finite_and_reach_every_parameter(model_and_net):
    model, net = model_and_net
    ids, labels, mask = (Tensor(x) for x in _inputs(model, length=16))

    def objective(i, l, m):
        _, lm, mtp, aux = net(i, l, m)
        return lm + mtp.sum() + aux

    grads = ms.grad(objective, None, net.trainable_params())(ids, labels, mask)
    names = [p.name for p in net.trainable_params()]
    for name, grad in zip(names, grads):
        values = grad.asnumpy()
        assert np.isfinite(values).all(), name
        assert np.abs(values).max() > 0, f"{name} gets no gradient"


def test_top2_routing_is_softmax_then_renormalise():
    model = load_config("qwen35_moe_tiny").model
    moe = MoE(model)
    rng = np.random.default_rng(5)
    router = rng.normal(0, 0.5, (model.num_experts, model.hidden_size)).astype(np.float32)
    moe.router.weight.set_data(Tensor(router))
    tokens = rng.standard_normal((20, model.hidden_size)).astype(np.float32)
    combine, mask, scores = (x.asnumpy() for x in moe.route(Tensor(tokens)))

    logits = tokens.astype(np.float64) @ router.T.astype(np.float64)
    full = np.exp(logits - logits.max(-1, keepdims=True))
    full /= full.sum(-1, keepdims=True)
    top = np.argsort(-full, axis=-1)[:, :2]
    expected = np.zeros_like(full)
    for row, experts in enumerate(top):
        expected[row, experts] = full[row, experts] / full[row, experts].sum()
    np.testing.assert_allclose(scores, full, atol=1e-6)
    np.testing.assert_allclose(combine, expected, atol=1e-6)
    np.testing.assert_array_equal(mask, (expected > 0).astype(np.float32))


def test_moe_block_matches_a_per_token_reference():
    """Routed experts use weight1 [E,H,2i] as [gate | up] halves; the shared expert's fc1 is interleaved."""
    model = load_config("qwen35_moe_tiny").model
    moe = MoE(model)
    rng = np.random.default_rng(9)
    weights = {}
    for name, param in moe.parameters_and_names():
        weights[name] = rng.normal(0, 0.3, tuple(param.shape)).astype(np.float32)
        param.set_data(Tensor(weights[name]))
    x = rng.standard_normal((1, 6, model.hidden_size)).astype(np.float32)
    out, aux = moe(Tensor(x))

    def silu(a):
        return a / (1 + np.exp(-a))

    ffn = model.moe_ffn_hidden_size
    tokens = x[0].astype(np.float64)
    logits = tokens @ weights["router.weight"].T
    scores = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    expected = []
    for t, token in enumerate(tokens):
        top = np.argsort(-logits[t])[:2]
        probs = np.exp(logits[t, top]) / np.exp(logits[t, top]).sum()
        routed = np.zeros(model.hidden_size)
        for p, e in zip(probs, top):
            hidden = token @ weights["experts.weight1"][e]
            routed += p * (silu(hidden[:ffn]) * hidden[ffn:]) @ weights["experts.weight2"][e]
        fc1 = weights["shared_experts.linear_fc1.weight"] @ token
        shared = weights["shared_experts.linear_fc2.weight"] @ (silu(fc1[0::2]) * fc1[1::2])
        gate = 1 / (1 + np.exp(-(weights["shared_experts.shared_experts_gate.weight"] @ token)))
        expected.append(routed + shared * gate)
    np.testing.assert_allclose(out.asnumpy()[0], np.array(expected), atol=1e-4, rtol=1e-4)

    routed_counts = np.zeros(model.num_experts)
    for t in range(len(tokens)):
        routed_counts[np.argsort(-logits[t])[:2]] += 1
    n = len(tokens)
    expected_aux = model.num_experts * model.moe_aux_loss_coeff / (2 * n * n) * (scores.sum(0) * routed_counts).sum()
    assert float(aux.asnumpy()) == pytest.approx(expected_aux, rel=1e-5)


def test_partial_rope_rotates_only_the_first_rotary_channels():
    head_dim, rotary_dim, length = 16, 4, 5
    rope = RotaryEmbedding(rotary_dim, 10000.0)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, length, 3, head_dim)).astype(np.float32)
    cos, sin = rope.cos_sin(length)
    out = rope.apply(Tensor(x), cos, sin).asnumpy()
    np.testing.assert_array_equal(out[..., rotary_dim:], x[..., rotary_dim:])
    np.testing.assert_allclose(out[:, 0], x[:, 0], atol=1e-7)  # position 0: no rotation
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    for pos in range(length):
        angle = pos * inv_freq
        x1, x2 = x[0, pos, :, :2], x[0, pos, :, 2:4]
        expected = np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)], -1)
        np.testing.assert_allclose(out[0, pos, :, :rotary_dim], expected, atol=1e-5)


def test_a_future_token_does_not_change_earlier_logits(model_and_net):
    model, net = model_and_net
    ids, labels, mask = _inputs(model, length=20)
    before = _run(net, ids, labels, mask)[0]
    changed = ids.copy()
    changed[:, 13] = (changed[:, 13] + 1) % model.vocab_size
    after = _run(net, changed, labels, mask)[0]
    np.testing.assert_array_equal(after[:, :13], before[:, :13])
    assert np.abs(after[:, 13:] - before[:, 13:]).max() > 1e-4


def test_mtp_loss_uses_labels_rolled_left_and_ignores_the_last_position():
    model = load_config("qwen35_dense_tiny").model
    net = Qwen35Model(model)
    load_mindformers_state(net, random_mindformers_state(model, 3))
    ids, labels, mask = _inputs(model, batch=2, length=10)
    captured = {}
    handle = net.mtp.layers[0].register_forward_hook(lambda cell, inputs, output: captured.update(hidden=output[0]))
    _, lm, mtp, _ = _run(net, ids, labels, mask)
    handle.remove()

    logits = net.output_layer(captured["hidden"]).asnumpy().astype(np.float64)
    log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    # position t predicts labels[t + 1]; the last position has nothing to predict
    picked = [log_probs[b, t, labels[b, t + 1]] for b in range(2) for t in range(9)]
    assert mtp[0] == pytest.approx(-np.mean(picked), rel=1e-5)

    first_label_changed = labels.copy()
    first_label_changed[:, 0] = (first_label_changed[:, 0] + 1) % model.vocab_size
    _, lm2, mtp2, _ = _run(net, ids, first_label_changed, mask)
    assert mtp2[0] == pytest.approx(mtp[0], abs=1e-6)  # labels[:, 0] is rolled out of the MTP loss
    assert lm2 != pytest.approx(lm, abs=1e-6)


def test_strict_load_names_missing_unexpected_and_misshaped_keys():
    model = load_config("qwen35_dense_tiny").model
    net = Qwen35Model(model)
    state = random_mindformers_state(model, 1)
    broken = dict(state)
    del broken["decoder.layers.0.self_attention.a_log"]
    broken["decoder.layers.0.self_attention.A_log"] = state["decoder.layers.0.self_attention.a_log"]
    broken["output_layer.weight"] = torch.zeros(3, 3)
    with pytest.raises(StateMismatchError) as error:
        load_mindformers_state(net, broken)
    message = str(error.value)
    assert "1 missing keys: decoder.layers.0.self_attention.a_log" in message
    assert "1 unexpected keys: decoder.layers.0.self_attention.A_log" in message
    assert "1 wrong shapes: output_layer.weight [3, 3] (expected [2048, 64])" in message


def test_bf16_state_is_upcast_on_load():
    model = load_config("qwen35_dense_tiny").model
    net = Qwen35Model(model)
    state = {name: t.to(torch.bfloat16) for name, t in random_mindformers_state(model, 4).items()}
    load_mindformers_state(net, state)
    loaded = mindformers_state(net)
    for name, tensor in state.items():
        assert loaded[name].dtype == np.float32
        np.testing.assert_array_equal(loaded[name], tensor.float().numpy())
