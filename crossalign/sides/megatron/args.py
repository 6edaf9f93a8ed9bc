"""The ``pretrain_gpt.py`` arguments of a model config (SPEC section 8): everything Megatron is told.

Everything comes from the model config, so it cannot drift from the MindFormers YAML built from the same
file; ``crossalign preflight config`` reads both back (``args_reader.py``) and compares them.
"""

from __future__ import annotations

import json
from pathlib import Path


from crossalign.sides.launch import (
    BackendSetupError,
)
from crossalign.config import AlignmentConfig, MegatronParallel
from crossalign.versions import version_tuple
from crossalign.data.settings import SampleOrderSettings
from crossalign.config import TrainingConfig
from crossalign.dump_settings import DumpSettings




NULL_TOKENIZER_EXACT_FROM = (0, 18, 0)


def null_tokenizer_vocab_size(vocab_size_arg: int, core_version: str | tuple[int, ...]) -> int:
    """The vocab size NullTokenizer reports for ``--vocab-size vocab_size_arg`` in this megatron-core."""
    version = version_tuple(core_version) if isinstance(core_version, str) else tuple(core_version)
    return vocab_size_arg if version >= NULL_TOKENIZER_EXACT_FROM else vocab_size_arg + 1


def null_tokenizer_vocab_arg(rows: int, core_version: str | tuple[int, ...]) -> int:
    """The ``--vocab-size`` that makes NullTokenizer report exactly ``rows`` (the checkpoint's embedding rows)."""
    added = null_tokenizer_vocab_size(rows, core_version) - rows  # the eod row NullTokenizer adds: 1 or 0
    return rows - added


def _num(value: float) -> str:
    """A float as Megatron's argparse reads it back exactly."""
    return repr(float(value))


def tokenizer_size(tokenizer: Path) -> int:
    """Entries of a HuggingFace tokenizer.json (a file, or a folder holding one): vocab plus added tokens."""
    path = tokenizer / "tokenizer.json" if tokenizer.is_dir() else tokenizer
    if not path.exists():
        raise BackendSetupError(f"{path}: tokenizer not found")
    raw = json.loads(path.read_text())
    vocab = raw.get("model", {}).get("vocab", {})
    ids = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab)))
    ids.update(token["id"] for token in raw.get("added_tokens", []))
    return max(ids) + 1 if ids else 0


def parallel_args(layout: MegatronParallel, moe: bool) -> list[str]:
    """The layout's flags (core_v0.16.1 megatron/training/arguments.py, _add_distributed_args)."""
    args = ["--tensor-model-parallel-size", str(layout.tensor), "--pipeline-model-parallel-size", str(layout.pipeline)]
    if layout.virtual_pipeline_layers is not None:
        args += ["--num-layers-per-virtual-pipeline-stage", str(layout.virtual_pipeline_layers)]
    if moe:
        args += ["--expert-model-parallel-size", str(layout.expert),
                 "--expert-tensor-parallel-size", str(layout.expert_tensor_size)]
    if layout.context > 1:
        args += ["--context-parallel-size", str(layout.context)]
    if layout.sequence_parallel:
        args.append("--sequence-parallel")
    return args


UNFUSED_FOR_MIX = ("crossalign: msprobe dump at level mix: the MLPs run SwiGLU unfused (bias_activation_fusion off, "
                   "as --no-bias-swiglu-fusion): msprobe wraps torch.nn.functional.silu, which megatron-core's fused "
                   "SwiGLU path refuses")


def swiglu_fusion_under(dump: DumpSettings | None) -> bool:
    """Whether the MLPs may fuse SwiGLU (Megatron-LM's default, ``--bias-swiglu-fusion``) under ``dump``: not at
    level mix.

    At mix (and L1) msprobe's ``start()`` replaces each API it dumps by a wrapper, ``torch.nn.functional.silu``
    among them (``msprobe/core/dump/service.py:84-85,366-369`` -> ``core/dump/api_dump/api_registry.py:205-235``
    ``register_all_api``/``set_api_attr``; ``silu`` under ``functional`` in
    ``pytorch/dump/api_dump/support_wrap_ops.yaml:93``). megatron-core takes the fused path only where the
    activation it was built with ``== F.silu`` at call time (core_v0.16.1 ``megatron/core/transformer/mlp.py:195-213``,
    ``transformer/moe/shared_experts.py:196-210``), which the wrapper no longer is: ``ValueError: Only support
    fusion of gelu and swiglu``. Unfused, the MLP calls the activation it was built with (``mlp.py:214-229``): the
    same forward values (silu(gate) * up); the backward is autograd's instead of the fused ``swiglu_back``."""
    return dump is None or dump.level != "mix"


