"""transformers' own Qwen3.5 on one batch: the public reference implementation beside our two models.

The trunk is ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` loaded by transformers itself
(``from_pretrained`` on the Hugging Face folder, its weight conversions included). transformers
has no MTP module (it drops ``mtp.*`` on load), so the MTP layer is assembled from transformers'
own modules the way released checkpoints are served (vLLM ``qwen3_5_mtp.py``): ``fc`` over
cat(pre_fc_norm_embedding(embed(next ids)), pre_fc_norm_hidden(h)), a full-attention
``Qwen3_5DecoderLayer``, then ``norm``, where h is the trunk's output after its final norm;
the shared ``lm_head`` gives the logits. Losses are the token-weighted means of the forward
contract; the aux loss is Megatron's switch loss of each router's choices (transformers' own
aux loss is a different, global formula).

On CPU with fla-core installed, transformers binds fla's Triton kernels for the gated delta
rule and the causal conv at import, which fail without a GPU ("0 active drivers"); the
functions are unwrapped (``__wrapped__``) to transformers' pure-torch forms before use.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import numpy as np

from crossalign.config import ModelConfig
from crossalign.diagnose.references import Batch, Outputs, SideError

KERNEL_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn")
MODELING = ("transformers.models.qwen3_5.modeling_qwen3_5", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")


def use_pure_torch_kernels() -> None:
    """Point transformers' Qwen3.5 modules at their own pure-torch gated delta rule and causal conv."""
    import importlib

    for name in MODELING:
        module = importlib.import_module(name)
        for function in KERNEL_FUNCTIONS:
            setattr(module, function, inspect.unwrap(getattr(module, function)))


def _mtp_module(lm: Any, state: dict[str, Any]) -> Any:
    """The MTP layer from transformers' modules, loaded strictly from the checkpoint's ``mtp.*`` tensors."""
    import torch
    from torch import nn

    from crossalign.checkpoint.rules import Experts

    config = lm.config
    modeling = inspect.getmodule(type(lm))
    prefix = "Qwen3_5Moe" if config.model_type == "qwen3_5_moe_text" else "Qwen3_5"
    norm, layer = getattr(modeling, f"{prefix}RMSNorm"), getattr(modeling, f"{prefix}DecoderLayer")
    hidden, eps = config.hidden_size, config.rms_norm_eps
    mtp = nn.Module()
    mtp.fc = nn.Linear(2 * hidden, hidden, bias=False)
    mtp.pre_fc_norm_embedding = norm(hidden, eps=eps)
    mtp.pre_fc_norm_hidden = norm(hidden, eps=eps)
    mtp.layers = nn.ModuleList([layer(config, config.layer_types.index("full_attention"))])
    mtp.norm = norm(hidden, eps=eps)
    weights = {key.removeprefix("mtp."): value.float() for key, value in state.items()}
    if config.model_type == "qwen3_5_moe_text" and "layers.0.mlp.experts.0.gate_proj.weight" in weights:
        # released per-expert tensors, packed as transformers' module holds them ([E, 2i, H] = [gate; up] per expert)
        for which, packed in (("fc1", "gate_up_proj"), ("fc2", "down_proj")):
            rule = Experts(which, config.num_experts, "per_expert", False)
            parts = [weights.pop(f"layers.0.{key}") for key in rule.sources]
            weights[f"layers.0.mlp.experts.{packed}"] = rule.forward(parts)[0]
    try:
        mtp.load_state_dict(weights, strict=True)
    except RuntimeError as exc:
        raise SideError(f"Hugging Face MTP load: {exc}") from None
    return mtp.to(torch.float32).eval()


def module_pairs(ref: HFReference, core_version: str) -> list[tuple[str, str]]:
    """transformers' modules and our PyTorch model's modules that compute the same tensor, in forward order.

    The input norms are fused into the following linear on the Megatron side, so the comparable
    outputs are the embedding, each layer's mixer and MLP (before the residual add) and the layer
    itself, the final norm, the MTP layer's fc, inner layer and norm, and the output layer.
    """
    from crossalign.models.layout import mtp_layer_prefix

    m = ref.model
    pairs = [("lm.model.embed_tokens", "embedding.word_embeddings")]
    for i, kind in enumerate(m.layer_kinds):
        mixer = "self_attn" if kind == "attention" else "linear_attn"
        pairs += [(f"lm.model.layers.{i}.{mixer}", f"decoder.layers.{i}.self_attention"),
                  (f"lm.model.layers.{i}.mlp", f"decoder.layers.{i}.mlp"), (f"lm.model.layers.{i}", f"decoder.layers.{i}")]
    pairs += [("lm.model.norm", "decoder.final_layernorm"), ("lm.lm_head", "output_layer")]
    if ref.mtp is not None:
        inner = f"mtp.layers.0.{mtp_layer_prefix(core_version)}"
        pairs += [("mtp.fc", "mtp.layers.0.eh_proj"), ("mtp.layers.0.self_attn", f"{inner}.self_attention"),
                  ("mtp.layers.0.mlp", f"{inner}.mlp"), ("mtp.layers.0", inner), ("mtp.norm", "mtp.layers.0.final_layernorm")]
    return pairs


