"""The real NPU side: MindFormers in pynative mode (``run_mindformer.py --mode 1``).

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
(:func:`verify_transformer_config`). A fork that needs other keys gets them through
``request.extra["mindformers_model"]``, merged over the generated section.

What the step checks does not rest on MindFormers' load messages: ``load_checkpoint`` loads only the
network's own names and never reports a checkpoint tensor the network lacks (2.1.0
``checkpoint/checkpoint.py: load_checkpoint``, its ``filter_func``), so a network built without its
shared experts would load "completely" and drop their weights. The converted-config readback
(``shared_expert_num`` included) and the built-model line (:func:`verify_built_model`) say the network
is the one the config describes; "Network parameters not loaded" still fails the run. And with the
mindformers-load-digest patch the trainer records every parameter it holds right after the load, before
the first step (``CROSSALIGN_LOAD_DIGEST_DIR``, one file per rank), which the align run holds against the
checkpoint it gave (:func:`verify_load_digest`): a missing, extra, renamed or different tensor fails the
step, named. Releases before
2.0.0 are refused (``training.mindformers_version``): r1.9.0's TrainConfig rejects the generated
parallelism and recompute keys and its LossCallback logs neither the MTP nor the aux loss.

The log: LossCallback lines go to stdout (captured line by line into ``train.log``) and to
``<LOG_MF_PATH>/rank_<r>/info.log``; the run script points LOG_MF_PATH into the step folder.
With several cards msrun tails the last worker's log to stdout.
"""

from __future__ import annotations

import ast
import math
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import yaml

from crossalign.backends.base import TrainRequest, TrainResult
from crossalign.backends.launch import (
    BackendRunError,
    BackendSetupError,
    FrameworkBackend,
    RunScript,
    failure_summary,
    missing_steps,
    progress_callback,
    write_run_script,
)
from crossalign.config import AlignmentConfig
from crossalign.logs.common import LogFormatError, read_log_text, step_ranges
from crossalign.logs.formats import mindformers_scales_mtp_loss
from crossalign.logs.mindformers import parse_mindformers_text

if TYPE_CHECKING:
    import pandas as pd

RUN_SCRIPT = "run_mindformers.sh"
CHECKPOINT_PREFIX = "qwen35"
DETERMINISTIC_ENV = {"HCCL_DETERMINISTIC": "true", "ASCEND_LAUNCH_BLOCKING": "1"}
MSRUN_PORT = 8118
LOAD_DIGEST_DIR = "load_digest"  # what each rank's network held after the load (CROSSALIGN_LOAD_DIGEST_DIR)
LOAD_DIGEST_ENV = "CROSSALIGN_LOAD_DIGEST_DIR"
LOAD_DIGEST_PATCH = "mindformers-load-digest"
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
    m, t, layout = config.model, config.training, config.parallel.mindformers
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


# ---- what MindFormers built from the YAML ------------------------------------------------------

CONVERTED_CONFIG_MARK = "The final converted TransformerConfig is: {"
_CONVERTED_ENTRY = re.compile(r"^\s*'(\w+)': (.*?),?\s*$")


