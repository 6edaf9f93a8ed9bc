"""The pynative ``TrainConfig`` YAML MindFormers is launched with, written from the model config.

:func:`mindformers_yaml` turns the model config into the pynative ``TrainConfig`` YAML (SPEC
section 8; schema in reference/mindformers.md 2b) for the base run (DAG step 1: random init,
save) and the alignment run (step 5: load the bf16 checkpoint). Settings that change numbers
are written explicitly even where they equal a MindFormers default, so that ``crossalign
preflight config`` can read them back and the YAML documents the run by itself.

The ``model`` section uses only keys that MindFormers' config converter reads. The pynative
models convert their config with ``ConfigConverter`` (``mindformers/parallel_core/config_converter.py``,
r1.9.0, r2.0.0 and master): a key is read when a ``CONFIG_MAPPING`` of the model's converter
maps it (Qwen3: ``head_dim``, ``num_hidden_layers``, ``rms_norm_eps``, ``rope_theta``, ...) or
when it is a ``TransformerConfig`` field of the same name; any other key is dropped with only an
"Unmapped Keys" warning (config_converter.py:97-101). So the router's score function is written
``moe_router_score_function`` (``scoring_func`` is dropped), and ``normalization: RMSNorm`` and
``gated_linear_unit: true`` are always written (TransformerConfig's defaults are LayerNorm and
no GLU; only Qwen3's config class registers the right ones).

Public MindFormers has no Qwen3.5 model, and its TransformerConfig has no ``attention_output_gate``
and none of the six ``linear_*`` GatedDeltaNet fields: a site's fork must add them (they are
written here under Megatron's names). Because a dropped key only warns, the step reads back the
"The final converted TransformerConfig is:" block the converter logs (config_converter.py:108-112)
and fails, naming the setting, when a number-changing setting is missing or different
(``log_checks.verify_transformer_config``). A fork that needs other keys gets them through
``request.extra["mindformers_model"]``, merged over the generated section.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml

from crossalign.sides.launch import (
    BackendSetupError,
)
from crossalign.config import AlignmentConfig
from crossalign.sides.mindformers.log_lines import mindformers_scales_mtp_loss
from crossalign.data.settings import SampleOrderSettings
from crossalign.config import TrainingConfig




CHECKPOINT_PREFIX = "qwen35"
ROUTER_DTYPE_NAMES = {"fp32": "float32"}  # our config's (Megatron's) names -> MindFormers' dtype names


def shared_expert_num(config: AlignmentConfig) -> int:
    """Qwen3.5 MoE has one shared expert (of moe_shared_expert_intermediate_size) or none."""
    return 1 if config.model.moe_shared_expert_intermediate_size else 0


def check_mindformers_version(config: AlignmentConfig) -> bool:
    """Whether the site's MindFormers (``training.mindformers_version``) logs mtp_<i>_loss scaled; raise
    BackendSetupError for a release the generated YAML and the log check do not support."""
    try:
        return mindformers_scales_mtp_loss(config.training.mindformers_version)
    except ValueError as exc:
        raise BackendSetupError(f"training.mindformers_version: {exc}") from None


def _model_section(config: AlignmentConfig) -> dict:
    m, t = config.model, config.training
    model = {
        "model_type": "qwen3_5_moe" if m.is_moe else "qwen3_5",
        "architectures": "Qwen3_5MoeForCausalLM" if m.is_moe else "Qwen3_5ForCausalLM",
        "vocab_size": m.padded_vocab_size,
        "seq_length": t.seq_length,
        "max_position_embeddings": m.max_position_embeddings,
        "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups,
        "head_dim": m.kv_channels,
        "intermediate_size": m.ffn_hidden_size,
        # The pynative ACTIVATION_MAP has gelu, silu and fusedswiglu only ("swiglu" fails the model build,
        # 2.1.0 pynative/layers/activation.py:280-309); SwiGLU is silu with gated_linear_unit, as upstream's
        # pynative YAMLs write it.
        "hidden_act": "silu",
        "normalization": "RMSNorm",
        "gated_linear_unit": True,
        "rms_norm_eps": m.norm_epsilon,
        "position_embedding_type": "rope",
        "rope_theta": m.rotary_base,
        "partial_rotary_factor": m.rotary_percent,
        "qk_layernorm": True,
        "attention_output_gate": True,
        "add_bias_linear": False,
        "tie_word_embeddings": False,
        "attention_dropout": t.attention_dropout,
        "hidden_dropout": t.hidden_dropout,
        "initializer_range": m.init_method_std,
        "params_dtype": "float32",
        "compute_dtype": "bfloat16" if t.bf16 else "float32",
        "layernorm_compute_dtype": "float32",
        "softmax_compute_dtype": "float32",
        "rotary_dtype": "float32",
        "use_interleaved_weight_layout_mlp": True,
        "experimental_attention_variant": "gated_delta_net",
        "linear_attention_freq": m.linear_attention_freq,
        "linear_conv_kernel_dim": m.linear_conv_kernel_dim,
        "linear_key_head_dim": m.linear_key_head_dim,
        "linear_value_head_dim": m.linear_value_head_dim,
        "linear_num_key_heads": m.linear_num_key_heads,
        "linear_num_value_heads": m.linear_num_value_heads,
        "mtp_num_layers": m.mtp_num_layers,
        "mtp_loss_scaling_factor": m.mtp_loss_scaling_factor,
    }
    if m.is_moe:
        model.update({
            "num_experts": m.num_experts,
            "num_experts_per_tok": m.moe_router_topk,
            "moe_intermediate_size": m.moe_ffn_hidden_size,
            # Without shared_expert_num > 0 the pynative MoE layer builds no shared expert, with only a
            # warning (2.1.0 pynative/transformers/moe/moe_layer.py:56; TransformerConfig default 0).
            "shared_expert_num": shared_expert_num(config),
            "moe_shared_expert_intermediate_size": m.moe_shared_expert_intermediate_size,
            "use_shared_expert_gating": m.moe_shared_expert_gate,
            "norm_topk_prob": m.norm_topk_prob,
            "moe_router_score_function": m.moe_router_score_function,
            "routed_scaling_factor": m.moe_router_topk_scaling_factor,
            "router_dense_type": ROUTER_DTYPE_NAMES[m.moe_router_dtype],
            "moe_router_load_balancing_type": "aux_loss",
            "moe_aux_loss_coeff": m.moe_aux_loss_coeff,
            "moe_grouped_gemm": True,
        })
    return model


def mindformers_yaml(
    config: AlignmentConfig,
    *,
    mode: Literal["base", "align"],
    data_prefix: Path | str,
    tokenizer: Path | str | None = None,
    load_dir: Path | str | None = None,
    save_dir: Path | str | None = None,
    nproc: int | None = None,
    model_overrides: dict | None = None,
) -> dict:
    """The pynative TrainConfig for a base run (``mode="base"``) or the alignment run (``"align"``).

    ``tokenizer`` is not written (the indexed dataset is already tokenised; the loader pads with
    -1, which no token uses); it is accepted for symmetry with :func:`megatron_args`. The
    ``parallelism`` section is the config's ``parallel.mindformers`` (``nproc`` cards in place of
    its cards when given); the cards it leaves run data parallel (``data_parallel_shard: -1``).
    """
    t, layout = config.training, config.parallel.mindformers
    cards = nproc or layout.world_size
    if mode not in ("base", "align"):
        raise ValueError(f"mode must be 'base' or 'align', not {mode!r}")
    if mode == "align" and load_dir is None:
        raise BackendSetupError("the align run needs load_dir (the bf16 MindFormers checkpoint)")
    if cards % layout.model_parallel:
        raise BackendSetupError(f"parallel.mindformers: TP {layout.tensor} x PP {layout.pipeline} x CP "
                                f"{layout.context} does not fit {cards} cards")
    data_parallel = cards // layout.model_parallel
    if t.global_batch_size % (t.micro_batch_size * data_parallel):
        raise BackendSetupError(f"training.global_batch_size {t.global_batch_size} is not a multiple of "
                                f"micro_batch_size {t.micro_batch_size} x {data_parallel} cards")
    check_mindformers_version(config)
    steps = t.base_train_iters if mode == "base" else t.train_iters
    model = _model_section(config)
    model.update(model_overrides or {})
    # No top-level run_mode or seed: the pynative TrainConfig reads neither (run_mindformer.py --mode 1
    # builds the trainer with its default run_mode "train"; the seeds are training.seed and the
    # dataset's config.seed; mindformers/pynative/config/config.py TrainConfig, r2.0.0).
    return {
        "checkpoint": {
            "enable_save": save_dir is not None,
            "save_path": str(save_dir) if save_dir is not None else "",
            "save_max": 1,
            "save_interleaved_steps": steps,
            "no_save_optim": False,
            "async_save": False,
            "prefix": CHECKPOINT_PREFIX,
            "remove_redundancy": False,
            "load_path": str(load_dir) if load_dir is not None else "",
            "load_balanced": False,
            "no_load_optim": True,
            "load_worker_number": 1,
        },
        "training": {
            "steps": steps,
            "local_batch_size": t.micro_batch_size,
            "global_batch_size": t.global_batch_size,
            "max_norm": t.clip_grad,
            "seed": t.seed,
            "deterministic": t.deterministic,
        },
        "optimizer": {
            "type": "AdamW",
            "betas": [t.adam_beta1, t.adam_beta2],
            "eps": t.adam_eps,
            "weight_decay": t.weight_decay,
        },
        "lr_scheduler": {
            "type": "ConstantWarmUpLR",
            "learning_rate": t.lr,
            "warmup_steps": t.lr_warmup_iters,
            "warmup_lr_init": t.lr_warmup_init,
        },
        "parallelism": {
            "data_parallel_shard": -1,
            "tensor_parallel": layout.tensor,
            "pipeline_parallel": layout.pipeline,
            "expert_parallel": layout.expert,
            "context_parallel": layout.context,
            "sequence_parallel": layout.sequence_parallel,
        },
        # The string "None" (no recompute); RecomputeConfig accepts only "None", "full" and "select" and
        # rejects lower-case "none" (2.1.0 pynative/config/config.py:886-891).
        "recompute": {"mode": "None"},
        "train_dataset": {
            "dataloader": {
                "type": "BlendedMegatronDatasetDataLoader",
                "datasets_type": "GPTDataset",
                "sizes": [steps * t.global_batch_size, 0, 0],
                "config": {
                    "seed": t.seed,
                    "split": t.split,
                    "seq_length": t.seq_length,
                    "data_path": [str(data_prefix)],
                    "eod_mask_loss": False,
                    "reset_position_ids": False,
                    "create_attention_mask": False,
                    "reset_attention_mask": False,
                    "create_compressed_eod_mask": False,
                    "pad": -1,
                },
                "column_names": ["input_ids", "labels", "loss_mask", "position_ids"],
                "shuffle": False,
            },
            "drop_remainder": True,
            "num_parallel_workers": 1,
        },
        "model": model,
        "context": {"mode": 1, "device_target": "Ascend"},
    }


def dump_yaml(data: dict, path: Path) -> Path:
    """Write the YAML atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    tmp.replace(path)
    return path


def sample_order(training: TrainingConfig, num_samples: int | None = None) -> SampleOrderSettings:
    """What our generated MindFormers YAML says: dataloader config seed/split, ``data_path: [prefix]``,
    ``sizes: [num_samples, 0, 0]``; MindFormers reads the dataset in order (``shuffle: false``)."""
    return SampleOrderSettings(seed=training.seed, split=training.split, seq_length=training.seq_length,
               num_samples=num_samples or training.train_samples, blend="bare",
               dataloader_type="single", micro_batch_size=training.micro_batch_size)
