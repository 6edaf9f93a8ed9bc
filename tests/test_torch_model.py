"""The PyTorch (Megatron-layout) Qwen3.5: layout, loading, and the forward pass against SPEC section 2."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from crossalign.models.torch_model import (
    GatedDeltaNet,
    Qwen35Model,
    Router,
    StateDictMismatch,
    apply_partial_rope,
    load_megatron_state,
    masked_mean_cross_entropy,
    roll_left,
    rotary_cos_sin,
)
from crossalign.models.layout import megatron_shapes
from crossalign.config import load_config

DENSE = load_config("qwen35_dense_tiny").model
MOE = load_config("qwen35_moe_tiny").model


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def build(model_config, core_version="0.16.1", seed=0) -> Qwen35Model:
    torch.manual_seed(seed)
    return Qwen35Model(model_config, core_version)


def batch(vocab: int, batch_size=2, seq=24, seed=1):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch_size, seq + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:], torch.ones(batch_size, seq)


@pytest.mark.parametrize("model_config", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("core_version", ["0.16.1", "0.17.0"])
def test_state_dict_is_exactly_the_megatron_layout(model_config, core_version):
    net = build(model_config, core_version)
    shapes = {key: tuple(value.shape) for key, value in net.state_dict().items()}
    assert shapes == megatron_shapes(model_config, core_version, "per_expert")
    prefix = "transformer_layer" if core_version == "0.16.1" else "mtp_model_layer"
    assert f"mtp.layers.0.{prefix}.self_attention.linear_qkv.weight" in shapes
    # submodules are reachable under Megatron's names, for forward hooks
    modules = dict(net.named_modules())
    assert "decoder.layers.1.self_attention" in modules and f"mtp.layers.0.{prefix}.mlp" in modules
    if model_config.is_moe:
        assert "decoder.layers.0.mlp.experts" in modules


def test_stacked_experts_load_the_same_as_per_expert():
    source = build(MOE, seed=3).state_dict()
    stacked = {}
    for key, value in source.items():
        head, _, leaf = key.rpartition(".")
        if ".mlp.experts." in key:
            if leaf == "weight0":
                stacked[f"{head}.weight"] = torch.stack([source[f"{head}.weight{j}"] for j in range(MOE.num_experts)])
            continue
        stacked[key] = value
    assert any(key.endswith("experts.linear_fc1.weight") for key in stacked)

    per_expert_net, stacked_net, hook_net = build(MOE, seed=4), build(MOE, seed=5), build(MOE, seed=6)
    load_megatron_state(per_expert_net, source)
    load_megatron_state(stacked_net, stacked)
    hook_net.load_state_dict(stacked, strict=True)  # the pre-hook alone accepts the stacked form
    for key, value in source.items():
        assert torch.equal(stacked_net.state_dict()[key], value), key
        assert torch.equal(hook_net.state_dict()[key], value), key
        assert torch.equal(per_expert_net.state_dict()[key], value), key


def test_strict_load_names_missing_unexpected_and_misshaped_keys():
    state = build(DENSE, seed=2).state_dict()
    net = build(DENSE, seed=7)
    before = {key: value.clone() for key, value in net.state_dict().items()}

    broken = dict(state)
    del broken["decoder.layers.0.self_attention.A_log"]
    broken["decoder.layers.0.self_attention.a_log"] = state["decoder.layers.0.self_attention.A_log"]
    broken["output_layer.weight"] = state["output_layer.weight"][:-1]
    with pytest.raises(StateDictMismatch) as error:
        load_megatron_state(net, broken)
    message = str(error.value)
    assert "1 missing keys: decoder.layers.0.self_attention.A_log" in message
    assert "1 unexpected keys: decoder.layers.0.self_attention.a_log" in message
    assert "1 wrong shapes: output_layer.weight [2047, 64] (expected [2048, 64])" in message
    # nothing was copied
    assert all(torch.equal(net.state_dict()[key], value) for key, value in before.items())

    wrong_prefix = {key.replace(".transformer_layer.", ".mtp_model_layer."): v for key, v in state.items()}
    with pytest.raises(StateDictMismatch, match="mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight"):
        load_megatron_state(net, wrong_prefix)


def test_bf16_weights_are_upcast_and_extra_state_ignored():
    state = {key: value.to(torch.bfloat16) for key, value in build(DENSE, seed=2).state_dict().items()}
    state["output_layer._extra_state"] = None
    net = build(DENSE, seed=8)
    load_megatron_state(net, state)
    weight = net.state_dict()["embedding.word_embeddings.weight"]
    assert weight.dtype == torch.float32
    assert torch.equal(weight, state["embedding.word_embeddings.weight"].float())


def reference_delta_rule(q, k, v, g, beta, scale):
    """SPEC section 2's recurrence, token by token: S = S*exp(g); v' = beta*(v - S^T k); S += k v'^T; o = S^T q*scale."""
    batch_size, seq, heads, dk = q.shape
    state = torch.zeros(batch_size, heads, dk, v.shape[-1], dtype=torch.float64)
    out = []
    for t in range(seq):
        state = state * g[:, t].exp()[..., None, None]
        kt, vt = k[:, t].double(), v[:, t].double()
        corrected = beta[:, t, :, None] * (vt - torch.einsum("bhkv,bhk->bhv", state, kt))
        state = state + kt[..., None] * corrected[..., None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t].double()) * scale)
    return torch.stack(out, dim=1)


