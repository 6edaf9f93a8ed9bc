"""MindFormers' launch YAML read back: a pynative ``TrainConfig`` as MindFormers itself will run it.

:func:`read_mindformers_yaml` interprets the YAML with MindFormers' own defaults and key aliases, never
looking at our model config (``crossalign preflight config``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from crossalign.sides.readings import (UNSET, PreflightInputError, Reading, add_layout_rows, data_path_form,
                                       data_path_shown, layer_layout, reading, split_reading)
from crossalign.data.settings import SampleOrderError, SampleOrderSettings, blend_form

MINDFORMERS_DEFAULT_SEED = 1234  # data_loader.config.seed -> GPTDatasetConfig.random_seed


def load_mindformers_yaml_file(path: Path) -> dict:
    """A MindFormers (pynative TrainConfig) YAML as a mapping."""
    if not path.exists():
        raise PreflightInputError(f"{path}: MindFormers YAML not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise PreflightInputError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise PreflightInputError(f"{path}: expected a mapping (a pynative TrainConfig)")
    return data


def mindformers_lr(step: int, *, scheduler: str, lr: float, init: float, warmup: int) -> float | None:
    """The lr MindFormers' optimizer applies at step ``step``: the schedule at global_step step-1."""
    if scheduler != "ConstantWarmUpLR":
        return None
    global_step = step - 1
    if warmup and global_step < warmup:
        return init + (lr - init) * global_step / warmup
    return lr


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
                return reading(kind(value) if kind else value, f"{where}.{key}")
        return reading(default, "default")

    r: dict[str, Reading] = {}
    steps = get(training, ["steps"], 1000, "training", int).value
    gbs = get(training, ["global_batch_size"], 1, "training", int).value
    r["seed (sample order)"] = get(dataset, ["seed"], MINDFORMERS_DEFAULT_SEED, "train_dataset.dataloader.config", int)
    tokens = dataset.get("data_path")
    tokens = [tokens] if isinstance(tokens, str) else tokens
    r["data path form"] = Reading(data_path_form(tokens), data_path_shown(data_path_form(tokens), tokens),
                                  "train_dataset.dataloader.config.data_path")
    split_text = dataset.get("split")
    r["split"] = Reading(split_reading(split_text), str(split_text) if split_text is not None else UNSET,
                         "train_dataset.dataloader.config.split")
    loader_type = loader.get("type")
    order = ("single" if not loader.get("shuffle", False) else "shuffled") \
        if loader_type == "BlendedMegatronDatasetDataLoader" else f"{loader_type} loader"
    r["sample order (loader)"] = reading(order, "train_dataset.dataloader.type/shuffle")
    sizes = loader.get("sizes")
    r["train samples"] = reading(int(sizes[0]) if sizes else None, "train_dataset.dataloader.sizes[0]")
    r["train steps"] = reading(steps, "training.steps")
    r["seq length"] = get(dataset, ["seq_length"], None, "train_dataset.dataloader.config", int)
    r["global batch size"] = reading(gbs, "training.global_batch_size")
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
    r["lr"] = reading(lr, "lr_scheduler.learning_rate")
    r["lr warmup steps"] = reading(warmup, warmup_origin)
    r["lr warmup init"] = reading(init, "lr_scheduler.warmup_lr_init")
    r["lr decay style"] = reading("constant" if scheduler == "ConstantWarmUpLR" else scheduler, "lr_scheduler.type")
    r["_lr_at"] = Reading(lambda k: mindformers_lr(k, scheduler=scheduler, lr=lr, init=init, warmup=warmup), "")
    r["optimizer"] = reading(str(optim.get("type", "AdamW")).lower(), "optimizer.type")
    betas = optim.get("betas") or [0.9, 0.95]
    r["adam beta1"] = reading(float(betas[0]), "optimizer.betas" if "betas" in optim else "default")
    r["adam beta2"] = reading(float(betas[1]), "optimizer.betas" if "betas" in optim else "default")
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
    r["norm weight form"] = reading("plain w", "MindFormers training layers")
    r["gated linear unit (SwiGLU)"] = get(model, ["gated_linear_unit"], False, "model", bool)
    freq: Any = model.get("linear_attention_freq", model.get("full_attention_interval"))
    if isinstance(model.get("layer_types"), list):
        freq = [0 if "full" in str(kind) else 1 for kind in model["layer_types"]]
    variant = model.get("experimental_attention_variant")
    gdn = variant == "gated_delta_net" or model.get("layer_types") is not None
    r["layer layout"] = reading(layer_layout(layers, freq) if gdn else (f"{layers} x attention" if layers else None),
                                 "model.linear_attention_freq")
    r["layers"] = reading(layers, "model.num_hidden_layers")
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
        r["router dtype"] = reading(names.get(str(dtype.value), dtype.value), dtype.origin)
    else:
        r["experts"] = Reading("dense", "dense", "model.num_experts")
    r["MTP layers"] = get(model, ["mtp_num_layers"], 0, "model", int)
    r["MTP loss scaling"] = get(model, ["mtp_loss_scaling_factor"], None, "model", float)
    r["bf16"] = reading(str(model.get("compute_dtype", "")).lower() in ("bfloat16", "bf16"), "model.compute_dtype")
    r["deterministic"] = get(training, ["deterministic"], False, "training", bool)
    r["_recompute"] = reading(section("recompute").get("mode", "None"), "recompute.mode")
    parallelism = section("parallelism")
    tensor = get(parallelism, ["tensor_parallel"], 1, "parallelism", int)
    sizes = {"tensor": tensor, "pipeline": get(parallelism, ["pipeline_parallel"], 1, "parallelism", int),
             "virtual pipeline layers": reading(None, "default"),
             "expert": get(parallelism, ["expert_parallel"], 1, "parallelism", int),
             "expert tensor": reading(tensor.value, "parallelism.tensor_parallel"),
             "context": get(parallelism, ["context_parallel"], 1, "parallelism", int),
             "sequence parallel": get(parallelism, ["sequence_parallel"], False, "parallelism", bool)}
    add_layout_rows(r, sizes, world_size, gbs, r["micro batch size"].value)
    return r


