"""Preflight: do the two launch configurations train the same thing? Read back, side by side.

Every setting that changes the numbers is read back FROM what each framework will actually be
given, by two independent readers: :func:`read_megatron_args` interprets a ``pretrain_gpt.py``
argument list with Megatron's own defaults (megatron-core 0.16 training arguments), and
:func:`read_mindformers_yaml` interprets a pynative TrainConfig with MindFormers' defaults and
key aliases. Neither looks at our model config, so a generator bug, a hand-edited file or a
user's own script is caught the same way. Where a setting is absent the framework default is
used and shown as such: Megatron's default split 969,30,1, linear decay and dropout 0.1, and
MindFormers' norm_topk_prob False or betas (0.9, 0.95), are exactly the silent differences
this check exists for (SPEC sections 5, 6 and 9).

The learning rate is compared as applied, per step, under each side's semantics (SPEC 6):
Megatron step k uses the scheduler after k-1 increments (warmup counted in samples);
MindFormers' ConstantWarmUpLR is read at global_step k-1 before the increment.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from crossalign.backends.megatron import null_tokenizer_vocab_size
from crossalign.config import AlignmentConfig, TrainingConfig
from crossalign.data.settings import (
    MEGATRON_DEFAULT_SEED,
    MEGATRON_DEFAULT_SPLIT,
    MINDFORMERS_DEFAULT_SEED,
    SampleOrderError,
    split_vector,
)
from crossalign.launch_files import parse_megatron_args

UNSET = "(unset)"
LR_STEPS_SHOWN = 12


@dataclass(frozen=True)
class Reading:
    """One setting as one side will see it."""

    value: Any  # comparable; None when unknown
    shown: str
    origin: str = ""  # the flag or YAML key it came from, or "default"


@dataclass(frozen=True)
class PreflightRow:
    name: str
    megatron: str
    mindformers: str
    ok: bool
    note: str = ""


@dataclass
class PreflightReport:
    rows: list[PreflightRow] = field(default_factory=list)

    @property
    def mismatches(self) -> list[str]:
        return [row.name for row in self.rows if not row.ok]

    @property
    def ok(self) -> bool:
        return not self.mismatches


def _fmt(value: Any) -> str:
    if value is None:
        return UNSET
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, tuple):
        return ", ".join(_fmt(v) for v in value)
    return str(value)


def _reading(value: Any, origin: str) -> Reading:
    return Reading(value, _fmt(value), origin)


def _same(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return False
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _split(text: str | None) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        return split_vector(text)
    except SampleOrderError:
        return None


def _layout(num_layers: int | None, freq: Any) -> str | None:
    """'GGGA GGGA' from a layer count and linear_attention_freq (int N, or a per-layer list: 1 GDN, 0 attention)."""
    if num_layers is None or freq is None:
        return None
    if isinstance(freq, int):
        kinds = ["A" if (i + 1) % freq == 0 else "G" for i in range(num_layers)]
    else:
        kinds = ["G" if int(k) else "A" for k in freq]
    return " ".join("".join(kinds[i:i + 4]) for i in range(0, len(kinds), 4))


def _data_path(tokens: Sequence[str] | None) -> tuple | None:
    """('bare', name) for one prefix, ('weighted', (w, name), ...) for a weighted blend."""
    if not tokens:
        return None
    tokens = [str(t) for t in tokens]
    if len(tokens) == 1:
        return ("bare", Path(tokens[0]).name)
    pairs = []
    for weight, prefix in zip(tokens[0::2], tokens[1::2]):
        try:
            pairs.append((float(weight), Path(prefix).name))
        except ValueError:
            return ("several prefixes",) + tuple(Path(t).name for t in tokens)
    return ("weighted",) + tuple(pairs)


def _show_data_path(value: tuple | None, tokens: Sequence[str] | None) -> str:
    if value is None:
        return UNSET
    form = "bare prefix" if value[0] == "bare" else ("weighted blend" if value[0] == "weighted" else value[0])
    return f"{form}: {' '.join(map(str, tokens or []))}"


# ---- learning rate as applied -------------------------------------------------------------------


def megatron_lr(step: int, *, lr: float, min_lr: float, init: float, warmup: int, decay_iters: int,
                style: str) -> float | None:
    """The lr Megatron's optimizer step of iteration ``step`` (1-based) uses (OptimizerParamScheduler.get_lr)."""
    done = step - 1  # scheduler increments after each step; units cancel (samples = iters * gbs)
    if warmup > 0 and done <= warmup:
        return init + (lr - init) * done / warmup
    if style == "constant":
        return lr
    if done > decay_iters:
        return min_lr
    ratio = (done - warmup) / max(1, decay_iters - warmup)
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:
        return None
    return min_lr + coeff * (lr - min_lr)


