"""The settings that decide which tokens each global batch holds, per framework.

Both Megatron-LM and MindFormers build their sample order with the GPTDataset algorithm
(MindFormers ships a port of megatron-core's ``datasets`` package, SPEC section 5), so the
order is a function of a handful of settings. Each framework spells them differently and has
different defaults; :class:`SampleOrderSettings` is the common form. Each side makes it from what it
is given (``crossalign.sides.<side>``: from our ``TrainingConfig`` as its generated launch says, and
from a real argument list or YAML with the framework's own defaults).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, Sequence


Blend = Literal["bare", "weighted"]
LoaderType = Literal["single", "cyclic"]

BLEND_SURPLUS = 0.005  # extra samples a weighted blend draws from its GPTDataset (both frameworks)


class SampleOrderError(ValueError):
    """Settings that cannot be turned into a sample order, with the key or argument named."""


@dataclass(frozen=True)
class SampleOrderSettings:
    """Everything that decides the sample order of one side.

    ``num_samples`` is the requested number of training samples (Megatron
    train_iters * global_batch_size, MindFormers ``sizes[0]``); it feeds the epoch count and
    hence every shuffle. ``blend`` is the data path form: a bare prefix builds a plain
    GPTDataset, a weighted one (``1 prefix``) a BlendedDataset over a GPTDataset of
    ceil(num_samples * (1 + surplus)) samples. ``dataloader_type`` is Megatron's: ``single``
    reads the dataset in order, ``cyclic`` adds a permutation seeded by the epoch. The micro
    batch and data-parallel sizes only matter to the cyclic sampler's buckets.
    """

    seed: int
    split: str
    seq_length: int
    num_samples: int
    blend: Blend = "bare"
    dataloader_type: LoaderType = "single"
    micro_batch_size: int = 1
    data_parallel_size: int = 1
    surplus: float = BLEND_SURPLUS

    def __post_init__(self) -> None:
        if self.seq_length <= 0:
            raise SampleOrderError(f"seq_length: {self.seq_length} must be positive")
        if self.num_samples <= 0:
            raise SampleOrderError(f"num_samples: {self.num_samples} must be positive")
        if self.blend not in ("bare", "weighted"):
            raise SampleOrderError(f"blend: {self.blend!r} is not 'bare' or 'weighted'")
        if self.dataloader_type not in ("single", "cyclic"):
            raise SampleOrderError(f"dataloader_type: {self.dataloader_type!r} is not 'single' or 'cyclic'")
        if self.micro_batch_size <= 0 or self.data_parallel_size <= 0:
            raise SampleOrderError("micro_batch_size and data_parallel_size must be positive")
        split_vector(self.split)

    # ---- comparison -----------------------------------------------------------------------

    def with_setting(self, name: str, value: Any) -> "SampleOrderSettings":
        return replace(self, **{name: value})

    def differences(self, other: "SampleOrderSettings") -> list[str]:
        """Names of the settings that differ in effect (equal splits such as 1,0,0 and 100,0,0 agree)."""
        names = []
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name == "split":
                mine, theirs = split_vector(mine), split_vector(theirs)
            if f.name in ("micro_batch_size", "data_parallel_size") and "cyclic" not in (
                    self.dataloader_type, other.dataloader_type):
                continue  # only the cyclic sampler's buckets depend on them
            if f.name == "surplus" and "weighted" not in (self.blend, other.blend):
                continue
            if mine != theirs:
                names.append(f.name)
        return names


def split_vector(split: str) -> tuple[float, float, float]:
    """The normalized train/valid/test weights of a split string, as Megatron parses it."""
    numbers = [float(n) for n in re.findall(r"[.0-9]+", str(split))]
    if not 1 <= len(numbers) <= 3 or sum(numbers) <= 0:
        raise SampleOrderError(f"split: {split!r} is not up to three non-negative weights like '1,0,0'")
    numbers += [0.0] * (3 - len(numbers))
    total = sum(numbers)
    return tuple(round(n / total, 12) for n in numbers)  # type: ignore[return-value]


def blend_form(data_path: Sequence[str], where: str) -> Blend:
    """``[prefix]`` is a bare prefix, ``[weight, prefix]`` a weighted blend of one dataset."""
    if len(data_path) == 1:
        return "bare"
    if len(data_path) == 2:
        try:
            float(data_path[0])
        except ValueError:
            raise SampleOrderError(f"{where}: {list(data_path)} is neither 'prefix' nor 'weight prefix'") from None
        return "weighted"
    raise SampleOrderError(f"{where}: blends of several datasets are not supported; "
                           f"both sides must read the one prepared prefix (got {list(data_path)})")