def expected_transformer_config(config: AlignmentConfig) -> dict[str, object]:
    """The number-changing ``TransformerConfig`` fields MindFormers must build for this model config."""
    m, t = config.model, config.training
    expected: dict[str, object] = {
        "num_layers": m.num_layers, "hidden_size": m.hidden_size, "num_attention_heads": m.num_attention_heads,
        "num_query_groups": m.num_query_groups, "kv_channels": m.kv_channels, "ffn_hidden_size": m.ffn_hidden_size,
        "vocab_size": m.padded_vocab_size, "seq_length": t.seq_length,
        "normalization": "RMSNorm", "layernorm_epsilon": m.norm_epsilon, "gated_linear_unit": True,
        "hidden_act": "silu",
        "add_bias_linear": False, "tie_word_embeddings": False,
        "position_embedding_type": "rope", "rotary_base": m.rotary_base, "partial_rotary_factor": m.rotary_percent,
        "qk_layernorm": True, "attention_output_gate": True,
        "experimental_attention_variant": "gated_delta_net", "linear_attention_freq": m.linear_attention_freq,
        "linear_conv_kernel_dim": m.linear_conv_kernel_dim, "linear_key_head_dim": m.linear_key_head_dim,
        "linear_value_head_dim": m.linear_value_head_dim, "linear_num_key_heads": m.linear_num_key_heads,
        "linear_num_value_heads": m.linear_num_value_heads,
        "attention_dropout": t.attention_dropout, "hidden_dropout": t.hidden_dropout,
        "params_dtype": "float32", "compute_dtype": "bfloat16" if t.bf16 else "float32",
        "use_interleaved_weight_layout_mlp": True,
        "mtp_num_layers": m.mtp_num_layers,
        "num_moe_experts": m.num_experts if m.is_moe else None,
    }
    if m.mtp_num_layers:
        expected["mtp_loss_scaling_factor"] = m.mtp_loss_scaling_factor
    if m.is_moe:
        expected.update({
            "moe_router_topk": m.moe_router_topk, "moe_ffn_hidden_size": m.moe_ffn_hidden_size,
            "shared_expert_num": shared_expert_num(config),
            "moe_shared_expert_intermediate_size": m.moe_shared_expert_intermediate_size,
            "use_shared_expert_gating": m.moe_shared_expert_gate, "norm_topk_prob": m.norm_topk_prob,
            "moe_router_score_function": m.moe_router_score_function,
            "moe_router_topk_scaling_factor": m.moe_router_topk_scaling_factor,
            "moe_router_dtype": ROUTER_DTYPE_NAMES[m.moe_router_dtype],
            "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": m.moe_aux_loss_coeff,
        })
    return expected


