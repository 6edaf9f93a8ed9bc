"""megatron-core's own GPTModel for a model config, on CPU: built by the GPU launcher's spec builder, loaded strictly.

The TransformerConfig is what ``pretrain_gpt.py`` makes of the arguments ``backends/megatron.py``
generates from the same config (each field names its flag), except the two CPU settings of
``mcore_cpu``: deterministic mode and the allgather dispatcher. The layer specs come from the
functions of ``patches/megatron/pretrain_qwen35.py``, the GPU launcher that builds the real
run's model with them, here with megatron-core's local modules. A converted (TE-layout)
checkpoint is renamed by ``sides/megatron/te_local.py`` and loaded with ``strict=True``; a key that
is missing, unexpected or misshaped is an error naming it, never Megatron's silent non-strict
retry.

Everything here runs inside :func:`crossalign.sides.megatron.embedded.mcore_cpu.megatron_core_on_cpu`.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch
import torch.nn.functional as F

from crossalign.models.layout import mtp_layer_prefix
from crossalign.tensorio.errors import CheckpointError
from crossalign.tensorio.mismatch import key_mismatches
from crossalign.sides.megatron.te_local import layer_renames
from crossalign.config import MegatronParallel, ModelConfig, TrainingConfig
from crossalign.patching import PATCH_DIR

LAUNCHER = PATCH_DIR / "megatron" / "pretrain_qwen35.py"  # holds the layer-spec builder
IMPLEMENTATION = "megatron-core"


class McoreLoadError(ValueError):
    """A Megatron state dict that megatron-core's model does not load strictly; names every bad key."""


def layer_specs_module():
    """patches/megatron/pretrain_qwen35.py: the GPU launcher, whose layer-spec functions build the model here too."""
    name = "crossalign_pretrain_qwen35"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, LAUNCHER)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def transformer_config(model: ModelConfig, training: TrainingConfig, *, bf16: bool = False,
                       layout: MegatronParallel | None = None, device: str = "cpu", swiglu_fusion: bool = True):
    """The TransformerConfig of the generated Megatron arguments (fp32 unless ``bf16``) in ``layout``
    (None: one process), for the CPU; ``swiglu_fusion`` False: as with ``--no-bias-swiglu-fusion``."""
    from megatron.core.transformer import TransformerConfig

    layout = layout or MegatronParallel()
    moe: dict[str, Any] = {}
    if model.is_moe:
        moe = dict(
            num_moe_experts=model.num_experts,  # --num-experts
            moe_layer_freq=1,  # --moe-layer-freq 1
            moe_router_topk=model.moe_router_topk,
            moe_ffn_hidden_size=model.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
            moe_shared_expert_gate=model.moe_shared_expert_gate,
            moe_router_score_function=model.moe_router_score_function,
            moe_router_topk_scaling_factor=model.moe_router_topk_scaling_factor,
            moe_router_dtype=model.moe_router_dtype,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=model.moe_aux_loss_coeff,
            moe_router_pre_softmax=not model.norm_topk_prob,  # --moe-router-pre-softmax unless top-k softmax
            moe_grouped_gemm=False,  # the local experts are a SequentialMLP (TE: --moe-grouped-gemm)
            moe_token_dispatcher_type="alltoall",  # --moe-token-dispatcher-type alltoall (streams: mcore_cpu)
        )
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,  # --group-query-attention --num-query-groups
        kv_channels=model.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,  # --norm-epsilon
        # --apply-layernorm-1p; megatron-core's local (torch) norm refuses it (core_v0.16.1 transformer/torch_norm.py:27)
        layernorm_zero_centered_gamma=model.norm_convention == "zero_centred",
        # --swiglu; Megatron-LM's bias_swiglu_fusion is on unless --no-bias-swiglu-fusion (core_v0.16.1
        # megatron/training/arguments.py:1335, :2038): its fused swiglu rounds in bf16 as the GPU run does
        gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=swiglu_fusion,
        # Megatron-LM copies args.attention_softmax_in_fp32, False without --attention-softmax-in-fp32 or
        # --apply-query-key-layer-scaling (arguments.py:1083-1085, :1320-1322, :2192), not the dataclass's True
        attention_softmax_in_fp32=False,
        add_bias_linear=False,  # --disable-bias-linear
        qk_layernorm=True,
        attention_output_gate=True,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=model.linear_attention_freq,
        linear_conv_kernel_dim=model.linear_conv_kernel_dim,
        linear_key_head_dim=model.linear_key_head_dim,
        linear_value_head_dim=model.linear_value_head_dim,
        linear_num_key_heads=model.linear_num_key_heads,
        linear_num_value_heads=model.linear_num_value_heads,
        init_method_std=model.init_method_std,
        attention_dropout=training.attention_dropout,
        hidden_dropout=training.hidden_dropout,
        mtp_num_layers=model.mtp_num_layers or None,
        mtp_loss_scaling_factor=model.mtp_loss_scaling_factor,
        bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        # CPU: torch conv1d and torch_chunk_gated_delta_rule, not fla's Triton (mcore_cpu); GPU: --deterministic-mode
        deterministic_mode=True if device == "cpu" else training.deterministic,
        transformer_impl="local",
        gradient_accumulation_fusion=False,  # --no-gradient-accumulation-fusion
        persist_layer_norm=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False,
        tensor_model_parallel_size=layout.tensor,  # --tensor-model-parallel-size
        pipeline_model_parallel_size=layout.pipeline,  # --pipeline-model-parallel-size
        expert_model_parallel_size=layout.expert,  # --expert-model-parallel-size
        expert_tensor_parallel_size=layout.expert_tensor_size,  # --expert-tensor-parallel-size
        sequence_parallel=layout.sequence_parallel,  # --sequence-parallel
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        batch_p2p_sync=False,  # CPU: the sync after batched p2p is torch.cuda.synchronize(); gloo waits itself
        **moe,
    )


