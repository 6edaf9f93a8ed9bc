"""Megatron's launch arguments read back: a ``pretrain_gpt.py`` argument list as Megatron itself will run it.

:func:`read_megatron_args` interprets an argument list with Megatron's own defaults (megatron-core 0.16
training arguments), never looking at our model config, so a generator bug, a hand-edited file or a user's
own script is caught the same way (``crossalign preflight config``).
"""

from __future__ import annotations

import ast
import math
import shlex
from pathlib import Path
from typing import Any, Sequence

from crossalign.sides.readings import (UNSET, PreflightInputError, Reading, add_layout_rows, data_path_form,
                                       data_path_shown, layer_layout, reading, split_reading)
from crossalign.data.settings import BLEND_SURPLUS, SampleOrderError, SampleOrderSettings, blend_form
from crossalign.sides.megatron.args import null_tokenizer_vocab_size

MEGATRON_DEFAULT_SEED = 1234
MEGATRON_DEFAULT_SPLIT = "969, 30, 1"  # legacy_default_split_value, used when --data-path has no --split


def parse_megatron_args(args: Sequence[str]) -> dict[str, list[str]]:
    """``--flag [values...]`` -> {flag: values} (empty list for a switch; the last occurrence wins)."""
    parsed: dict[str, list[str]] = {}
    current: str | None = None
    for token in args:
        if token.startswith("--"):
            flag, _, inline = token.partition("=")
            current = flag
            parsed[flag] = [inline] if inline else []
        elif current is not None:
            parsed[current].append(token)
    return parsed