def _converted_value(text: str) -> object:
    """A value as the converter printed it (``repr``): a literal, or ``mindspore.bfloat16`` -> ``"bfloat16"``."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text.removeprefix("mindspore.")


def read_transformer_config(log_path: Path) -> tuple[int, dict[str, object]] | None:
    """(line, fields) of the last "The final converted TransformerConfig is:" block of the log, None if it has none.

    ConfigConverter.convert prints ``{`` + one ``  'name': repr(value)`` line per field + ``}``
    (config_converter.py:108-112 in r1.9.0, r2.0.0 and master).
    """
    found: tuple[int, dict[str, object]] | None = None
    current: dict[str, object] | None = None
    with open(log_path, encoding="utf-8", errors="replace") as log:
        for number, line in enumerate(log, start=1):
            if line.rstrip().endswith(CONVERTED_CONFIG_MARK):
                current = {}
                found = (number, current)
            elif current is not None:
                entry = _CONVERTED_ENTRY.match(line)
                if entry:
                    current[entry.group(1)] = _converted_value(entry.group(2))
                else:
                    current = None
    return found


def _agrees(actual: object, wanted: object) -> bool:
    if isinstance(wanted, bool) or isinstance(actual, bool) or wanted is None or isinstance(wanted, str):
        return actual == wanted
    return isinstance(actual, (int, float)) and math.isclose(actual, wanted, rel_tol=1e-9)  # type: ignore[arg-type]


def verify_transformer_config(log_path: Path, config: AlignmentConfig) -> None:
    """Raise BackendRunError, naming each setting, unless MindFormers built the model the config describes.

    MindFormers drops a YAML key its converter does not map with only a warning, so a run can
    train another model than the one asked for; what it really built is the converter's block.
    """
    block = read_transformer_config(log_path)
    if block is None:
        raise BackendRunError(f"{log_path}: no '{CONVERTED_CONFIG_MARK[:-2]}' block: cannot check which model "
                              "MindFormers built from the YAML (its ConfigConverter logs it when it builds the model)")
    line, built = block
    missing = [name for name in expected_transformer_config(config) if name not in built]
    different = [f"{name} {built[name]!r} (expected {wanted!r})" for name, wanted in
                 expected_transformer_config(config).items() if name in built and not _agrees(built[name], wanted)]
    if missing or different:
        problems = "; ".join(filter(None, [
            f"missing (this MindFormers' TransformerConfig has no such field, so the YAML key was dropped): "
            f"{', '.join(missing)}" if missing else "",
            f"different: {', '.join(different)}" if different else ""]))
        raise BackendRunError(f"{log_path}:{line}: MindFormers built another model than the config describes: "
                              f"{problems}")


BUILT_MODEL_LINE = re.compile(r"crossalign built model: rotary_percent (\S+)")


def verify_built_model(log_path: Path, config: AlignmentConfig) -> None:
    """Raise BackendRunError unless the built GPTModel uses the config's rope fraction.

    The converted config's partial_rotary_factor does not reach the model: pynative GPTModel takes its
    rope fraction from its constructor argument rotary_percent (default 1.0; 2.1.0 gpt_model.py:106,213),
    so a model class that passes nothing trains full rope while the readback passes. The
    mindformers-qwen35-loss-logging patch logs the value the built model holds.
    """
    found = None
    with open(log_path, encoding="utf-8", errors="replace") as log:
        for number, line in enumerate(log, start=1):
            if match := BUILT_MODEL_LINE.search(line):
                found = number, _converted_value(match.group(1))
    if found is None:
        raise BackendRunError(f"{log_path}: no 'crossalign built model' line: cannot check the rope fraction the "
                              "model uses (GPTModel takes rotary_percent from its constructor, not from "
                              "partial_rotary_factor); apply the mindformers-qwen35-loss-logging patch, which logs it")
    number, used = found
    if not _agrees(used, config.model.rotary_percent):
        raise BackendRunError(f"{log_path}:{number}: the built GPTModel uses rotary_percent {used!r}, the config "
                              f"{config.model.rotary_percent!r}: the fork's Qwen3.5 class must pass "
                              "rotary_percent=config.partial_rotary_factor to GPTModel (its default is 1.0)")


# ---- the log ---------------------------------------------------------------------------------

STEP_LINE = re.compile(r"\{\s*step:\[\s*(\d+)\s*/\s*(\d+)\s*\]")
_LISTED_NAME = re.compile(r"\s- (\S+)\s*$")
PYNATIVE = "mindformers-pynative"
METRICS = ("lm_loss", "aux_loss", "lr", "grad_norm", "step_time_ms")


def parse_step_line(line: str) -> tuple[int, int, dict[str, float]] | None:
    """(step, total, metrics) of a pynative LossCallback line, for progress; None for other lines.

    The line is read by the log parser (``crossalign.logs.mindformers``), so progress, the log
    check and the comparison accept the same lines: master's with ``consumed_samples``, and the
    release branches' (r1.9.0, r2.0.0) without.
    """
    match = STEP_LINE.search(line)
    if not match:
        return None
    try:
        frame = parse_mindformers_text(Path("<line>"), line + "\n", fmt=PYNATIVE)
    except LogFormatError:
        return None
    row = frame.iloc[-1]
    names = [name for name in frame.columns if name in METRICS or re.fullmatch(r"mtp_\d+_loss", name)]
    metrics = {name: float(row[name]) for name in names if not math.isnan(row[name])}
    return int(row["step"]), int(match.group(2)), metrics


def _step_frame(log_path: Path) -> pd.DataFrame | None:
    """The log's pynative steps as the log parser reads them; None when it holds no step line."""
    text, truncated = read_log_text(log_path)
    try:
        return parse_mindformers_text(log_path, text, truncated=truncated, fmt=PYNATIVE)
    except LogFormatError:
        return None


def _first_step_without(frame: pd.DataFrame | None, column: str) -> int | None:
    """The first logged step whose line lacks ``column`` (None when every line has it; a printed NaN is there)."""
    if frame is None or not len(frame):
        return None
    if column not in frame.columns:
        return int(frame["step"].iloc[0])
    printed_nan = set(frame.attrs.get("printed_nan", {}).get(column, ()))
    lacking = [int(step) for step in frame["step"][frame[column].isna()] if int(step) not in printed_nan]
    return lacking[0] if lacking else None


def _nan_steps(frame: pd.DataFrame | None, column: str) -> list[int]:
    """The steps whose line printed ``column`` as nan or inf."""
    return [] if frame is None else sorted(frame.attrs.get("printed_nan", {}).get(column, ()))