def test_gated_delta_rule_chunked_equals_recurrent_and_the_spec_recurrence():
    torch.manual_seed(0)
    layer = GatedDeltaNet(DENSE)
    torch.nn.init.normal_(layer.in_proj.weight, std=0.3)
    torch.nn.init.normal_(layer.out_proj.weight, std=0.3)
    x = torch.randn(2, 100, DENSE.hidden_size)  # crosses a chunk boundary (64) and needs padding
    chunk = layer(x)
    layer.delta_rule_form = "recurrent"
    recurrent = layer(x)
    assert torch.allclose(chunk, recurrent, atol=2e-5, rtol=1e-4)
    assert chunk.abs().max() > 1e-2

    from crossalign.models.torch_model import gated_delta_rule

    b, t, h, d = 2, 70, 2, 8
    q = F.normalize(torch.randn(b, t, h, d), dim=-1)
    k = F.normalize(torch.randn(b, t, h, d), dim=-1)
    v = torch.randn(b, t, h, d)
    g = -torch.rand(b, t, h)  # log-space decay
    beta = torch.rand(b, t, h)
    expected = reference_delta_rule(q, k, v, g, beta, d ** -0.5).float()
    for form in ("chunk", "recurrent"):
        assert torch.allclose(gated_delta_rule(q, k, v, g, beta, d ** -0.5, form=form), expected, atol=1e-5), form


@pytest.mark.parametrize("model_config", [DENSE, MOE], ids=["dense", "moe"])
def test_every_parameter_gets_a_finite_gradient(model_config):
    net = build(model_config)
    ids, labels, mask = batch(model_config.padded_vocab_size)
    logits, lm_loss, mtp_losses, aux_loss = net(ids, labels, mask)
    assert logits.shape == (2, 24, model_config.padded_vocab_size) and logits.dtype == torch.float32
    assert mtp_losses.shape == (1,)
    # an untrained model predicts roughly uniformly
    assert abs(lm_loss.item() - math.log(model_config.padded_vocab_size)) < 0.5
    if model_config.is_moe:
        # 5 MoE layers (4 decoder + 1 MTP), each coeff * (about 1 when balanced)
        assert 0.8 * 5 * MOE.moe_aux_loss_coeff < aux_loss.item() < 2.0 * 5 * MOE.moe_aux_loss_coeff
    else:
        assert aux_loss.item() == 0.0
    (lm_loss + mtp_losses.sum() + aux_loss).backward()
    for name, param in net.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name
        if ".mlp.experts." not in name:  # an expert may receive no token in a small batch
            assert param.grad.abs().sum() > 0, name