def load_megatron_args_file(path: Path) -> list[str]:
    """Arguments from a file: one per line, or a shell command line (the part after the ``*.py`` script)."""
    if not path.exists():
        raise PreflightInputError(f"{path}: Megatron arguments file not found")
    text = path.read_text().replace("\\\n", " ")
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError as exc:
        raise PreflightInputError(f"{path}: cannot split into arguments ({exc})") from None
    scripts = [i for i, tok in enumerate(tokens) if tok.endswith(".py")]
    if scripts:
        tokens = tokens[scripts[-1] + 1:]
    if not any(tok.startswith("--") for tok in tokens):
        raise PreflightInputError(f"{path}: no --arguments found")
    return tokens


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
        return reading(kind(value) if value is not None else default, flag if value is not None else "default")

    def switch(flag: str) -> Reading:
        return reading(flag in a, flag if flag in a else "default")

    r: dict[str, Reading] = {}
    iters = num("--train-iters", None, int).value
    gbs = num("--global-batch-size", None, int).value
    r["seed (sample order)"] = num("--seed", MEGATRON_DEFAULT_SEED, int)
    tokens = a.get("--data-path")
    r["data path form"] = Reading(data_path_form(tokens), data_path_shown(data_path_form(tokens), tokens), "--data-path")
    split_text = raw("--split") or (MEGATRON_DEFAULT_SPLIT if tokens else None)
    r["split"] = Reading(split_reading(split_text), split_text or UNSET, "--split" if raw("--split") else "default")
    r["sample order (loader)"] = reading(raw("--dataloader-type") or "single", "--dataloader-type")
    r["train samples"] = reading(iters * gbs if iters and gbs else None, "--train-iters x --global-batch-size")
    r["train steps"] = reading(iters, "--train-iters")
    r["seq length"] = num("--seq-length", None, int)
    r["global batch size"] = reading(gbs, "--global-batch-size")
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
    r["lr"] = reading(lr, "--lr")
    r["lr warmup steps"] = reading(warmup, warmup_origin)
    r["lr warmup init"] = reading(init, "--lr-warmup-init")
    r["lr decay style"] = reading(style, "--lr-decay-style" if raw("--lr-decay-style") else "default")
    if lr is not None:
        r["_lr_at"] = Reading(lambda k: megatron_lr(k, lr=lr, min_lr=min_lr, init=init, warmup=warmup,
                                                   decay_iters=decay_iters, style=style), "")
    r["optimizer"] = reading("adamw" if (raw("--optimizer") or "adam") == "adam" else raw("--optimizer"), "--optimizer")
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
    r["norm"] = reading(raw("--normalization") or "LayerNorm", "--normalization")
    r["norm epsilon"] = num("--norm-epsilon", 1e-5)
    r["norm weight form"] = reading("1+w" if "--apply-layernorm-1p" in a else "plain w", "--apply-layernorm-1p")
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
    r["layer layout"] = reading(layer_layout(layers, freq) if variant == "gated_delta_net" else
                                 (f"{layers} x attention" if layers else None), "--linear-attention-freq")
    r["layers"] = reading(layers, "--num-layers")
    r["hidden size"] = reading(hidden, "--hidden-size")
    r["ffn hidden size"] = num("--ffn-hidden-size", 4 * hidden if hidden else None, int)
    r["attention heads"] = reading(heads, "--num-attention-heads")
    groups = num("--num-query-groups", None, int).value if "--group-query-attention" in a else heads
    r["query groups"] = reading(groups, "--num-query-groups")
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
        r["vocab rows"] = reading(rows, f"--vocab-size (NullTokenizer of core {core_version}, padded)")
    else:
        r["vocab rows"] = Reading(None, f"from the {tokenizer or 'default'} tokenizer", "--tokenizer-type")
    r["position embedding"] = reading(raw("--position-embedding-type") or "learned_absolute", "--position-embedding-type")
    r["rotary base"] = num("--rotary-base", 10000.0)
    r["rotary percent"] = num("--rotary-percent", 1.0)
    r["qk layernorm"] = switch("--qk-layernorm")
    r["attention output gate"] = switch("--attention-output-gate")

    experts = num("--num-experts", None, int).value
    if experts:
        r["experts"] = reading(experts, "--num-experts")
        r["router topk"] = num("--moe-router-topk", 2, int)
        r["expert ffn size"] = num("--moe-ffn-hidden-size", None, int)
        r["shared expert ffn size"] = num("--moe-shared-expert-intermediate-size", None, int)
        r["norm_topk_prob"] = Reading("--moe-router-pre-softmax" not in a,
                                      "no (--moe-router-pre-softmax)" if "--moe-router-pre-softmax" in a
                                      else "yes (top-k softmax)", "--moe-router-pre-softmax")
        r["shared-expert gate"] = switch("--moe-shared-expert-gate")
        r["aux loss coeff"] = num("--moe-aux-loss-coeff", 0.0)
        r["load balancing type"] = reading(raw("--moe-router-load-balancing-type") or "aux_loss",
                                            "--moe-router-load-balancing-type")
        r["router score function"] = reading(raw("--moe-router-score-function") or "softmax",
                                              "--moe-router-score-function")
        r["router topk scaling"] = num("--moe-router-topk-scaling-factor", 1.0)
        r["router dtype"] = reading(raw("--moe-router-dtype") or ("bf16" if "--bf16" in a else "fp32"),
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
    add_layout_rows(r, sizes, world_size, gbs, r["micro batch size"].value)
    return r


def sample_order_from_args(args: Sequence[str], data_parallel_size: int = 1) -> SampleOrderSettings:
    """The settings a Megatron-LM ``pretrain_gpt.py`` argument list implies, with Megatron's defaults."""
    parsed = parse_megatron_args(args)

    def value(flag: str, kind, default=None):
        values = parsed.get(flag)
        if not values:
            return default
        try:
            return kind(values[0])
        except ValueError:
            raise SampleOrderError(f"Megatron arguments: {flag} {values[0]!r} is not "
                                   f"{'an integer' if kind is int else 'a number'}") from None

    def missing(flag: str) -> SampleOrderError:
        return SampleOrderError(f"Megatron arguments: {flag} is required to derive the sample order")

    data_path = parsed.get("--data-path")
    seq_length = value("--seq-length", int)
    train_samples, train_iters = value("--train-samples", int), value("--train-iters", int)
    global_batch_size = value("--global-batch-size", int)
    if not data_path:
        raise missing("--data-path")
    if seq_length is None:
        raise missing("--seq-length")
    if train_samples is not None:
        num_samples = train_samples
    elif train_iters is not None and global_batch_size is not None:
        num_samples = train_iters * global_batch_size
    else:
        raise missing("--train-iters with --global-batch-size (or --train-samples)")
    loader = value("--dataloader-type", str, "single")
    if loader not in ("single", "cyclic"):
        raise SampleOrderError(f"Megatron arguments: --dataloader-type {loader} has no modelled sample order")
    if loader == "cyclic" and "--no-data-sharding" in parsed and data_parallel_size > 1:
        raise SampleOrderError("Megatron arguments: --no-data-sharding with several data-parallel ranks "
                               "is not modelled")
    split = value("--split", str)
    return SampleOrderSettings(seed=value("--seed", int, MEGATRON_DEFAULT_SEED),
               split=split if split is not None else MEGATRON_DEFAULT_SPLIT,
               seq_length=seq_length, num_samples=num_samples,
               blend=blend_form(data_path, "Megatron arguments: --data-path"),
               dataloader_type=loader, micro_batch_size=value("--micro-batch-size", int, 1),
               data_parallel_size=data_parallel_size,
               surplus=value("--mid-level-dataset-surplus", float, BLEND_SURPLUS))
