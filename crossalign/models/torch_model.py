"""Qwen3.5 (dense and MoE, with MTP) in plain PyTorch, laid out exactly like Megatron's TE-spec GPTModel.

This is the Megatron side of the embedded CPU backend. Parameter names and shapes are
those of a Megatron torch state dict (SPEC section 3, right column), so a Megatron
checkpoint written by our converter loads here strictly and a missing or misnamed key
is an error, not a silently random weight. The forward pass follows the equations of
SPEC section 2 with Megatron's semantics (fused input norms, per-group [q|gate|k|v]
projection, partial non-interleaved RoPE, GatedDeltaNet through flash-linear-attention's
kernels, softmax top-k router with switch aux loss, MTP with rolled inputs).

Submodule names mirror the parameter names (``decoder.layers.1.self_attention``,
``decoder.layers.1.mlp.experts``, ``mtp.layers.0.transformer_layer``) so that forward hooks
can be attached per module. Everything computes in fp32; weights arriving in bf16 are
upcast on load.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from crossalign.config import ModelConfig
from crossalign.models.layout import mtp_layer_prefix, unstack_expert_weights
from crossalign.tensorio.mismatch import key_mismatches


class StateDictMismatch(ValueError):
    """A Megatron state dict that does not match the model: names every missing, unexpected or misshaped key."""


def mtp_inner_layer_name(core_version: str) -> str:
    """Attribute of the MTP layer holding its transformer layer: renamed in megatron-core 0.17."""
    return mtp_layer_prefix(core_version)


# ---- building blocks ---------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with a plain gamma (no zero-centred 1+w): x / sqrt(mean(x^2) + eps) * w, in fp32.

    Hugging Face's Qwen3_5RMSNorm is the zero-centred form x_hat * (1 + w'), the same function with
    w = 1 + w' (the HF converter adds the 1); its GDN gated norm is plain, like this one.
    """
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def norm_offset(model: ModelConfig) -> float:
    """What Megatron adds to a stored gamma before it scales: 1 under --apply-layernorm-1p (zero_centred), else 0."""
    return 1.0 if model.norm_convention == "zero_centred" else 0.0


class RMSNorm(nn.Module):
    """TENorm (RMSNorm): parameter ``weight``, applied as weight + offset (``norm_offset``)."""

    def __init__(self, size: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.full((size,), 1.0 - offset))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight + self.offset if self.offset else self.weight, self.eps)