def test_top2_routing_is_softmax_then_renormalise_and_aux_loss_is_switch_style():
    torch.manual_seed(0)
    router = Router(MOE)
    torch.nn.init.normal_(router.weight, std=0.5)
    tokens = torch.randn(40, MOE.hidden_size)
    probs, top_experts, aux = router(tokens)

    scores = (tokens @ router.weight.T).softmax(-1)
    expected_probs, expected_experts = scores.topk(2, dim=-1)
    expected_probs = expected_probs / expected_probs.sum(-1, keepdim=True)
    assert torch.equal(top_experts, expected_experts)
    assert torch.allclose(probs, expected_probs, atol=1e-6)

    counts = torch.zeros(MOE.num_experts)
    for expert in top_experts.flatten():
        counts[expert] += 1
    expected_aux = MOE.num_experts * MOE.moe_aux_loss_coeff / (2 * 40 ** 2) * (scores.sum(0) * counts).sum()
    assert torch.allclose(aux, expected_aux, rtol=1e-6)

    unnormalised = Router(MOE.model_copy(update={"norm_topk_prob": False}))
    unnormalised.load_state_dict(router.state_dict())
    raw_probs, _, _ = unnormalised(tokens)
    assert torch.allclose(raw_probs, scores.topk(2, dim=-1).values, atol=1e-6)


def test_moe_layer_output_equals_per_token_expert_mixture():
    net = build(MOE, seed=11)
    moe = net.decoder.layers[0].mlp
    tokens = torch.randn(6, MOE.hidden_size)
    out = moe(tokens[None])[0]
    probs, top_experts, _ = moe.router(tokens)
    for n in range(tokens.shape[0]):
        expected = torch.zeros(MOE.hidden_size)
        for slot in range(2):
            e = top_experts[n, slot].item()
            gate, up = (moe.experts.linear_fc1.expert_weight(e) @ tokens[n]).chunk(2)
            expected += probs[n, slot] * (moe.experts.linear_fc2.expert_weight(e) @ (F.silu(gate) * up))
        shared = moe.shared_experts
        gate, up = (shared.linear_fc1.weight @ tokens[n]).chunk(2)
        expected += (shared.linear_fc2.weight @ (F.silu(gate) * up)) * torch.sigmoid(shared.gate_weight[0] @ tokens[n])
        assert torch.allclose(out[n], expected, atol=1e-5)