def build_gpt_model(model: ModelConfig, training: TrainingConfig, *, bf16: bool = False,
                    layout: MegatronParallel | None = None, device: str = "cpu", swiglu_fusion: bool = True):
    """megatron-core's GPTModel with the shared Qwen3.5 layer specs (local modules), as gpt_builder builds it:
    this process's pipeline stage and tensor/expert shard of it, in megatron-core's initialised parallel state."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    specs = layer_specs_module()
    config = transformer_config(model, training, bf16=bf16, layout=layout, device=device,
                                swiglu_fusion=swiglu_fusion)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GPTModel(
            config=config,
            transformer_layer_spec=specs.decoder_block_spec(config, use_te=False),
            vocab_size=model.padded_vocab_size,
            max_sequence_length=model.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
            parallel_output=True,
            share_embeddings_and_output_weights=False,  # --untie-embeddings-and-output-weights
            position_embedding_type="rope",
            rotary_percent=model.rotary_percent,
            rotary_base=int(model.rotary_base) if float(model.rotary_base).is_integer() else model.rotary_base,
            mtp_block_spec=specs.mtp_block_spec(config, use_te=False),
        )


@dataclass(frozen=True)
class Shard:
    """Which part of the model this process holds: its (tensor, pipeline, expert) ranks in a layout."""

    tensor_rank: int = 0
    pipeline_rank: int = 0
    expert_rank: int = 0
    layout: MegatronParallel = MegatronParallel()

    @classmethod
    def of_this_process(cls, layout: MegatronParallel) -> "Shard":
        """This process's shard, read off megatron-core's initialised parallel state."""
        from megatron.core import parallel_state as ps

        return cls(ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                   ps.get_expert_model_parallel_rank(), layout)

    @property
    def rank(self) -> tuple[int, int, int]:
        return self.tensor_rank, self.pipeline_rank, self.expert_rank

    def first_layer(self, model: ModelConfig) -> int:
        """The global number of this stage's first decoder layer (stages take equal shares, as reshard cuts them)."""
        return self.pipeline_rank * model.num_layers // self.layout.pipeline

    def name(self) -> str:
        return f"(tensor, pipeline, expert) rank {self.rank}"