def verify_mindformers_log(log_path: Path, *, steps: int, loaded: bool, exit_status: int, mtp: bool,
                           moe: bool = False) -> None:
    """Raise BackendRunError unless the log shows a complete load (when asked) and steps 1..N, with the
    MTP losses (``mtp``) and the MoE aux loss (``moe``) on every step line.

    The step lines are read by the log parser, the same reading the comparison makes.
    """
    if not log_path.exists():
        raise BackendRunError(f"{log_path}: MindFormers wrote no log (exit status {exit_status})")
    load_finished = False
    lines = log_path.read_text(encoding="utf-8", errors="replace").splitlines()
    for number, line in enumerate(lines, start=1):
        where = f"{log_path}:{number}: {line.strip()[:300]}"
        if "Network parameters not loaded:" in line or "Checkpoint weights not loaded:" in line:
            names = [hit.group(1) for ln in lines[number: number + 5] if (hit := _LISTED_NAME.search(ln))]
            raise BackendRunError(f"MindFormers loaded the checkpoint incompletely: {where}"
                                  + (f" (first names: {', '.join(names)})" if names else ""))
        if "Loading Checkpoint Finished" in line:
            load_finished = True
    if exit_status != 0:
        raise BackendRunError(f"MindFormers exited with status {exit_status}; end of {log_path}:\n"
                              f"{failure_summary(log_path)}")
    if loaded and not load_finished:
        raise BackendRunError(f"{log_path}: no 'Loading Checkpoint Finished' line: the checkpoint was not loaded")
    frame = _step_frame(log_path)
    seen = set() if frame is None else {int(step) for step in frame["step"]}
    absent = missing_steps(seen, steps)
    if absent:
        raise BackendRunError(f"{log_path}: steps {absent[0]}..{absent[-1]} of {steps} were never logged "
                              f"(last logged: {max(seen) if seen else 0}); end of the log:\n{failure_summary(log_path)}")
    patch = ("apply the mindformers-qwen35-loss-logging patch to the fork's Qwen3.5 classes; MindFormers "
             "releases before 2.0.0 log neither loss whatever the model has")
    for wanted, kind, column, name in ((True, "LM", "lm_loss", "loss"), (mtp, "MTP", "mtp_1_loss", "mtp_1_loss"),
                                       (moe, "MoE", "aux_loss", "load_balancing_loss")):
        if not wanted:
            continue
        nan = _nan_steps(frame, column)
        step = _first_step_without(frame, column) if column != "lm_loss" else None
        if nan and (step is None or nan[0] < step):
            raise BackendRunError(f"{log_path}: {name} is NaN at step {nan[0]} (the {kind} loss diverged; NaN at "
                                  f"step(s) {step_ranges(nan)} of {steps}); end of the log:\n"
                                  f"{failure_summary(log_path)}")
        if step is not None:
            raise BackendRunError(f"{log_path}: the model has {kind} but the line of step {step} has no {name} "
                                  f"(LossCallback asks the top model for it: {patch})")


def find_checkpoint(save_dir: Path) -> Path:
    """The saved checkpoint root (holding latest_checkpointed_iteration.txt)."""
    tracker = save_dir / "latest_checkpointed_iteration.txt"
    if not tracker.exists():
        found = sorted(save_dir.rglob("latest_checkpointed_iteration.txt"))
        if not found:
            raise BackendRunError(f"{save_dir}: MindFormers saved no checkpoint (no latest_checkpointed_iteration.txt)")
        return found[0].parent
    return save_dir


# ---- what the network loaded -------------------------------------------------------------------


class _LoadedTensors(Mapping):
    """The checkpoint's weights and buffers, each read when asked for, as a weights-only load takes them.

    ``load_checkpoint`` without an optimizer (``no_load_optim: True``) loads the model file's copy of
    each tensor (2.1.0 checkpoint/checkpoint.py:597-600 keeps the network's own names): for a weight
    that also has an fp32 master ``main_param.<name>`` in the ``-opt-`` file that is the bf16 copy, so
    the masters are left out here and each name reads its own entry.
    """

    def __init__(self, checkpoint_dir: Path):
        from crossalign.checkpoint.mindformers import MASTER_PREFIX, read_mindformers_checkpoint

        whole = read_mindformers_checkpoint(checkpoint_dir)
        self.checkpoint = replace(whole, entries={name: info for name, info in whole.entries.items()
                                                  if not name.startswith(MASTER_PREFIX)})
        self.names = sorted({**self.checkpoint.model_entries(), **self.checkpoint.buffer_entries()})

    def __getitem__(self, name: str):
        if name not in self.names:
            raise KeyError(name)
        return self.checkpoint.tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def _rank_records(digest_dir: Path, cards: int) -> dict[int, tuple[Path, dict[str, dict]]]:
    """Each rank's record (path, tensors); LoadDigestError naming the ranks that wrote none."""
    from crossalign.checkpoint.digest import LoadDigestError, read_digest

    records = {rank: digest_dir / f"rank_{rank}.json" for rank in range(cards)}
    absent = [rank for rank, path in records.items() if not path.exists()]
    if absent:
        raise LoadDigestError(
            f"{digest_dir}: MindFormers wrote no load digest for rank(s) {', '.join(map(str, absent))} of {cards} "
            f"(Trainer.train() writes rank_<r>.json after the load when the {LOAD_DIGEST_PATCH} patch is applied: "
            f"crossalign patch apply --mindformers <checkout>)")
    return {rank: (path, read_digest(path)) for rank, path in records.items()}


