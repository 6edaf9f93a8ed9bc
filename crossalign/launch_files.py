"""What the training frameworks are given, and how their launch files are read.

Both the dataset layer (``data/``: which tokens each side reads) and the backends (``backends/``:
what each side trains with) need the same few things: the prepared dataset files, a Megatron
argument list read back from a file, a MindFormers YAML read back from a file. They live here,
below both, so that ``data/`` never imports ``backends/``.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import yaml


class PreflightInputError(ValueError):
    """A Megatron argument file or MindFormers YAML that cannot be read; names the file."""


@dataclass(frozen=True)
class DatasetFiles:
    """A prepared dataset: a Megatron indexed dataset prefix (``prefix.bin``/``prefix.idx``) and its tokenizer."""

    prefix: Path
    tokenizer: Path


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
