"""A prepared dataset as both frameworks are given it: the indexed dataset's prefix and its tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DatasetFiles:
    """A prepared dataset: a Megatron indexed dataset prefix (``prefix.bin``/``prefix.idx``) and its tokenizer."""

    prefix: Path
    tokenizer: Path