def verify_load_digest(digest_dir: Path, checkpoint: Path, config: AlignmentConfig) -> int | None:
    """Hold what each rank's network held after the load against the checkpoint it was given.

    Every parameter of every rank (pipeline stages hold different ones, data-parallel replicas the
    same: a name on several ranks must have one digest) together must be exactly the checkpoint's
    weights and buffers, each with its values. A parameter may be held in another dtype than the
    checkpoint's: from 2.1.0 the pynative Linear and GroupedMLP are created in the compute dtype
    whatever params_dtype says (bf16 MLP, expert, output-layer and eh_proj weights), and a bf16
    checkpoint may go into fp32 parameters; the checkpoint's tensor is cast to the loaded dtype
    (round to nearest even, as MindFormers 2.1.0's load of an fp32 checkpoint into its bf16 parameters
    rounds: tests/test_mindformers_load_digest.py) before it is hashed.

    With tensor or expert parallelism a rank holds slices, which the record cannot place in the
    whole tensor: the names are still held against the checkpoint's (a missing, extra or renamed
    tensor fails), but no value is compared, and None is returned. Otherwise returns how many
    tensors were verified. Raises :class:`LoadDigestError` naming every problem.
    """
    from crossalign.checkpoint.digest import LoadDigestError, compare_loaded

    layout = config.parallel.mindformers
    records = _rank_records(digest_dir, layout.world_size)
    loaded: dict[str, dict] = {}
    first: dict[str, int] = {}
    disagree = []
    for rank, (_, tensors) in records.items():
        for name, digest in tensors.items():
            if name not in loaded:
                loaded[name], first[name] = digest, rank
            elif (digest["sha256"], list(digest["shape"])) != (loaded[name]["sha256"], list(loaded[name]["shape"])):
                disagree.append(f"{name} (rank {first[name]} and rank {rank})")
    sharded = layout.tensor > 1 or layout.expert > 1
    if disagree and not sharded:
        raise LoadDigestError(f"{digest_dir}: ranks hold different values of {len(disagree)} tensor(s) after the "
                              f"load: {', '.join(disagree[:8])}")
    tensors = _LoadedTensors(checkpoint)
    what = f"MindFormers ({digest_dir}, {len(records)} rank(s)) vs the checkpoint {checkpoint}"
    if sharded:  # names only: each side's shape and hash are taken as they are
        compare_loaded(loaded, {name: name for name in tensors.names}, what=what,
                       shape_of=lambda name: tuple(loaded[name]["shape"]), hash_in=lambda _, digest: digest["sha256"])
        return None
    compare_loaded(loaded, tensors, what=what)
    return len(loaded)


# ---- launching -------------------------------------------------------------------------------