def shard_state(state: Mapping[str, torch.Tensor], model: ModelConfig, shard: Shard) -> dict[str, torch.Tensor]:
    """This shard's tensors of a full (TE-layout) state dict, under their names on its rank, by the checkpoint
    layout rules (``sides/megatron/sharding.py``: per-rank segments, stage-local layer and EP-local expert numbers)."""
    from crossalign.sides.megatron.sharding import shard_tensor

    layout = shard.layout
    if (layout.tensor, layout.pipeline, layout.expert) == (1, 1, 1):
        return dict(state)
    mine = {}
    for key, tensor in state.items():
        try:
            placed = shard_tensor(key, tensor, model, layout.tensor, layout.pipeline, layout.expert,
                                  layout.expert_tensor_size)
        except CheckpointError:  # a key the model has no such tensor for (a_log under its MindSpore name): kept
            mine[key] = tensor  # whole, so that the strict load names it unexpected, as Megatron's load does
            continue
        for rank, local_key, part in placed:
            if rank == shard.rank:
                mine[local_key] = part
    return mine


_STAGE_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.*)")


def stage_names(keys, model: ModelConfig, core_version: str, first_layer: int, *, to_local: bool) -> dict[str, str]:
    """TE <-> local names of one pipeline stage's keys (its layers numbered from 0; a layer's kind is that of
    global layer ``first_layer`` + i), by ``sides/megatron/te_local.layer_renames``."""
    inner = f"mtp.layers.{{}}.{mtp_layer_prefix(core_version)}."
    names = {}
    for key in keys:
        match = _STAGE_LAYER.fullmatch(key)
        if match:
            prefix, rest, kind = f"decoder.layers.{match.group(1)}.", match.group(2), model.layer_kind(
                first_layer + int(match.group(1)))
        else:
            mtp = re.fullmatch(r"mtp\.layers\.(\d+)\." + re.escape(mtp_layer_prefix(core_version)) + r"\.(.*)", key)
            if not mtp:
                continue
            prefix, rest, kind = inner.format(mtp.group(1)), mtp.group(2), "attention"
        renames = dict(layer_renames(model, kind))
        if not to_local:
            renames = {local: te for te, local in renames.items()}
        if rest in renames:
            names[key] = prefix + renames[rest]
    return names


def load_converted_state(net, state: Mapping[str, torch.Tensor], model: ModelConfig, core_version: str,
                         shard: Shard | None = None) -> None:
    """Load a converted (TE-layout) Megatron state dict strictly, in the model's dtype: the whole of it, or the
    part of ``shard``'s rank (cut from the full state by the checkpoint layout rules).

    Stacked routed experts ([E, out, in] under ``linear_fc{1,2}.weight``) are split per expert
    first, as TE's load hook does. Raises :class:`McoreLoadError` naming every missing,
    unexpected or misshaped key before anything is copied.
    """
    from crossalign.models.layout import unstack_expert_weights

    shard = shard or Shard()
    incoming = shard_state(state, model, shard)
    if model.num_experts is not None:
        local_experts = model.num_experts // shard.layout.expert
        for key in list(incoming):
            if key.endswith((".mlp.experts.linear_fc1.weight", ".mlp.experts.linear_fc2.weight")):
                unstack_expert_weights(incoming, key[: -len("weight")], local_experts)
    incoming = {key: value for key, value in incoming.items() if not key.endswith("._extra_state")}
    renames = stage_names(incoming, model, core_version, shard.first_layer(model), to_local=True)
    local = {renames.get(key, key): value for key, value in incoming.items()}
    expected = {key: value for key, value in net.state_dict().items() if not key.endswith("._extra_state")}
    problems = key_mismatches({k: tuple(v.shape) for k, v in local.items()},
                              {k: tuple(v.shape) for k, v in expected.items()})
    if problems:
        where = f" on {shard.name()} of {shard.layout.ranks}" if shard.layout.world_size > 1 else ""
        raise McoreLoadError(f"megatron-core GPTModel{where} does not load the checkpoint: {problems}")
    dtypes = {key: value.dtype for key, value in expected.items()}
    net.load_state_dict({key: value.to(dtypes[key]) for key, value in local.items()}, strict=True)


