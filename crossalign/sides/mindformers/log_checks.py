"""What a real MindFormers run printed: the network it built from the YAML, and a LossCallback line for every step.

A dropped YAML key only warns, so the "The final converted TransformerConfig is:" block the converter logs
(config_converter.py:108-112) is read back (:func:`verify_transformer_config`) and a number-changing setting
that is missing or different fails the step, named; the built-model line (:func:`verify_built_model`) says
the network has the partial rotary factor of the config.

The log: LossCallback lines go to stdout (captured line by line into ``train.log``) and to
``<LOG_MF_PATH>/rank_<r>/info.log``; the run script points LOG_MF_PATH into the step folder.
With several cards msrun tails the last worker's log to stdout.

"""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING


from crossalign.sides.launch import (
    BackendRunError,
    failure_summary,
    missing_steps,
)
from crossalign.config import AlignmentConfig
from crossalign.sides.log_common import LogFormatError, read_log_text, step_ranges
from crossalign.sides.mindformers.log_parser import parse_mindformers_text
from crossalign.sides.mindformers.yaml import ROUTER_DTYPE_NAMES, shared_expert_num

if TYPE_CHECKING:
    import pandas as pd



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


STEP_LINE = re.compile(r"\{\s*step:\[\s*(\d+)\s*/\s*(\d+)\s*\]")
_LISTED_NAME = re.compile(r"\s- (\S+)\s*$")
PYNATIVE = "mindformers-pynative"
METRICS = ("lm_loss", "aux_loss", "lr", "grad_norm", "step_time_ms")


def parse_step_line(line: str) -> tuple[int, int, dict[str, float]] | None:
    """(step, total, metrics) of a pynative LossCallback line, for progress; None for other lines.

    The line is read by the log parser (``crossalign.sides.mindformers.log_parser``), so progress, the log
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