def mindformers_lr(step: int, *, scheduler: str, lr: float, init: float, warmup: int) -> float | None:
    """The lr MindFormers' optimizer applies at step ``step``: the schedule at global_step step-1."""
    if scheduler != "ConstantWarmUpLR":
        return None
    global_step = step - 1
    if warmup and global_step < warmup:
        return init + (lr - init) * global_step / warmup
    return lr


# ---- reading Megatron arguments --------------------------------------------------------------------


LAYOUT = "layout: "  # rows of the parallel layout: the sides may differ, the loss must not


def _layout_rows(r: dict[str, Reading], sizes: Mapping[str, Reading], world: int | None, gbs: int | None,
                 mbs: int | None) -> None:
    """The layout readings, and whether the global batch splits into whole micro batches on every data-parallel
    rank (that one changes the numbers: a side that cannot split it does not train the same batch)."""
    r.update({LAYOUT + name: reading for name, reading in sizes.items()})
    if world is None:
        r[LAYOUT + "cards"] = Reading(None, "from the launcher", "")
        return
    r[LAYOUT + "cards"] = _reading(world, "launch")
    model_parallel = math.prod(int(sizes[name].value) for name in ("tensor", "pipeline", "context"))
    splits = bool(gbs and mbs and world % model_parallel == 0 and gbs % (mbs * (world // model_parallel)) == 0)
    shown = (f"yes ({world // model_parallel} data-parallel ranks)" if splits else
             f"no: {world} cards over TP x PP x CP = {model_parallel}, global batch {gbs}, micro batch {mbs}")
    r["global batch splits over data-parallel ranks"] = Reading(True if splits else shown, shown, "layout")


def read_megatron_args(args: Sequence[str], core_version: str, world_size: int | None = None) -> dict[str, Reading]:
    """Every number-changing setting as Megatron (core 0.16 defaults) will run it.

    ``core_version`` is the megatron-core the arguments are for: it decides how many vocab rows a
    NullTokenizer's ``--vocab-size`` gives (see :func:`null_tokenizer_vocab_size`). ``world_size``:
    the GPUs torchrun starts (--nnodes x --nproc-per-node), when known.
    """
    a = parse_megatron_args(args)

    def raw(flag: str) -> str | None:
        values = a.get(flag)
        return values[0] if values else None

    def num(flag: str, default: float | None, kind=float) -> Reading:
        value = raw(flag)
        return _reading(kind(value) if value is not None else default, flag if value is not None else "default")

    def switch(flag: str) -> Reading:
        return _reading(flag in a, flag if flag in a else "default")

    r: dict[str, Reading] = {}
    iters = num("--train-iters", None, int).value
    gbs = num("--global-batch-size", None, int).value
    r["seed (sample order)"] = num("--seed", MEGATRON_DEFAULT_SEED, int)
    tokens = a.get("--data-path")
    r["data path form"] = Reading(_data_path(tokens), _show_data_path(_data_path(tokens), tokens), "--data-path")
    split_text = raw("--split") or (MEGATRON_DEFAULT_SPLIT if tokens else None)
    r["split"] = Reading(_split(split_text), split_text or UNSET, "--split" if raw("--split") else "default")
    r["sample order (loader)"] = _reading(raw("--dataloader-type") or "single", "--dataloader-type")
    r["train samples"] = _reading(iters * gbs if iters and gbs else None, "--train-iters x --global-batch-size")
    r["train steps"] = _reading(iters, "--train-iters")
    r["seq length"] = num("--seq-length", None, int)
    r["global batch size"] = _reading(gbs, "--global-batch-size")
    r["micro batch size"] = num("--micro-batch-size", 1, int)

    lr = num("--lr", None).value
    min_lr = num("--min-lr", 0.0).value
    init = num("--lr-warmup-init", 0.0).value
    style = raw("--lr-decay-style") or "linear"
    decay_iters = num("--lr-decay-iters", iters, int).value or 0
    if raw("--lr-warmup-fraction") is not None:
        warmup = int(float(raw("--lr-warmup-fraction")) * decay_iters)  # type: ignore[arg-type]
        warmup_origin = "--lr-warmup-fraction"
    elif raw("--lr-warmup-samples") is not None and gbs:
        warmup = int(raw("--lr-warmup-samples")) // gbs  # type: ignore[arg-type]
        warmup_origin = "--lr-warmup-samples"
    else:
        warmup = num("--lr-warmup-iters", 0, int).value
        warmup_origin = "--lr-warmup-iters" if raw("--lr-warmup-iters") else "default"
    r["lr"] = _reading(lr, "--lr")
    r["lr warmup steps"] = _reading(warmup, warmup_origin)
    r["lr warmup init"] = _reading(init, "--lr-warmup-init")
    r["lr decay style"] = _reading(style, "--lr-decay-style" if raw("--lr-decay-style") else "default")
    if lr is not None:
        r["_lr_at"] = Reading(lambda k: megatron_lr(k, lr=lr, min_lr=min_lr, init=init, warmup=warmup,
                                                   decay_iters=decay_iters, style=style), "")
    r["optimizer"] = _reading("adamw" if (raw("--optimizer") or "adam") == "adam" else raw("--optimizer"), "--optimizer")
    r["adam beta1"] = num("--adam-beta1", 0.9)
    r["adam beta2"] = num("--adam-beta2", 0.999)
    r["adam eps"] = num("--adam-eps", 1e-8)
    r["weight decay"] = num("--weight-decay", 0.01)
    r["grad clip"] = num("--clip-grad", 1.0)
    r["attention dropout"] = num("--attention-dropout", 0.1)
    r["hidden dropout"] = num("--hidden-dropout", 0.1)

    layers = num("--num-layers", None, int).value
    hidden = num("--hidden-size", None, int).value
    heads = num("--num-attention-heads", None, int).value
    r["norm"] = _reading(raw("--normalization") or "LayerNorm", "--normalization")
    r["norm epsilon"] = num("--norm-epsilon", 1e-5)
    r["norm weight form"] = _reading("1+w" if "--apply-layernorm-1p" in a else "plain w", "--apply-layernorm-1p")
    r["gated linear unit (SwiGLU)"] = switch("--swiglu")
    freq_text = raw("--linear-attention-freq")
    freq: Any = None
    if freq_text is not None:
        try:
            freq = int(freq_text)
        except ValueError:
            try:
                freq = list(ast.literal_eval(freq_text))
            except (ValueError, SyntaxError):
                freq = None
    variant = raw("--experimental-attention-variant")
    r["layer layout"] = _reading(_layout(layers, freq) if variant == "gated_delta_net" else
                                 (f"{layers} x attention" if layers else None), "--linear-attention-freq")
    r["layers"] = _reading(layers, "--num-layers")
    r["hidden size"] = _reading(hidden, "--hidden-size")
    r["ffn hidden size"] = num("--ffn-hidden-size", 4 * hidden if hidden else None, int)
    r["attention heads"] = _reading(heads, "--num-attention-heads")
    groups = num("--num-query-groups", None, int).value if "--group-query-attention" in a else heads
    r["query groups"] = _reading(groups, "--num-query-groups")
    r["head dim"] = num("--kv-channels", hidden // heads if hidden and heads else None, int)
    r["GDN key head dim"] = num("--linear-key-head-dim", 128, int)
    r["GDN value head dim"] = num("--linear-value-head-dim", 128, int)
    r["GDN key heads"] = num("--linear-num-key-heads", 16, int)
    r["GDN value heads"] = num("--linear-num-value-heads", 32, int)
    r["GDN conv kernel"] = num("--linear-conv-kernel-dim", 4, int)
    vocab = num("--vocab-size", None, int).value
    tokenizer = raw("--tokenizer-type")
    if vocab is not None and tokenizer == "NullTokenizer":
        multiple = int(raw("--make-vocab-size-divisible-by") or 128) * int(raw("--tensor-model-parallel-size") or 1)
        rows = math.ceil(null_tokenizer_vocab_size(vocab, core_version) / multiple) * multiple
        r["vocab rows"] = _reading(rows, f"--vocab-size (NullTokenizer of core {core_version}, padded)")
    else:
        r["vocab rows"] = Reading(None, f"from the {tokenizer or 'default'} tokenizer", "--tokenizer-type")
    r["position embedding"] = _reading(raw("--position-embedding-type") or "learned_absolute", "--position-embedding-type")
    r["rotary base"] = num("--rotary-base", 10000.0)
    r["rotary percent"] = num("--rotary-percent", 1.0)
    r["qk layernorm"] = switch("--qk-layernorm")
    r["attention output gate"] = switch("--attention-output-gate")

    experts = num("--num-experts", None, int).value
    if experts:
        r["experts"] = _reading(experts, "--num-experts")
        r["router topk"] = num("--moe-router-topk", 2, int)
        r["expert ffn size"] = num("--moe-ffn-hidden-size", None, int)
        r["shared expert ffn size"] = num("--moe-shared-expert-intermediate-size", None, int)
        r["norm_topk_prob"] = Reading("--moe-router-pre-softmax" not in a,
                                      "no (--moe-router-pre-softmax)" if "--moe-router-pre-softmax" in a
                                      else "yes (top-k softmax)", "--moe-router-pre-softmax")
        r["shared-expert gate"] = switch("--moe-shared-expert-gate")
        r["aux loss coeff"] = num("--moe-aux-loss-coeff", 0.0)
        r["load balancing type"] = _reading(raw("--moe-router-load-balancing-type") or "aux_loss",
                                            "--moe-router-load-balancing-type")
        r["router score function"] = _reading(raw("--moe-router-score-function") or "softmax",
                                              "--moe-router-score-function")
        r["router topk scaling"] = num("--moe-router-topk-scaling-factor", 1.0)
        r["router dtype"] = _reading(raw("--moe-router-dtype") or ("bf16" if "--bf16" in a else "fp32"),
                                     "--moe-router-dtype")
    else:
        r["experts"] = Reading("dense", "dense", "--num-experts")
    r["MTP layers"] = num("--mtp-num-layers", 0, int)
    r["MTP loss scaling"] = num("--mtp-loss-scaling-factor", 0.1)
    r["bf16"] = switch("--bf16")
    r["deterministic"] = switch("--deterministic-mode")
    tensor = num("--tensor-model-parallel-size", 1, int)
    sizes = {"tensor": tensor, "pipeline": num("--pipeline-model-parallel-size", 1, int),
             "virtual pipeline layers": num("--num-layers-per-virtual-pipeline-stage", None, int),
             "expert": num("--expert-model-parallel-size", 1, int),
             # core_v0.16.1 megatron/training/arguments.py:410: unset means the tensor size
             "expert tensor": num("--expert-tensor-parallel-size", tensor.value, int),
             "context": num("--context-parallel-size", 1, int), "sequence parallel": switch("--sequence-parallel")}
    _layout_rows(r, sizes, world_size, gbs, r["micro batch size"].value)
    return r


# ---- reading MindFormers YAML --------------------------------------------------------------------------


def read_mindformers_yaml(data: Mapping[str, Any], world_size: int | None = None) -> dict[str, Reading]:
    """Every number-changing setting as MindFormers pynative will run it (TrainConfig defaults, key aliases).

    A ``model`` key counts only where MindFormers' ConfigConverter reads it: a ``TransformerConfig``
    field of that name, or a key the Qwen3/Qwen3-MoE converters map (``num_hidden_layers``,
    ``rms_norm_eps``, ``rope_theta``, ``num_experts``, ...); other spellings (``scoring_func``,
    ``rotary_percent``, ``router_aux_loss_coef``) are dropped by MindFormers and so read as absent
    here (mindformers/parallel_core/config_converter.py, models/qwen3*/config_converter_qwen3*.py,
    r1.9.0..master). Unset fields take TransformerConfig's defaults (LayerNorm, no GLU, ...).
    """

    def section(*path: str) -> Mapping[str, Any]:
        node: Any = data
        for key in path:
            node = node.get(key) if isinstance(node, Mapping) else None
        return node if isinstance(node, Mapping) else {}

    training = section("training")
    loader = section("train_dataset", "dataloader")
    dataset = section("train_dataset", "dataloader", "config")
    sched = section("lr_scheduler")
    optim = section("optimizer")
    model = section("model")

    def get(node: Mapping[str, Any], keys: Sequence[str], default: Any, where: str, kind=None) -> Reading:
        for key in keys:
            if key in node and node[key] is not None:
                value = node[key]
                return _reading(kind(value) if kind else value, f"{where}.{key}")
        return _reading(default, "default")

    r: dict[str, Reading] = {}
    steps = get(training, ["steps"], 1000, "training", int).value
    gbs = get(training, ["global_batch_size"], 1, "training", int).value
    r["seed (sample order)"] = get(dataset, ["seed"], MINDFORMERS_DEFAULT_SEED, "train_dataset.dataloader.config", int)
    tokens = dataset.get("data_path")
    tokens = [tokens] if isinstance(tokens, str) else tokens
    r["data path form"] = Reading(_data_path(tokens), _show_data_path(_data_path(tokens), tokens),
                                  "train_dataset.dataloader.config.data_path")
    split_text = dataset.get("split")
    r["split"] = Reading(_split(split_text), str(split_text) if split_text is not None else UNSET,
                         "train_dataset.dataloader.config.split")
    loader_type = loader.get("type")
    order = ("single" if not loader.get("shuffle", False) else "shuffled") \
        if loader_type == "BlendedMegatronDatasetDataLoader" else f"{loader_type} loader"
    r["sample order (loader)"] = _reading(order, "train_dataset.dataloader.type/shuffle")
    sizes = loader.get("sizes")
    r["train samples"] = _reading(int(sizes[0]) if sizes else None, "train_dataset.dataloader.sizes[0]")
    r["train steps"] = _reading(steps, "training.steps")
    r["seq length"] = get(dataset, ["seq_length"], None, "train_dataset.dataloader.config", int)
    r["global batch size"] = _reading(gbs, "training.global_batch_size")
    r["micro batch size"] = get(training, ["local_batch_size"], 1, "training", int)

    scheduler = sched.get("type") or UNSET
    lr = get(sched, ["learning_rate"], 1e-5, "lr_scheduler", float).value
    init = get(sched, ["warmup_lr_init"], 0.0, "lr_scheduler", float).value
    if sched.get("warmup_ratio") is not None:
        total = int(sched.get("total_steps") or steps)
        warmup = int(total * float(sched["warmup_ratio"]))
        warmup_origin = "lr_scheduler.warmup_ratio"
    else:
        warmup = int(sched.get("warmup_steps") or 0)
        warmup_origin = "lr_scheduler.warmup_steps"
    r["lr"] = _reading(lr, "lr_scheduler.learning_rate")
    r["lr warmup steps"] = _reading(warmup, warmup_origin)
    r["lr warmup init"] = _reading(init, "lr_scheduler.warmup_lr_init")
    r["lr decay style"] = _reading("constant" if scheduler == "ConstantWarmUpLR" else scheduler, "lr_scheduler.type")
    r["_lr_at"] = Reading(lambda k: mindformers_lr(k, scheduler=scheduler, lr=lr, init=init, warmup=warmup), "")
    r["optimizer"] = _reading(str(optim.get("type", "AdamW")).lower(), "optimizer.type")
    betas = optim.get("betas") or [0.9, 0.95]
    r["adam beta1"] = _reading(float(betas[0]), "optimizer.betas" if "betas" in optim else "default")
    r["adam beta2"] = _reading(float(betas[1]), "optimizer.betas" if "betas" in optim else "default")
    r["adam eps"] = get(optim, ["eps"], 1e-8, "optimizer", float)
    r["weight decay"] = get(optim, ["weight_decay"], 0.01, "optimizer", float)
    r["grad clip"] = get(training, ["max_norm"], 1.0, "training", float)
    r["attention dropout"] = get(model, ["attention_dropout"], None, "model", float)
    r["hidden dropout"] = get(model, ["hidden_dropout"], None, "model", float)

    layers = get(model, ["num_hidden_layers", "num_layers"], None, "model", int).value
    hidden = get(model, ["hidden_size"], None, "model", int)
    heads = get(model, ["num_attention_heads"], None, "model", int)
    r["norm"] = get(model, ["normalization"], "LayerNorm", "model")
    r["norm epsilon"] = get(model, ["rms_norm_eps", "layernorm_epsilon"], 1e-5, "model", float)
    r["norm weight form"] = _reading("plain w", "MindFormers training layers")
    r["gated linear unit (SwiGLU)"] = get(model, ["gated_linear_unit"], False, "model", bool)
    freq: Any = model.get("linear_attention_freq", model.get("full_attention_interval"))
    if isinstance(model.get("layer_types"), list):
        freq = [0 if "full" in str(kind) else 1 for kind in model["layer_types"]]
    variant = model.get("experimental_attention_variant")
    gdn = variant == "gated_delta_net" or model.get("layer_types") is not None
    r["layer layout"] = _reading(_layout(layers, freq) if gdn else (f"{layers} x attention" if layers else None),
                                 "model.linear_attention_freq")
    r["layers"] = _reading(layers, "model.num_hidden_layers")
    r["hidden size"] = hidden
    r["ffn hidden size"] = get(model, ["intermediate_size", "ffn_hidden_size"], None, "model", int)
    r["attention heads"] = heads
    r["query groups"] = get(model, ["num_key_value_heads", "num_query_groups"], heads.value, "model", int)
    r["head dim"] = get(model, ["head_dim", "kv_channels"], None, "model", int)
    r["GDN key head dim"] = get(model, ["linear_key_head_dim"], 128, "model", int)
    r["GDN value head dim"] = get(model, ["linear_value_head_dim"], 128, "model", int)
    r["GDN key heads"] = get(model, ["linear_num_key_heads"], 16, "model", int)
    r["GDN value heads"] = get(model, ["linear_num_value_heads"], 32, "model", int)
    r["GDN conv kernel"] = get(model, ["linear_conv_kernel_dim"], 4, "model", int)
    r["vocab rows"] = get(model, ["vocab_size"], None, "model", int)
    r["position embedding"] = get(model, ["position_embedding_type"], "rope", "model")
    r["rotary base"] = get(model, ["rope_theta", "rotary_base"], 10000.0, "model", float)
    r["rotary percent"] = get(model, ["partial_rotary_factor"], 1.0, "model", float)
    r["qk layernorm"] = get(model, ["qk_layernorm"], False, "model", bool)
    r["attention output gate"] = get(model, ["attention_output_gate"], None, "model", bool)

    experts = get(model, ["num_experts", "num_moe_experts"], None, "model", int)
    if experts.value:
        r["experts"] = experts
        r["router topk"] = get(model, ["num_experts_per_tok", "moe_router_topk"], None, "model", int)
        r["expert ffn size"] = get(model, ["moe_intermediate_size", "moe_ffn_hidden_size"], None, "model", int)
        r["shared expert ffn size"] = get(model, ["moe_shared_expert_intermediate_size"], None, "model", int)
        topk_norm = get(model, ["norm_topk_prob"], False, "model", bool)
        r["norm_topk_prob"] = Reading(topk_norm.value, topk_norm.shown, topk_norm.origin)
        r["shared-expert gate"] = get(model, ["use_shared_expert_gating"], False, "model", bool)
        r["aux loss coeff"] = get(model, ["moe_aux_loss_coeff"], 0.0, "model", float)
        r["load balancing type"] = get(model, ["moe_router_load_balancing_type"], None, "model")
        r["router score function"] = get(model, ["moe_router_score_function"], "softmax", "model")
        r["router topk scaling"] = get(model, ["moe_router_topk_scaling_factor", "routed_scaling_factor"], 1.0,
                                       "model", float)
        dtype = get(model, ["moe_router_dtype", "router_dense_type"], None, "model")
        names = {"float32": "fp32", "fp32": "fp32", "float64": "fp64", "bfloat16": "bf16"}
        r["router dtype"] = _reading(names.get(str(dtype.value), dtype.value), dtype.origin)
    else:
        r["experts"] = Reading("dense", "dense", "model.num_experts")
    r["MTP layers"] = get(model, ["mtp_num_layers"], 0, "model", int)
    r["MTP loss scaling"] = get(model, ["mtp_loss_scaling_factor"], None, "model", float)
    r["bf16"] = _reading(str(model.get("compute_dtype", "")).lower() in ("bfloat16", "bf16"), "model.compute_dtype")
    r["deterministic"] = get(training, ["deterministic"], False, "training", bool)
    r["_recompute"] = _reading(section("recompute").get("mode", "None"), "recompute.mode")
    parallelism = section("parallelism")
    tensor = get(parallelism, ["tensor_parallel"], 1, "parallelism", int)
    sizes = {"tensor": tensor, "pipeline": get(parallelism, ["pipeline_parallel"], 1, "parallelism", int),
             "virtual pipeline layers": _reading(None, "default"),
             "expert": get(parallelism, ["expert_parallel"], 1, "parallelism", int),
             "expert tensor": _reading(tensor.value, "parallelism.tensor_parallel"),
             "context": get(parallelism, ["context_parallel"], 1, "parallelism", int),
             "sequence parallel": get(parallelism, ["sequence_parallel"], False, "parallelism", bool)}
    _layout_rows(r, sizes, world_size, gbs, r["micro batch size"].value)
    return r


# ---- side by side ------------------------------------------------------------------------------------


def compare_readings(megatron: Mapping[str, Reading], mindformers: Mapping[str, Reading]) -> PreflightReport:
    report = PreflightReport()
    names = [n for n in megatron if not n.startswith("_")]
    names += [n for n in mindformers if not n.startswith("_") and n not in megatron]
    for name in names:
        mg = megatron.get(name, Reading(None, "-"))
        mf = mindformers.get(name, Reading(None, "-"))
        if name == "vocab rows" and mg.value is None and mg.shown != UNSET:
            report.rows.append(PreflightRow(name, mg.shown, mf.shown, True, "not checked: a real tokenizer"))
            continue
        if name.startswith(LAYOUT):
            same = mg.value == mf.value or _same(mg.value, mf.value)
            report.rows.append(PreflightRow(name, mg.shown, mf.shown, True, "" if same else
                                            "the sides' layouts differ: expected, the loss must not depend on it"))
            continue
        note = " / ".join(o for o in (mg.origin, mf.origin) if o == "default")
        report.rows.append(PreflightRow(name, mg.shown, mf.shown, _same(mg.value, mf.value),
                                        "framework default used" if note else ""))
    mg_lr, mf_lr = megatron.get("_lr_at"), mindformers.get("_lr_at")
    if mg_lr is not None and mf_lr is not None:
        warmups = [r.value for r in (megatron.get("lr warmup steps"), mindformers.get("lr warmup steps"))
                   if r is not None and isinstance(r.value, int)]
        steps = [r.value for r in (megatron.get("train steps"), mindformers.get("train steps"))
                 if r is not None and isinstance(r.value, int)]
        last = min(max(warmups + [1]) + 2, LR_STEPS_SHOWN, *(steps or [LR_STEPS_SHOWN]))
        for k in range(1, last + 1):
            a, b = mg_lr.value(k), mf_lr.value(k)
            report.rows.append(PreflightRow(f"lr applied at step {k}", _fmt(a), _fmt(b), _same(a, b)))
    mtp = mindformers.get("MTP layers")
    recompute = mindformers.get("_recompute")
    if recompute is not None and mtp is not None and mtp.value:
        report.rows.append(PreflightRow("recompute mode (MTP)", "-", recompute.shown, recompute.value == "None",
                                        'MindFormers needs the string "None" with MTP'))
    return report


def preflight_config(config: AlignmentConfig | None = None, megatron_args: Sequence[str] | None = None,
                     mindformers_yaml: Mapping[str, Any] | None = None) -> PreflightReport:
    """Read both launch configurations back and compare them; each defaults to the one generated from config."""
    if megatron_args is None or mindformers_yaml is None:
        if config is None:
            raise ValueError("preflight_config needs a config, or both megatron_args and mindformers_yaml")
        from crossalign.backends.megatron import megatron_args as make_args
        from crossalign.backends.mindformers import mindformers_yaml as make_yaml

        prefix = Path("DATA") / "corpus_text_document"
        if megatron_args is None:
            megatron_args = make_args(config, data_prefix=prefix, tokenizer=None, load_dir=Path("MEGATRON_CHECKPOINT"))
        if mindformers_yaml is None:
            mindformers_yaml = make_yaml(config, mode="align", data_prefix=prefix,
                                         load_dir=Path("MINDFORMERS_CHECKPOINT"))
    core_version = (config.training.megatron_core_version if config is not None
                    else TrainingConfig.model_fields["megatron_core_version"].default)
    worlds = ((config.parallel.megatron.world_size, config.parallel.mindformers.world_size) if config is not None
              else (None, None))
    report = compare_readings(read_megatron_args(megatron_args, core_version, worlds[0]),
                              read_mindformers_yaml(mindformers_yaml, worlds[1]))
    if config is not None and config.model.norm_convention == "zero_centred":
        # MindFormers has no 1+w norm: the converter stores w = g - 1 for Megatron, so the forms differ by design.
        report.rows = [replace(row, ok=True, note="expected: model.norm_convention zero_centred "
                               "(the converter shifts each gamma by 1)")
                       if row.name == "norm weight form" and row.megatron == "1+w" else row for row in report.rows]
    return report
