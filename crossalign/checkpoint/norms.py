"""Which norm convention a Megatron checkpoint's gammas are stored in, told from the gammas themselves.

A plain gamma g scales the normalised input as it is; under Megatron's ``--apply-layernorm-1p``
(``model.norm_convention: zero_centred``, the form Megatron-Bridge writes from Hugging Face
Qwen3.5) the stored w is applied as 1 + w. A trained or fresh model's gammas sit around 1 in
the plain form and around 0 in the zero-centred one, so the median of |gamma| over every norm
tells them apart with a wide margin: below 0.5 the gammas are zero-centred, above it plain.
Given to a launch of the other convention, every norm is off by exactly 1 and nothing fails:
this check names the setting instead.
"""

from __future__ import annotations

from typing import Mapping

import torch

from crossalign.config import ModelConfig

# Megatron's gamma keys (TE fused norms, plain norms, GDN's output norm, MTP's norms).
MEGATRON_NORM_SUFFIXES = ("layer_norm_weight", "layernorm.weight", "enorm.weight", "hnorm.weight",
                          "out_norm.weight", "final_layernorm.weight")
THRESHOLD = 0.5  # median |gamma|: plain gammas are near 1, zero-centred ones near 0
CONVENTION_FLAG = {"plain": "without --apply-layernorm-1p", "zero_centred": "--apply-layernorm-1p"}


def stored_norm_convention(state: Mapping[str, torch.Tensor]) -> tuple[str, float] | None:
    """("plain" or "zero_centred", the median |gamma|) of a Megatron state dict; None if it holds no norm."""
    gammas = [tensor.detach().float().abs().flatten() for key, tensor in state.items()
              if key.endswith(MEGATRON_NORM_SUFFIXES)]
    if not gammas:
        return None
    median = float(torch.cat(gammas).median())
    return ("zero_centred" if median < THRESHOLD else "plain"), median


def norm_convention_problem(state: Mapping[str, torch.Tensor], model: ModelConfig, what: str) -> str | None:
    """Why a Megatron checkpoint's gammas do not fit the config's norm convention (None when they do)."""
    found = stored_norm_convention(state)
    if found is None or found[0] == model.norm_convention:
        return None
    convention, median = found
    return (f"{what}: its norm gammas are stored {convention} (median |gamma| {median:.3g}), but model.norm_convention "
            f"is {model.norm_convention}, a Megatron launch {CONVENTION_FLAG[model.norm_convention]}: every norm "
            f"would be off by 1. Set model.norm_convention: {convention} (Megatron {CONVENTION_FLAG[convention]})")