def positions_and_mask(input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTModel's position ids 0..T-1 and an explicit causal mask (True = masked) for input_ids [B, T].

    Always passed: without a mask megatron-core's softmax makes one with ``get_default_causal_mask``,
    which hard-codes ``device="cuda"``.
    """
    batch, seq = input_ids.shape
    device = input_ids.device
    position_ids = torch.arange(seq, dtype=torch.long, device=device).unsqueeze(0).expand(batch, seq)
    return position_ids, torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)[None, None]


def forward(net, input_ids: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> dict[str, Any]:
    """One forward of GPTModel as pretrain_gpt.py runs it, with the values Megatron's own code computed.

    Returns the per-token lm loss [B, T] (GPTModel's output), the lm loss (pretrain_gpt's
    loss_func: sum(loss * mask) / sum(mask)), the main logits [B, T, V] (caught at the output
    layer), the MTP losses (MTPLossLoggingHelper's tracker, unscaled) and the aux loss (the
    sum over MoE layers of the router's load_balancing_loss tracker, times the coefficient).
    The trackers are filled only in train mode with grad enabled (dropout is 0).
    """
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    position_ids, causal = positions_and_mask(input_ids)
    logits = []
    # cloned: the vocab-parallel cross entropy works on the logits in place
    hook = net.output_layer.register_forward_hook(lambda module, args, out: logits.append(out[0].detach().clone()))
    clear_aux_losses_tracker()
    if "values" in MTPLossLoggingHelper.tracker:
        MTPLossLoggingHelper.clean_loss_in_tracker()
    try:
        per_token = net(input_ids, position_ids, causal, labels=labels, loss_mask=loss_mask)
    finally:
        hook.remove()
    mask = loss_mask.float()
    lm_loss = (per_token.float() * mask).sum() / mask.sum()
    mtp = MTPLossLoggingHelper.tracker.get("values") if net.config.mtp_num_layers else None
    aux = torch.zeros(())
    tracker = get_moe_layer_wise_logging_tracker()
    if net.config.num_moe_experts and "load_balancing_loss" in tracker:
        aux = tracker["load_balancing_loss"]["values"].sum() * net.config.moe_aux_loss_coeff
    return {"per_token": per_token, "lm_loss": lm_loss, "logits": logits[-1].transpose(0, 1),
            "mtp_losses": mtp.clone() if mtp is not None else torch.zeros(0), "aux_loss": aux}


def run_selfcheck_forward(model: ModelConfig, training: TrainingConfig, state: Mapping[str, torch.Tensor],
                          core_version: str, input_ids: np.ndarray, labels: np.ndarray,
                          loss_mask: np.ndarray) -> dict[str, np.ndarray | float]:
    """Build, load strictly and run one fp32 forward on CPU; the outputs as numpy (logits float64)."""
    from crossalign.sides.megatron.embedded.mcore_cpu import megatron_core_on_cpu

    with megatron_core_on_cpu(training.seed):
        net = build_gpt_model(model, training)
        load_converted_state(net, state, model, core_version)
        # Megatron fills its MTP and aux-loss trackers only in train mode with grad enabled (dropout is 0);
        # frozen parameters keep autograd from recording anything.
        net.train()
        net.requires_grad_(False)
        out = forward(net, torch.from_numpy(input_ids), torch.from_numpy(labels), torch.from_numpy(loss_mask))
    return {"logits": out["logits"].double().numpy(), "lm_loss": float(out["lm_loss"]),
            "mtp_losses": out["mtp_losses"].double().numpy().reshape(-1), "aux_loss": float(out["aux_loss"])}