def sample_order_from_yaml(document: Mapping[str, Any]) -> SampleOrderSettings:
    """The settings a MindFormers YAML implies (pynative ``train_dataset.dataloader`` or graph-mode
    ``train_dataset.data_loader``), with MindFormers' defaults (dataset seed 1234)."""
    dataset = document.get("train_dataset") or {}
    key = "train_dataset.dataloader" if "dataloader" in dataset else "train_dataset.data_loader"
    loader = dataset.get("dataloader") or dataset.get("data_loader")
    if not isinstance(loader, Mapping):
        raise SampleOrderError("MindFormers YAML: train_dataset.dataloader is missing")
    if loader.get("type") != "BlendedMegatronDatasetDataLoader":
        raise SampleOrderError(f"MindFormers YAML: {key}.type {loader.get('type')!r} is not "
                               "BlendedMegatronDatasetDataLoader")
    if loader.get("shuffle"):
        raise SampleOrderError(f"MindFormers YAML: {key}.shuffle true reshuffles with MindSpore's own RNG, "
                               "which no Megatron run can reproduce; set it to false")
    config = loader.get("config") or {}
    sizes = loader.get("sizes")
    if not sizes or not isinstance(sizes[0], int):
        raise SampleOrderError(f"MindFormers YAML: {key}.sizes must start with the number of training samples")
    if config.get("split") is None:
        raise SampleOrderError(f"MindFormers YAML: {key}.config.split is required")
    if config.get("seq_length") is None:
        raise SampleOrderError(f"MindFormers YAML: {key}.config.seq_length is required")
    data_path = config.get("data_path")
    if not data_path:
        raise SampleOrderError(f"MindFormers YAML: {key}.config.data_path is required")
    if isinstance(data_path, str):
        data_path = [data_path]
    return SampleOrderSettings(seed=int(config.get("seed", MINDFORMERS_DEFAULT_SEED)), split=str(config["split"]),
               seq_length=int(config["seq_length"]), num_samples=int(sizes[0]),
               blend=blend_form([str(p) for p in data_path], f"MindFormers YAML: {key}.config.data_path"),
               dataloader_type="single")