class LayerNormLinear(nn.Module):
    """TE's LayerNormColumnParallelLinear: the preceding RMSNorm fused into the projection.

    Parameters ``layer_norm_weight`` [in] and ``weight`` [out, in], as Megatron stores them.
    """

    def __init__(self, in_features: int, out_features: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.layer_norm_weight = nn.Parameter(torch.full((in_features,), 1.0 - offset))
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gamma = self.layer_norm_weight + self.offset if self.offset else self.layer_norm_weight
        return F.linear(rms_norm(x, gamma, self.eps), self.weight)


def linear(in_features: int, out_features: int) -> nn.Linear:
    """A bias-free projection (``--disable-bias-linear``): parameter ``weight`` [out, in]."""
    return nn.Linear(in_features, out_features, bias=False)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(G) * U for fc1 rows laid out [G; U] (Megatron's GLU layout)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_cos_sin(seq_len: int, rotary_dim: int, base: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [T, rotary_dim] for non-interleaved RoPE: freqs duplicated as [f, f]."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))
    positions = torch.arange(seq_len, dtype=torch.float32, device=device)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim channels of each head of x [B, T, heads, hn]; the rest pass through.

    rotate_half(t) = cat(-t2, t1) (Megatron's default, the same as HF's).
    """
    rotary_dim = cos.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat((rot * cos + rotated_half * sin, rest), dim=-1)


# ---- attention -------------------------------------------------------------------------------------


class GatedAttention(nn.Module):
    """Full softmax attention with Megatron's ``attention_output_gate``, qk-norm and partial RoPE (GQA).

    ``linear_qkv`` produces, per query group g, rows [q heads of g | gate heads of g | k_g | v_g].
    """

    def __init__(self, model: ModelConfig):
        super().__init__()
        self.num_groups = model.num_query_groups
        self.heads_per_group = model.heads_per_group
        self.head_dim = model.kv_channels
        self.linear_qkv = LayerNormLinear(model.hidden_size, model.qkv_rows, model.norm_epsilon, norm_offset(model))
        self.q_layernorm = RMSNorm(model.kv_channels, model.norm_epsilon, norm_offset(model))
        self.k_layernorm = RMSNorm(model.kv_channels, model.norm_epsilon, norm_offset(model))
        self.linear_proj = linear(model.attention_output_size, model.hidden_size)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        batch, seq, _ = x.shape
        hn, per_group = self.head_dim, self.heads_per_group
        mixed = self.linear_qkv(x).view(batch, seq, self.num_groups, (2 * per_group + 2) * hn)
        query, gate, key, value = mixed.split([per_group * hn, per_group * hn, hn, hn], dim=-1)
        query = query.reshape(batch, seq, self.num_groups * per_group, hn)
        gate = gate.reshape(batch, seq, self.num_groups * per_group * hn)

        query, key = self.q_layernorm(query), self.k_layernorm(key)
        query, key = apply_partial_rope(query, *rope), apply_partial_rope(key, *rope)

        # [B, heads, T, hn]; query head h attends with the keys/values of group h // heads_per_group
        query = query.transpose(1, 2)
        key = key.repeat_interleave(per_group, dim=2).transpose(1, 2)
        value = value.repeat_interleave(per_group, dim=2).transpose(1, 2)
        scores = query @ key.transpose(-1, -2) / math.sqrt(hn)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
        context = (probs @ value).transpose(1, 2).reshape(batch, seq, -1)
        return self.linear_proj(context * torch.sigmoid(gate))


# ---- GatedDeltaNet ------------------------------------------------------------------------------------


def gated_delta_rule(q, k, v, g, beta, scale: float, form: str = "chunk") -> torch.Tensor:
    """o = gated delta rule over [B, T, H, d] tensors (g in log space, beta after sigmoid, no initial state).

    Uses flash-linear-attention's kernels: its Triton chunk kernel on CUDA, its pure-torch reference
    forms on CPU ("chunk": the WY/chunked form, "recurrent": the per-token recurrence; equal up to
    rounding).
    """
    if q.is_cuda:
        # fla: an optional kernel library, needed only by this implementation
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        out, _ = chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=False)
        return out
    # fla: an optional kernel library, needed only by this implementation
    from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule

    if form == "recurrent":
        out, _ = naive_recurrent_gated_delta_rule(q, k, v, beta, g, scale=scale)
    elif form == "chunk":
        out, _ = naive_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64, scale=scale)
    else:
        raise ValueError(f"gated delta rule form {form!r}: expected 'chunk' or 'recurrent'")
    return out


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the head dim (FLA's l2norm)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """Megatron's GatedDeltaNet layer (linear attention); ``in_proj`` rows [q | k | v | z | beta | alpha]."""

    def __init__(self, model: ModelConfig):
        super().__init__()
        self.num_key_heads = model.linear_num_key_heads
        self.num_value_heads = model.linear_num_value_heads
        self.key_head_dim = model.linear_key_head_dim
        self.value_head_dim = model.linear_value_head_dim
        self.key_dim, self.value_dim = model.gdn_key_dim, model.gdn_value_dim
        self.conv_channels = model.conv_channels
        self.delta_rule_form = "chunk"

        self.in_proj = LayerNormLinear(model.hidden_size, model.in_proj_rows, model.norm_epsilon, norm_offset(model))
        kernel = model.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(self.conv_channels, self.conv_channels, kernel, groups=self.conv_channels,
                                padding=kernel - 1, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_value_heads))
        self.dt_bias = nn.Parameter(torch.ones(self.num_value_heads))
        self.out_norm = RMSNorm(self.value_head_dim, model.norm_epsilon, norm_offset(model))
        self.out_proj = linear(self.value_dim, model.hidden_size)

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        batch, seq, _ = x.shape
        nk, nv, dk, dv = self.num_key_heads, self.num_value_heads, self.key_head_dim, self.value_head_dim
        qkv, z, beta, alpha = self.in_proj(x).split([self.conv_channels, self.value_dim, nv, nv], dim=-1)

        # depthwise causal conv: padding K-1 on both sides, keep the first T outputs
        qkv = F.silu(self.conv1d(qkv.transpose(1, 2))[..., :seq]).transpose(1, 2)
        query, key, value = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = l2_normalize(query.reshape(batch, seq, nk, dk))
        key = l2_normalize(key.reshape(batch, seq, nk, dk))
        value = value.reshape(batch, seq, nv, dv)
        if nv > nk:
            query = query.repeat_interleave(nv // nk, dim=2)
            key = key.repeat_interleave(nv // nk, dim=2)

        decay = -self.A_log.exp() * F.softplus(alpha.float() + self.dt_bias)
        out = gated_delta_rule(query, key, value, decay, torch.sigmoid(beta), scale=dk ** -0.5,
                               form=self.delta_rule_form)

        out = self.out_norm(out) * F.silu(z.reshape(batch, seq, nv, dv).float())
        return self.out_proj(out.reshape(batch, seq, self.value_dim))


# ---- feed-forward -------------------------------------------------------------------------------------


class DenseMLP(nn.Module):
    """SwiGLU MLP with the pre-MLP norm fused into ``linear_fc1`` (rows [G; U])."""

    def __init__(self, model: ModelConfig):
        super().__init__()
        self.linear_fc1 = LayerNormLinear(model.hidden_size, 2 * model.ffn_hidden_size, model.norm_epsilon,
                                          norm_offset(model))
        self.linear_fc2 = linear(model.ffn_hidden_size, model.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(swiglu(self.linear_fc1(x)))


class GroupedLinear(nn.Module):
    """TE GroupedLinear: one bias-free weight per local expert, ``weight0 .. weight{E-1}`` each [out, in]."""

    def __init__(self, num_experts: int, in_features: int, out_features: int):
        super().__init__()
        self.num_experts = num_experts
        for index in range(num_experts):
            self.register_parameter(f"weight{index}", nn.Parameter(torch.empty(out_features, in_features)))
        self._register_load_state_dict_pre_hook(self._accept_stacked)

    def _accept_stacked(self, state_dict, prefix, *args) -> None:
        unstack_expert_weights(state_dict, prefix, self.num_experts)

    def expert_weight(self, index: int) -> torch.Tensor:
        return getattr(self, f"weight{index}")


class GroupedExperts(nn.Module):
    """TEGroupedMLP: routed experts, fc1 rows [G; U]; the routing probability scales the activation before fc2."""

    def __init__(self, model: ModelConfig):
        super().__init__()
        assert model.num_experts is not None and model.moe_ffn_hidden_size is not None
        self.num_experts = model.num_experts
        self.linear_fc1 = GroupedLinear(model.num_experts, model.hidden_size, 2 * model.moe_ffn_hidden_size)
        self.linear_fc2 = GroupedLinear(model.num_experts, model.moe_ffn_hidden_size, model.hidden_size)

    def forward(self, tokens: torch.Tensor, probs: torch.Tensor, top_experts: torch.Tensor) -> torch.Tensor:
        """tokens [N, H]; probs, top_experts [N, k]: sum over each token's k experts of p * expert(token)."""
        out = torch.zeros_like(tokens)
        for expert in range(self.num_experts):
            token_index, slot = (top_experts == expert).nonzero(as_tuple=True)
            if token_index.numel() == 0:
                continue
            hidden = swiglu(F.linear(tokens[token_index], self.linear_fc1.expert_weight(expert)))
            hidden = hidden * probs[token_index, slot].unsqueeze(-1)
            out.index_add_(0, token_index, F.linear(hidden, self.linear_fc2.expert_weight(expert)))
        return out


class SharedExpert(nn.Module):
    """The shared expert: a SwiGLU MLP whose output is scaled by sigmoid(x @ gate_weight^T)."""

    def __init__(self, model: ModelConfig):
        super().__init__()
        size = model.moe_shared_expert_intermediate_size
        assert size is not None
        self.linear_fc1 = linear(model.hidden_size, 2 * size)
        self.linear_fc2 = linear(size, model.hidden_size)
        self.gated = model.moe_shared_expert_gate
        if self.gated:
            self.gate_weight = nn.Parameter(torch.empty(1, model.hidden_size))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.linear_fc2(swiglu(self.linear_fc1(tokens)))
        if self.gated:
            out = out * torch.sigmoid(F.linear(tokens, self.gate_weight))
        return out


def switch_aux_loss(scores: torch.Tensor, top_experts: torch.Tensor, coeff: float) -> torch.Tensor:
    """Megatron's switch load-balancing loss of one MoE layer, coefficient included.

    scores [N, E]: the full softmax of the router logits; top_experts [N, k]: the chosen experts.
    E * coeff / (k * N^2) * sum_i (sum over tokens of score_i) * (tokens routed to i).
    """
    num_tokens, num_experts = scores.shape
    topk = top_experts.shape[-1]
    tokens_per_expert = torch.bincount(top_experts.flatten(), minlength=num_experts).to(scores.dtype)
    return (scores.sum(dim=0) * tokens_per_expert).sum() * (num_experts * coeff / (topk * num_tokens * num_tokens))


class Router(nn.Module):
    """Softmax top-k router in fp32 with Megatron's switch load-balancing loss."""

    def __init__(self, model: ModelConfig):
        super().__init__()
        assert model.num_experts is not None
        self.num_experts = model.num_experts
        self.topk = model.moe_router_topk
        self.norm_topk_prob = model.norm_topk_prob
        self.scaling = model.moe_router_topk_scaling_factor
        self.aux_loss_coeff = model.moe_aux_loss_coeff
        self.weight = nn.Parameter(torch.empty(model.num_experts, model.hidden_size))

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens [N, H] -> (probs [N, k], top_experts [N, k], coefficient-scaled aux loss)."""
        logits = F.linear(tokens.float(), self.weight.float())
        scores = logits.softmax(dim=-1)
        if self.norm_topk_prob:
            # softmax over the top-k logits == softmax over all experts renormalised over the top k
            top_logits, top_experts = logits.topk(self.topk, dim=-1)
            probs = top_logits.softmax(dim=-1)
        else:
            probs, top_experts = scores.topk(self.topk, dim=-1)
        probs = probs * self.scaling
        return probs, top_experts, switch_aux_loss(scores, top_experts, self.aux_loss_coeff)


class MoE(nn.Module):
    """Routed experts plus the (gated) shared expert; the input is already pre-MLP normalised."""

    def __init__(self, model: ModelConfig):
        super().__init__()
        self.router = Router(model)
        self.experts = GroupedExperts(model)
        self.shared_experts = SharedExpert(model)
        self.aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Also leaves this layer's coefficient-scaled aux loss in ``self.aux_loss`` (collected by the model)."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs, top_experts, self.aux_loss = self.router(tokens)
        out = self.experts(tokens, probs, top_experts) + self.shared_experts(tokens)
        return out.reshape(shape)


# ---- layers and the model -----------------------------------------------------------------------------


class TransformerLayer(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)); the norms live where Megatron's TE spec puts them.

    Dense: the pre-MLP norm is fused into ``mlp.linear_fc1``. MoE: ``pre_mlp_layernorm`` is a separate TENorm.
    """

    def __init__(self, model: ModelConfig, kind: str):
        super().__init__()
        self.self_attention = GatedAttention(model) if kind == "attention" else GatedDeltaNet(model)
        if model.is_moe:
            self.pre_mlp_layernorm = RMSNorm(model.hidden_size, model.norm_epsilon, norm_offset(model))
            self.mlp = MoE(model)
        else:
            self.mlp = DenseMLP(model)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.self_attention(x, rope)
        mlp_input = self.pre_mlp_layernorm(x) if hasattr(self, "pre_mlp_layernorm") else x
        return x + self.mlp(mlp_input)


class Embedding(nn.Module):
    def __init__(self, model: ModelConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(model.padded_vocab_size, model.hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.word_embeddings(input_ids)


class Decoder(nn.Module):
    def __init__(self, model: ModelConfig):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(model, kind) for kind in model.layer_kinds)
        self.final_layernorm = RMSNorm(model.hidden_size, model.norm_epsilon, norm_offset(model))

    def forward(self, x: torch.Tensor, rope) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, rope)
        return self.final_layernorm(x)


class MTPLayer(nn.Module):
    """One multi-token-prediction layer: eh_proj(cat(enorm(embedding), hnorm(h))) -> full-attention layer -> norm.

    The inner layer's attribute name depends on the megatron-core version (``transformer_layer`` up to
    0.16, ``mtp_model_layer`` from 0.17), so it is registered under that name.
    """

    def __init__(self, model: ModelConfig, inner_name: str):
        super().__init__()
        self.inner_name = inner_name
        self.enorm = RMSNorm(model.hidden_size, model.norm_epsilon, norm_offset(model))
        self.hnorm = RMSNorm(model.hidden_size, model.norm_epsilon, norm_offset(model))
        self.eh_proj = linear(2 * model.hidden_size, model.hidden_size)
        self.add_module(inner_name, TransformerLayer(model, "attention"))
        self.final_layernorm = RMSNorm(model.hidden_size, model.norm_epsilon, norm_offset(model))

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor, rope) -> torch.Tensor:
        x = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1))
        x = getattr(self, self.inner_name)(x, rope)
        return self.final_layernorm(x)


class MTPBlock(nn.Module):
    def __init__(self, model: ModelConfig, inner_name: str):
        super().__init__()
        self.layers = nn.ModuleList(MTPLayer(model, inner_name) for _ in range(model.mtp_num_layers))


def roll_left(x: torch.Tensor) -> torch.Tensor:
    """Megatron's roll_tensor(shifts=-1) along the sequence: shift left by one, the vacated last position 0."""
    rolled = torch.roll(x, shifts=-1, dims=-1)
    rolled[..., -1] = 0
    return rolled


def masked_mean_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """sum(mask * CE) / sum(mask): Megatron's token-weighted mean over one micro batch."""
    losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="none")
    mask = loss_mask.reshape(-1).float()
    return (losses * mask).sum() / mask.sum()