def megatron_args(
    config: AlignmentConfig,
    *,
    data_prefix: Path | str,
    tokenizer: Path | str | None,
    load_dir: Path | str | None,
    save_dir: Path | str | None = None,
    nproc: int | None = None,
    train_iters: int | None = None,
    data_cache_dir: Path | str | None = None,
    swiglu_fusion: bool = True,
) -> list[str]:
    """The ``pretrain_gpt.py`` arguments for this config (SPEC section 8), dense or MoE.

    The dataset is already tokenised, so Megatron gets a NullTokenizer sized to the padded vocab
    (its pad id is -1, like the MindFormers loader's ``pad: -1``: no token is masked on either
    side); ``tokenizer`` is checked to fit in that vocab. The parallel layout is the config's
    ``parallel.megatron`` (``nproc`` GPUs per node in place of its cards_per_node when given); the
    GPUs it leaves run data parallel.
    Without ``data_cache_dir`` Megatron writes its index cache next to the data
    (``<data_prefix_dir>/cache/GPTDataset_indices``, megatron_dataset.py), i.e. into the shared store.
    ``swiglu_fusion`` False adds ``--no-bias-swiglu-fusion`` (an msprobe dump at level mix: :func:`swiglu_fusion_under`).
    """
    m, t, layout = config.model, config.training, config.parallel.megatron
    iters = train_iters or t.train_iters
    world = (nproc or layout.cards_per_node) * layout.nodes
    if world % layout.model_parallel:
        raise BackendSetupError(f"parallel.megatron: TP {layout.tensor} x PP {layout.pipeline} x CP {layout.context} "
                                f"does not fit {world} GPUs")
    data_parallel = world // layout.model_parallel
    if t.global_batch_size % (t.micro_batch_size * data_parallel):
        raise BackendSetupError(f"training.global_batch_size {t.global_batch_size} is not a multiple of "
                                f"micro_batch_size {t.micro_batch_size} x {data_parallel} GPUs")
    if tokenizer is not None and tokenizer_size(Path(tokenizer)) > m.padded_vocab_size:
        raise BackendSetupError(f"{tokenizer}: {tokenizer_size(Path(tokenizer))} tokens do not fit "
                                f"model.padded_vocab_size {m.padded_vocab_size}")
    args = [
        "--transformer-impl", "transformer_engine",
        "--num-layers", str(m.num_layers),
        "--hidden-size", str(m.hidden_size),
        "--ffn-hidden-size", str(m.ffn_hidden_size),
        "--num-attention-heads", str(m.num_attention_heads),
        "--group-query-attention",
        "--num-query-groups", str(m.num_query_groups),
        "--kv-channels", str(m.kv_channels),
        "--seq-length", str(t.seq_length),
        "--max-position-embeddings", str(m.max_position_embeddings),
        "--normalization", "RMSNorm",
        "--norm-epsilon", _num(m.norm_epsilon),
        *(["--apply-layernorm-1p"] if m.norm_convention == "zero_centred" else []),  # gammas stored as g - 1
        "--swiglu",
        "--untie-embeddings-and-output-weights",
        "--disable-bias-linear",
        "--position-embedding-type", "rope",
        "--rotary-base", str(int(m.rotary_base)) if float(m.rotary_base).is_integer() else _num(m.rotary_base),
        "--rotary-percent", _num(m.rotary_percent),
        "--qk-layernorm",
        "--attention-output-gate",
        "--experimental-attention-variant", "gated_delta_net",
        "--linear-attention-freq", str(m.linear_attention_freq),
        "--linear-conv-kernel-dim", str(m.linear_conv_kernel_dim),
        "--linear-key-head-dim", str(m.linear_key_head_dim),
        "--linear-value-head-dim", str(m.linear_value_head_dim),
        "--linear-num-key-heads", str(m.linear_num_key_heads),
        "--linear-num-value-heads", str(m.linear_num_value_heads),
        "--init-method-std", _num(m.init_method_std),
        "--attention-dropout", _num(t.attention_dropout),
        "--hidden-dropout", _num(t.hidden_dropout),
    ]
    if m.mtp_num_layers:
        args += ["--mtp-num-layers", str(m.mtp_num_layers),
                 "--mtp-loss-scaling-factor", _num(m.mtp_loss_scaling_factor)]
    if m.is_moe:
        args += [
            "--num-experts", str(m.num_experts),
            "--moe-layer-freq", "1",
            "--moe-router-topk", str(m.moe_router_topk),
            "--moe-ffn-hidden-size", str(m.moe_ffn_hidden_size),
            "--moe-shared-expert-intermediate-size", str(m.moe_shared_expert_intermediate_size),
            "--moe-grouped-gemm",
            "--moe-token-dispatcher-type", "alltoall",
            "--moe-router-score-function", m.moe_router_score_function,
            "--moe-router-topk-scaling-factor", _num(m.moe_router_topk_scaling_factor),
            "--moe-router-dtype", m.moe_router_dtype,
            "--moe-router-load-balancing-type", "aux_loss",
            "--moe-aux-loss-coeff", _num(m.moe_aux_loss_coeff),
        ]
        if m.moe_shared_expert_gate:
            args.append("--moe-shared-expert-gate")
        if not m.norm_topk_prob:
            # Megatron renormalises the top-k probabilities unless the softmax runs over all experts first.
            args.append("--moe-router-pre-softmax")
    args += [
        "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(null_tokenizer_vocab_arg(m.padded_vocab_size, t.megatron_core_version)),
        "--make-vocab-size-divisible-by", "1",
        "--data-path", str(data_prefix),
        *(["--data-cache-path", str(data_cache_dir)] if data_cache_dir is not None else []),
        "--split", t.split,
        "--seed", str(t.seed),
        "--dataloader-type", t.dataloader_type,
        "--micro-batch-size", str(t.micro_batch_size),
        "--global-batch-size", str(t.global_batch_size),
        "--train-iters", str(iters),
        "--eval-iters", "0",
        "--eval-interval", str(iters),
        "--optimizer", "adam",
        "--lr", _num(t.lr),
        "--min-lr", _num(t.min_lr),
        "--lr-decay-style", t.lr_decay_style,
        "--lr-warmup-iters", str(t.lr_warmup_iters),
        "--lr-warmup-init", _num(t.lr_warmup_init),
        "--weight-decay", _num(t.weight_decay),
        "--adam-beta1", _num(t.adam_beta1),
        "--adam-beta2", _num(t.adam_beta2),
        "--adam-eps", _num(t.adam_eps),
        "--clip-grad", _num(t.clip_grad),
        *parallel_args(layout, m.is_moe),
        "--no-gradient-accumulation-fusion",
        "--log-interval", "1",
        "--ckpt-format", t.megatron_ckpt_format,
    ]
    if t.bf16:
        args.append("--bf16")
    if t.deterministic:
        args.append("--deterministic-mode")
    if not swiglu_fusion:
        args.append("--no-bias-swiglu-fusion")
    if load_dir is not None:
        args += ["--load", str(load_dir), "--finetune", "--no-load-optim", "--no-load-rng",
                 "--exit-on-missing-checkpoint"]
    if save_dir is not None:
        args += ["--save", str(save_dir), "--save-interval", str(iters), "--no-save-optim", "--no-save-rng"]
    return args


def sample_order(training: TrainingConfig, num_samples: int | None = None) -> SampleOrderSettings:
    """What our generated Megatron arguments say: --seed, --split, bare --data-path, --dataloader-type."""
    return SampleOrderSettings(seed=training.seed, split=training.split, seq_length=training.seq_length,
               num_samples=num_samples or training.train_samples, blend="bare",
               dataloader_type=training.dataloader_type, micro_batch_size=training.micro_batch_size)
