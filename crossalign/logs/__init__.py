"""Parsers of real Megatron-LM and MindFormers training logs -> one pandas DataFrame per log.

``parse_log`` finds out which framework wrote a file; ``parse_megatron_log`` and
``parse_mindformers_log`` read one format. The frame and its ``attrs`` are described in
``crossalign.sides.log_common``.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from crossalign.sides.log_common import LogFormatError, read_log_text
from crossalign.sides.megatron.log_parser import ITERATION_RE, parse_megatron_log, parse_megatron_text
from crossalign.sides.mindformers.log_parser import GRAPH_RE, PYNATIVE_RE, parse_mindformers_log, parse_mindformers_text

# each log format as people name it
FORMAT_NAMES = {"megatron": "Megatron", "mindformers-pynative": "MindFormers (pynative)",
                "mindformers-graph": "MindFormers (graph mode)"}

__all__ = ["LogFormatError", "detect_format", "parse_log", "parse_log_text", "parse_megatron_log",
           "parse_mindformers_log"]


def detect_format(path: Path, text: str) -> str:
    """"megatron", "mindformers-pynative" or "mindformers-graph": the kind of step record the text holds."""
    found = [name for name, mark, regex in (("megatron", "iteration", ITERATION_RE),
                                            ("mindformers-pynative", "step:[", PYNATIVE_RE),
                                            ("mindformers-graph", "Epoch:[", GRAPH_RE))
             if mark in text and regex.search(text)]
    if not found:
        what = "is empty" if not text.strip() else "holds no Megatron or MindFormers step record"
        raise LogFormatError(f"{path}: {what} (expected Megatron 'iteration N/ M |' lines or MindFormers "
                             "'step:[N/M], loss: ...' / 'Epoch:[E/T], step:[N/M], loss...' lines)")
    if len(found) > 1:
        raise LogFormatError(f"{path}: holds step lines of several formats ({', '.join(found)}); "
                             "give one training log per side")
    return found[0]


def parse_log(path: Path, core_version: str | None = "0.16.1", mtp_loss_scaling_factor: float | None = None,
              log_interval: int | None = None, mindformers_version: str | None = None) -> pd.DataFrame:
    """Parse a training log of either framework, detected from its content.

    ``core_version`` and ``log_interval`` concern Megatron logs only (None: unknown, see
    ``parse_megatron_text``); ``mtp_loss_scaling_factor`` and ``mindformers_version`` MindFormers logs only
    (graph mode, and pynative releases that print the MTP loss scaled).
    """
    path = Path(path)
    text, truncated = read_log_text(path)
    return parse_log_text(path, text, core_version, mtp_loss_scaling_factor, log_interval, truncated,
                          mindformers_version)


def parse_log_text(path: Path, text: str, core_version: str | None = "0.16.1",
                   mtp_loss_scaling_factor: float | None = None, log_interval: int | None = None,
                   truncated: bool = False, mindformers_version: str | None = None) -> pd.DataFrame:
    """``parse_log`` of text already read (complete lines of a log that is still growing); ``path`` names it."""
    fmt = detect_format(path, text)
    if fmt == "megatron":
        return parse_megatron_text(path, text, core_version, truncated, log_interval)
    return parse_mindformers_text(path, text, mtp_loss_scaling_factor, truncated, fmt, mindformers_version)