def first_departure(ref: HFReference, net: Any, batch: Batch, core_version: str,
                    tolerance: float = 1e-4) -> tuple[str, str, float] | None:
    """The first module (in forward order) whose output differs between transformers and our PyTorch model:
    (transformers module, PyTorch module, max abs error over max |output|), or None if every pair agrees."""
    import torch

    roots = {"lm": ref.lm, "mtp": ref.mtp}
    outputs: dict[str, torch.Tensor] = {}

    def keep(name: str):
        def hook(_module, _inputs, output):
            tensor = output[0] if isinstance(output, tuple) else output
            outputs.setdefault(name, tensor.detach().double())  # the first call (lm_head also serves the MTP)
        return hook

    pairs = module_pairs(ref, core_version)
    hooks = []
    for hf_name, torch_name in pairs:
        root, _, path = hf_name.partition(".")
        hooks.append(roots[root].get_submodule(path).register_forward_hook(keep("hf:" + hf_name)))
        hooks.append(net.get_submodule(torch_name).register_forward_hook(keep("pt:" + torch_name)))
    try:
        run_hf(ref, batch)
        from crossalign.diagnose.references import run_megatron

        run_megatron(net, batch)
    finally:
        for hook in hooks:
            hook.remove()
    for hf_name, torch_name in pairs:
        a, b = outputs["hf:" + hf_name], outputs["pt:" + torch_name].reshape(outputs["hf:" + hf_name].shape)
        error = float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))
        if error > tolerance:
            return hf_name, torch_name, error
    return None


class HFReference:
    """transformers' causal LM (trunk) and the MTP layer built from its modules, in fp32."""

    def __init__(self, lm: Any, mtp: Any | None, model: ModelConfig):
        self.lm, self.mtp, self.model = lm, mtp, model


def build_hf(model: ModelConfig, directory: Path) -> HFReference:
    """Load a Hugging Face Qwen3.5 folder with transformers (fp32, eager attention) plus its MTP layer."""
    import torch
    import transformers

    from crossalign.checkpoint.hf import read_hf_checkpoint

    use_pure_torch_kernels()
    source = read_hf_checkpoint(directory)
    name = "Qwen3_5MoeForCausalLM" if model.is_moe else "Qwen3_5ForCausalLM"
    transformers.logging.set_verbosity_error()  # the pure-torch fallback notice is expected here
    lm, info = getattr(transformers, name).from_pretrained(directory, dtype=torch.float32, attn_implementation="eager",
                                                           output_loading_info=True)
    missing = sorted(info["missing_keys"])
    if missing or info["mismatched_keys"]:
        raise SideError(f"Hugging Face load of {directory}: missing {missing[:8]}, "
                        f"mismatched {list(info['mismatched_keys'])[:8]}")
    lm.eval()
    mtp = None
    if model.mtp_num_layers:
        mtp_keys = [key for key in source.entries if key.startswith("mtp.")]
        mtp = _mtp_module(lm, {key: source.tensor(key) for key in mtp_keys})
    return HFReference(lm, mtp, model)


def run_hf(ref: HFReference, batch: Batch) -> Outputs:
    """The forward contract through transformers' modules: logits, lm loss, MTP losses, aux loss."""
    import torch

    from crossalign.models.torch_model import masked_mean_cross_entropy, roll_left, switch_aux_loss

    routers: list[torch.Tensor] = []
    hooks = [module.register_forward_hook(lambda _m, _i, out: routers.append(out))
             for module in ref.lm.modules() if type(module).__name__ == "Qwen3_5MoeTopKRouter"]
    if ref.mtp is not None:
        hooks += [module.register_forward_hook(lambda _m, _i, out: routers.append(out))
                  for module in ref.mtp.modules() if type(module).__name__ == "Qwen3_5MoeTopKRouter"]
    ids, labels, mask = (torch.from_numpy(a) for a in (batch.input_ids, batch.labels, batch.loss_mask))
    try:
        with torch.no_grad():
            hidden = ref.lm.model(input_ids=ids).last_hidden_state  # after the final norm
            logits = ref.lm.lm_head(hidden)
            lm_loss = masked_mean_cross_entropy(logits, labels, mask)
            mtp_losses = []
            if ref.mtp is not None:
                seq = ids.shape[1]
                causal = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
                positions = torch.arange(seq)[None, None].expand(1, ids.shape[0], seq)
                mtp_ids, mtp_labels, mtp_mask = roll_left(ids), roll_left(labels), roll_left(mask)
                embedded = ref.lm.model.embed_tokens(mtp_ids)
                x = ref.mtp.fc(torch.cat((ref.mtp.pre_fc_norm_embedding(embedded), ref.mtp.pre_fc_norm_hidden(hidden)),
                                         dim=-1))
                rope = ref.lm.model.rotary_emb(x, positions)
                x = ref.mtp.norm(ref.mtp.layers[0](x, position_embeddings=rope, attention_mask=causal))
                mtp_losses.append(masked_mean_cross_entropy(ref.lm.lm_head(x), mtp_labels, mtp_mask))
    finally:
        for hook in hooks:
            hook.remove()
    coeff = ref.model.moe_aux_loss_coeff
    aux = sum((switch_aux_loss(logits_.float().softmax(dim=-1), chosen, coeff) for logits_, _, chosen in routers),
              torch.zeros(()))
    return Outputs(logits=logits.double().numpy(), lm_loss=float(lm_loss),
                   mtp_losses=np.array([float(loss) for loss in mtp_losses], dtype=np.float64), aux_loss=float(aux))