def test_partial_rope_rotates_only_the_first_rotary_dim_channels():
    rotary_dim, head_dim, seq = 4, 16, 6
    cos, sin = rotary_cos_sin(seq, rotary_dim, 1_000_000.0, torch.device("cpu"))
    x = torch.randn(1, seq, 3, head_dim)
    y = apply_partial_rope(x, cos, sin)
    assert torch.equal(y[..., rotary_dim:], x[..., rotary_dim:])
    assert torch.equal(y[:, 0], x[:, 0])  # position 0 is not rotated
    # channel pairs (j, j + dim/2) rotate by angle p * base^(-2j/dim)
    for p in range(seq):
        for j in range(rotary_dim // 2):
            angle = p * 1_000_000.0 ** (-2 * j / rotary_dim)
            a, b = x[0, p, :, j], x[0, p, :, j + rotary_dim // 2]
            assert torch.allclose(y[0, p, :, j], a * math.cos(angle) - b * math.sin(angle), atol=1e-5)
            assert torch.allclose(y[0, p, :, j + rotary_dim // 2], b * math.cos(angle) + a * math.sin(angle), atol=1e-5)


@pytest.mark.parametrize("model_config", [DENSE, MOE], ids=["dense", "moe"])
def test_causal_a_later_token_never_changes_earlier_logits(model_config):
    net = build(model_config)
    ids, labels, mask = batch(model_config.padded_vocab_size, batch_size=1, seq=20)
    logits, *_ = net(ids, labels, mask)
    changed = ids.clone()
    changed[0, 12] = (changed[0, 12] + 1) % model_config.padded_vocab_size
    changed_logits, *_ = net(changed, labels, mask)
    assert torch.allclose(logits[:, :12], changed_logits[:, :12], atol=1e-6)
    assert not torch.allclose(logits[:, 12:], changed_logits[:, 12:], atol=1e-4)


def test_mtp_rolls_ids_labels_and_mask_left_with_zero_tail():
    assert roll_left(torch.tensor([[5, 6, 7, 8]])).tolist() == [[6, 7, 8, 0]]

    net = build(DENSE)
    ids, labels, _ = batch(DENSE.padded_vocab_size, batch_size=2, seq=16)
    mask = torch.ones(2, 16)
    mask[1, 5] = 0.0
    _, lm_loss, mtp_losses, _ = net(ids, labels, mask)

    rope = rotary_cos_sin(16, DENSE.rotary_dim, DENSE.rotary_base, torch.device("cpu"))
    hidden = net.decoder(net.embedding(ids), rope)
    assert torch.allclose(lm_loss, masked_mean_cross_entropy(net.output_layer(hidden), labels, mask))
    # MTP at position i sees the embedding of token i+1 and predicts label i+1; the last position has no loss
    rolled_ids = torch.cat((ids[:, 1:], torch.zeros(2, 1, dtype=ids.dtype)), dim=1)
    mtp_hidden = net.mtp.layers[0](net.embedding(rolled_ids), hidden, rope)
    losses = F.cross_entropy(net.output_layer(mtp_hidden)[:, :-1].reshape(-1, DENSE.padded_vocab_size),
                             labels[:, 1:].reshape(-1), reduction="none").view(2, 15)
    keep = mask[:, 1:]
    assert keep[1, 4] == 0
    expected = (losses * keep).sum() / keep.sum()
    assert torch.allclose(mtp_losses[0], expected, atol=1e-6)


def test_gated_attention_matches_a_per_head_reference_of_the_megatron_row_layout():
    net = build(DENSE, seed=5)
    attention = net.decoder.layers[3].self_attention
    torch.nn.init.normal_(attention.linear_qkv.weight, std=0.3)
    torch.nn.init.normal_(attention.q_layernorm.weight, mean=1.0, std=0.2)
    x = torch.randn(1, 10, DENSE.hidden_size)
    rope = rotary_cos_sin(10, DENSE.rotary_dim, DENSE.rotary_base, torch.device("cpu"))
    out = attention(x, rope)

    hn, per_group = DENSE.kv_channels, DENSE.heads_per_group
    weight = attention.linear_qkv.weight
    normed = x[0] * torch.rsqrt(x[0].pow(2).mean(-1, keepdim=True) + DENSE.norm_epsilon) * attention.linear_qkv.layer_norm_weight

    def rows(start):
        return normed @ weight[start:start + hn].T  # [T, hn]

    def head_norm(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + DENSE.norm_epsilon) * w

    heads = []
    for group in range(DENSE.num_query_groups):
        base = group * (2 * per_group + 2) * hn
        key = apply_partial_rope(head_norm(rows(base + 2 * per_group * hn), attention.k_layernorm.weight)[None, :, None], *rope)[0, :, 0]
        value = rows(base + (2 * per_group + 1) * hn)
        for j in range(per_group):
            query = apply_partial_rope(head_norm(rows(base + j * hn), attention.q_layernorm.weight)[None, :, None], *rope)[0, :, 0]
            gate = rows(base + (per_group + j) * hn)
            scores = (query @ key.T) / math.sqrt(hn) + torch.full((10, 10), float("-inf")).triu(1)
            heads.append((scores.softmax(-1) @ value) * torch.sigmoid(gate))
    expected = torch.cat(heads, dim=-1) @ attention.linear_proj.weight.T
    assert torch.allclose(out[0], expected, atol=1e-5)