class MindFormersBackend(FrameworkBackend):
    """DAG steps 1 and 5 on an NPU machine: ``run_mindformer.py --mode 1`` (msrun for several cards)."""

    name = "mindformers"

    def checkout(self) -> Path:
        """The MindFormers checkout (checked here unless it lives on a remote host; the run script checks too)."""
        path = self.site.mindformers.path
        if path is None:
            raise BackendSetupError("site config: mindformers.path (the MindFormers checkout) is not set")
        path = Path(path).expanduser()
        if self.site.mindformers.ssh_host is not None:
            if not path.is_absolute():
                raise BackendSetupError(f"mindformers.path {path}: must be an absolute path on the remote host "
                                        f"{self.site.mindformers.ssh_host}")
            return path
        path = path.absolute()  # the run script cds into the step folder: a relative path would no longer hold
        if not (path / "run_mindformer.py").exists():
            raise BackendSetupError(f"mindformers.path {path}: no run_mindformer.py there (not a MindFormers checkout)")
        return path

    def run_script(self, request: TrainRequest, config_path: Path) -> RunScript:
        checkout = self.checkout()
        site = self.site.mindformers
        layout = request.config.parallel.mindformers
        if site.nproc_per_node < layout.cards_per_node:
            raise BackendSetupError(f"parallel.mindformers.cards_per_node is {layout.cards_per_node}, but the site's "
                                    f"mindformers.nproc_per_node is {site.nproc_per_node}")
        nproc, local = layout.world_size, layout.cards_per_node
        log_root = request.output_dir.absolute() / "mf_log"
        env = {**DETERMINISTIC_ENV, "PYTHONPATH": str(checkout), "LOG_MF_PATH": str(log_root), **site.env}
        if request.mode == "align":  # the run that loads: the patched trainer records what it loaded
            env[LOAD_DIGEST_ENV] = str(request.output_dir.absolute() / LOAD_DIGEST_DIR)
        entry = [str(checkout / "run_mindformer.py"), "--mode", "1", "--config", str(config_path.absolute())]
        if nproc == 1:
            command = [site.python, *entry]
        else:
            command = [site.python, "-m", "mindspore.parallel.cluster.run", f"--worker_num={nproc}",
                       f"--local_worker_num={local}", f"--master_port={MSRUN_PORT}",
                       f"--log_dir={request.output_dir.absolute() / 'msrun_log'}", "--join=True",
                       f"--tail_worker_log={nproc - 1}", *entry]
        return RunScript(command=command, cwd=request.output_dir.absolute(), env=env, required_files=(entry[0],),
                         staged_in=request.output_dir, published_as=request.published_dir,
                         title=f"MindFormers pynative: {request.config.model.name}, {request.mode} run, "
                               f"{request.iterations} steps on {nproc} card(s)")

    def train(self, request: TrainRequest) -> TrainResult:
        if request.side != "mindformers":
            raise BackendSetupError(f"the mindformers backend trains side 'mindformers', not {request.side!r}")
        loaded = request.mode == "align"
        if loaded and request.init_checkpoint is None:
            raise BackendSetupError("the align run needs request.init_checkpoint (the bf16 MindFormers checkpoint)")
        save = request.save or request.mode == "base"
        data = mindformers_yaml(
            request.config, mode=request.mode, data_prefix=request.data.prefix.absolute(),
            tokenizer=request.data.tokenizer,
            load_dir=request.init_checkpoint.absolute() if loaded else None,  # type: ignore[union-attr]
            save_dir=request.checkpoint_dir.absolute() if save else None,
            model_overrides=request.extra.get("mindformers_model"))  # type: ignore[arg-type]
        request.output_dir.mkdir(parents=True, exist_ok=True)
        config_path = dump_yaml(data, request.output_dir / f"{request.mode}_train.yaml")
        script = write_run_script(request.output_dir / RUN_SCRIPT, self.run_script(request, config_path))

        steps = request.iterations
        on_line = progress_callback(request.on_step, steps, parse_step_line)
        start = time.monotonic()
        status = self._runner(script, request.log_path, on_line)
        verify_mindformers_log(request.log_path, steps=steps, loaded=loaded, exit_status=status,
                               mtp=request.config.model.mtp_num_layers > 0, moe=request.config.model.is_moe)
        verify_transformer_config(request.log_path, request.config)
        verify_built_model(request.log_path, request.config)
        verified = None
        if loaded:
            from crossalign.checkpoint.errors import CheckpointError

            try:
                verified = verify_load_digest(request.output_dir / LOAD_DIGEST_DIR, request.init_checkpoint,
                                              request.config)  # type: ignore[arg-type]
            except CheckpointError as exc:  # LoadDigestError, or the checkpoint itself unreadable
                raise BackendRunError(str(exc)) from None
        checkpoint = find_checkpoint(request.checkpoint_dir) if save else None
        return TrainResult(log_path=request.log_path, checkpoint_dir=checkpoint, iterations=steps,
                           seconds=time.monotonic() - start, loaded_tensors_verified=verified)