class Qwen35Model(nn.Module):
    """Qwen3.5 hybrid GPT (GDN 3:1 gated attention, optional MoE, MTP) with Megatron's parameter layout."""

    def __init__(self, model: ModelConfig, core_version: str = "0.16.1"):
        super().__init__()
        self.config = model
        self.core_version = core_version
        self.embedding = Embedding(model)
        self.decoder = Decoder(model)
        if model.mtp_num_layers:
            self.mtp = MTPBlock(model, mtp_inner_layer_name(core_version))
        self.output_layer = linear(model.hidden_size, model.padded_vocab_size)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Megatron-like init (uses the global torch RNG): normal(0, std) matrices, output projections
        scaled by 1/sqrt(2 * num_layers), norms 1, A_log = log(U(1, 16)), dt_bias 1, default conv init."""
        std = self.config.init_method_std
        scaled_std = std / math.sqrt(2.0 * self.config.num_layers)
        for name, param in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                param.copy_(torch.empty_like(param).uniform_(1, 16).log())
            elif leaf == "dt_bias" or param.dim() == 1:
                param.fill_(1.0)
            elif ".conv1d." in name:
                nn.init.kaiming_uniform_(param, a=math.sqrt(5))
            elif any(part in name for part in ("linear_proj.", "linear_fc2.", "out_proj.")):
                param.normal_(0.0, scaled_std)
            else:
                param.normal_(0.0, std)

    def moe_layers(self) -> list[MoE]:
        return [module for module in self.modules() if isinstance(module, MoE)]

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor):
        """(input_ids, labels, loss_mask) [B, T] -> (logits [B, T, V], lm_loss, mtp_losses [mtp_num_layers], aux_loss).

        mtp_losses are unscaled; aux_loss is the sum of every MoE layer's coefficient-scaled switch loss
        (decoder and MTP; 0 for dense). Position ids are 0..T-1 everywhere (the rotary table is shared).
        """
        rope = rotary_cos_sin(input_ids.shape[1], self.config.rotary_dim, self.config.rotary_base, input_ids.device)
        hidden = self.decoder(self.embedding(input_ids), rope)
        logits = self.output_layer(hidden)
        lm_loss = masked_mean_cross_entropy(logits, labels, loss_mask)

        mtp_losses = []
        mtp_ids, mtp_labels, mtp_mask = input_ids, labels, loss_mask
        for layer in (self.mtp.layers if self.config.mtp_num_layers else []):
            mtp_ids, mtp_labels, mtp_mask = roll_left(mtp_ids), roll_left(mtp_labels), roll_left(mtp_mask)
            hidden = layer(self.embedding(mtp_ids), hidden, rope)
            mtp_losses.append(masked_mean_cross_entropy(self.output_layer(hidden), mtp_labels, mtp_mask))
        mtp_loss_tensor = torch.stack(mtp_losses) if mtp_losses else torch.zeros(0)

        aux_losses = [moe.aux_loss for moe in self.moe_layers()]
        aux_loss = torch.stack(aux_losses).sum() if aux_losses else torch.zeros(())
        return logits, lm_loss, mtp_loss_tensor, aux_loss


# ---- strict loading ---------------------------------------------------------------------------------


def load_megatron_state(net: Qwen35Model, state: Mapping[str, torch.Tensor]) -> None:
    """Load a Megatron torch state dict strictly, upcasting to fp32.

    Accepts per-expert (``linear_fc1.weight0..``) or stacked (``linear_fc1.weight`` [E, 2i, H]) routed
    experts, and ignores TE ``*._extra_state`` entries (metadata, not weights). Any missing, unexpected
    or misshaped key raises :class:`StateDictMismatch` naming them all, before anything is copied:
    this is the guard against Megatron's silent fallback to ``strict=False``.
    """
    incoming = {key: value for key, value in state.items() if not key.endswith("._extra_state")}
    expected = net.state_dict()
    num_experts = net.config.num_experts
    if num_experts is not None:
        for key in list(incoming):
            if key.endswith(".mlp.experts.linear_fc1.weight") or key.endswith(".mlp.experts.linear_fc2.weight"):
                unstack_expert_weights(incoming, key[: -len("weight")], num_experts)

    problems = key_mismatches({key: tuple(value.shape) for key, value in incoming.items()},
                              {key: tuple(value.shape) for key, value in expected.items()})
    if problems:
        raise StateDictMismatch(f"Megatron state dict does not match the model: {problems}")
    net.load_state_dict({key: value.float() for key, value in incoming.items()}, strict=True)
