"""The settings that decide which tokens each global batch holds, per framework.

Both Megatron-LM and MindFormers build their sample order with the GPTDataset algorithm
(MindFormers ships a port of megatron-core's ``datasets`` package, SPEC section 5), so the
order is a function of a handful of settings. Each framework spells them differently and has
different defaults; :class:`SampleOrderSettings` is the common form, with constructors from our
``TrainingConfig`` (what the embedded trainers do), from a Megatron argument list and from a
MindFormers YAML document (what the real launches do).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, Mapping, Sequence

from crossalign.config import TrainingConfig
from crossalign.launch_files import parse_megatron_args

Blend = Literal["bare", "weighted"]
LoaderType = Literal["single", "cyclic"]

MEGATRON_DEFAULT_SEED = 1234
MEGATRON_DEFAULT_SPLIT = "969, 30, 1"  # legacy_default_split_value, used when --data-path has no --split
MINDFORMERS_DEFAULT_SEED = 1234  # data_loader.config.seed -> GPTDatasetConfig.random_seed
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

    # ---- constructors ---------------------------------------------------------------------

    @classmethod
    def for_megatron(cls, training: TrainingConfig, num_samples: int | None = None) -> "SampleOrderSettings":
        """What our generated Megatron arguments say: --seed, --split, bare --data-path, --dataloader-type."""
        return cls(seed=training.seed, split=training.split, seq_length=training.seq_length,
                   num_samples=num_samples or training.train_samples, blend="bare",
                   dataloader_type=training.dataloader_type, micro_batch_size=training.micro_batch_size)

    @classmethod
    def for_mindformers(cls, training: TrainingConfig, num_samples: int | None = None) -> "SampleOrderSettings":
        """What our generated MindFormers YAML says: dataloader config seed/split, ``data_path: [prefix]``,
        ``sizes: [num_samples, 0, 0]``; MindFormers reads the dataset in order (``shuffle: false``)."""
        return cls(seed=training.seed, split=training.split, seq_length=training.seq_length,
                   num_samples=num_samples or training.train_samples, blend="bare",
                   dataloader_type="single", micro_batch_size=training.micro_batch_size)

    @classmethod
    def from_megatron_args(cls, args: Sequence[str], data_parallel_size: int = 1) -> "SampleOrderSettings":
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
        return cls(seed=value("--seed", int, MEGATRON_DEFAULT_SEED),
                   split=split if split is not None else MEGATRON_DEFAULT_SPLIT,
                   seq_length=seq_length, num_samples=num_samples,
                   blend=_blend_form(data_path, "Megatron arguments: --data-path"),
                   dataloader_type=loader, micro_batch_size=value("--micro-batch-size", int, 1),
                   data_parallel_size=data_parallel_size,
                   surplus=value("--mid-level-dataset-surplus", float, BLEND_SURPLUS))

    @classmethod
    def from_mindformers_yaml(cls, document: Mapping[str, Any]) -> "SampleOrderSettings":
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
        return cls(seed=int(config.get("seed", MINDFORMERS_DEFAULT_SEED)), split=str(config["split"]),
                   seq_length=int(config["seq_length"]), num_samples=int(sizes[0]),
                   blend=_blend_form([str(p) for p in data_path], f"MindFormers YAML: {key}.config.data_path"),
                   dataloader_type="single")

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


def _blend_form(data_path: Sequence[str], where: str) -> Blend:
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
