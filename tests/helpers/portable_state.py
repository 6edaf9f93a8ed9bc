"""Seeded states whose bits are the same on every machine, for tests that pin tensor digests.

``random_mindformers_state`` and transformers' initialisation draw with torch's ``normal_``, ``uniform_`` and
``log_`` on the CPU, whose last bits depend on the vector instructions the CPU dispatch picks (AVX2, AVX-512,
none): digests of what they make differ between machines by a few ulps. Here every value is a small integer
times a power of two (drawn with ``randint``, which has no floating-point step), with the keys, shapes and dtypes
of a given state, norm gammas (all ones there) around 1 and the rest around 0, so a digest of anything computed
from it by data movement and exact shifts is the same everywhere.
"""

from __future__ import annotations

from typing import Mapping

import torch

from crossalign.config import ModelConfig
from crossalign.models.layout import random_mindformers_state


def portable_values(state: Mapping[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """``state``'s keys, shapes and dtypes with values drawn from integers."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for key, tensor in state.items():
        offset = 1.0 if bool((tensor == 1).all()) else 0.0
        ints = torch.randint(-2**12, 2**12, tensor.shape, generator=gen)
        out[key] = (ints.to(torch.float32) * 2.0**-16 + offset).to(tensor.dtype)
    return out


def portable_mindformers_state(model: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    return portable_values(random_mindformers_state(model, seed), seed)
