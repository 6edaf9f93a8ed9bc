"""Do both sides read the same tokens in the same order? Compare batch digests and name the cause.

A different sample order (SPEC section 9, pitfall 1) makes every loss comparison meaningless,
and it is cheap to rule out before training: derive the first N global batches of each side,
compare sha256 digests of their token ids, and when they differ, say which setting does it.
A setting "explains" the difference when changing only that setting on the Megatron side
already changes Megatron's batches; settings that differ without any effect on these batches
(say, a weighted blend whose 0.5% extra samples do not change the epoch count) are reported as
harmless.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from crossalign.data.order import GlobalBatches, global_batches
from crossalign.data.settings import SampleOrderError, SampleOrderSettings

SIDES = ("megatron", "mindformers")

EFFECTS = {
    "seed": "the GPTDataset shuffles draw from numpy RandomState(seed): the batches differ from step 1",
    "split": "the train split covers a different range of documents (Megatron without --split uses 969,30,1)",
    "blend": "a weighted data path ['1', prefix] builds a BlendedDataset whose GPTDataset is built for "
             "ceil(n * 1.005) samples, a bare prefix for exactly n; this changes the order when it "
             "changes the epoch count",
    "num_samples": "num_samples (Megatron train_iters * global_batch_size, MindFormers sizes[0]) sets the "
                   "number of epochs the document and sample shuffles are built for",
    "dataloader_type": "--dataloader-type cyclic draws the samples through torch.randperm seeded by the epoch "
                       "number (not by --seed); single reads them in order",
    "seq_length": "samples are cut to a different length",
    "micro_batch_size": "the cyclic sampler permutes buckets of (samples // (mbs * dp)) * mbs indices",
    "data_parallel_size": "the cyclic sampler permutes one bucket per data-parallel rank",
    "surplus": "a weighted blend builds its GPTDataset for ceil(n * (1 + surplus)) samples",
}


@dataclass(frozen=True)
class SettingDifference:
    name: str
    megatron: object
    mindformers: object
    changes_order: bool  # changing only this setting on the Megatron side changes its batches
    effect: str


@dataclass(frozen=True)
class DatasetFacts:
    """What the settings of one side built: the numbers that explain an order."""

    dataset: str  # GPTDataset or BlendedDataset
    gpt_num_samples: int  # samples the GPTDataset was built for
    epochs: int
    samples: int  # samples the loader can read


@dataclass
class SampleOrderReport:
    megatron: SampleOrderSettings
    mindformers: SampleOrderSettings
    global_batch_size: int
    megatron_digests: list[str]
    mindformers_digests: list[str]
    megatron_facts: DatasetFacts
    mindformers_facts: DatasetFacts
    differences: list[SettingDifference] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return self.megatron_digests == self.mindformers_digests

    @property
    def first_differing_step(self) -> int | None:
        """1-based training step (iteration) of the first global batch that differs, None if none does."""
        for step, (a, b) in enumerate(zip(self.megatron_digests, self.mindformers_digests), start=1):
            if a != b:
                return step
        return None

    @property
    def explained_by(self) -> list[str]:
        """The differing settings that change the order on their own (all differing ones if none does alone)."""
        if self.identical:
            return []
        alone = [d.name for d in self.differences if d.changes_order]
        return alone or [d.name for d in self.differences]

    def summary(self) -> str:
        """One sentence: identical, or the first differing step and its cause."""
        n = len(self.megatron_digests)
        if self.identical:
            note = ""
            if self.differences:
                note = (" (" + ", ".join(d.name for d in self.differences)
                        + " differ but do not change these batches)")
            return f"the first {n} global batches are identical on both sides{note}"
        step = self.first_differing_step
        if not self.differences:
            return f"global batch of step {step} differs, yet no modelled setting differs: check the data files"
        causes = ", ".join(f"{name} ({_value(self, name)})" for name in self.explained_by)
        return f"step {step} is the first global batch that differs; explained by {causes}"

    def to_dict(self) -> dict:
        return {
            "identical": self.identical,
            "first_differing_step": self.first_differing_step,
            "explained_by": self.explained_by,
            "summary": self.summary(),
            "global_batch_size": self.global_batch_size,
            "megatron": asdict(self.megatron),
            "mindformers": asdict(self.mindformers),
            "megatron_facts": asdict(self.megatron_facts),
            "mindformers_facts": asdict(self.mindformers_facts),
            "megatron_digests": self.megatron_digests,
            "mindformers_digests": self.mindformers_digests,
            "differences": [asdict(d) for d in self.differences],
        }


def compare_sample_order(megatron_settings: SampleOrderSettings, mindformers_settings: SampleOrderSettings,
                         prefix: Path, global_batch_size: int, batches: int) -> SampleOrderReport:
    """Digests of the first ``batches`` global batches of both sides, and the settings that explain a difference."""
    if batches <= 0:
        raise SampleOrderError(f"batches: {batches} must be positive")
    sides = {}
    for name, settings in zip(SIDES, (megatron_settings, mindformers_settings)):
        loader = global_batches(settings, prefix, global_batch_size)
        if len(loader) < batches:
            raise SampleOrderError(f"{name} side: num_samples {settings.num_samples} covers only {len(loader)} "
                                   f"global batches of {global_batch_size}, fewer than the {batches} to compare")
        sides[name] = loader
    digests = {name: batch_digests(loader, batches) for name, loader in sides.items()}

    differences = []
    for name in megatron_settings.differences(mindformers_settings):
        theirs = getattr(mindformers_settings, name)
        variant = megatron_settings.with_setting(name, theirs)
        changes = batch_digests(global_batches(variant, prefix, global_batch_size), batches) != digests["megatron"]
        differences.append(SettingDifference(name, getattr(megatron_settings, name), theirs, changes, EFFECTS[name]))
    return SampleOrderReport(
        megatron=megatron_settings, mindformers=mindformers_settings, global_batch_size=global_batch_size,
        megatron_digests=digests["megatron"], mindformers_digests=digests["mindformers"],
        megatron_facts=dataset_facts(sides["megatron"]), mindformers_facts=dataset_facts(sides["mindformers"]),
        differences=differences)


def batch_digests(loader: GlobalBatches, batches: int) -> list[str]:
    """sha256 of each global batch's token ids (little-endian int64, row-major)."""
    return [hashlib.sha256(np.ascontiguousarray(loader[i], dtype="<i8").tobytes()).hexdigest()
            for i in range(min(batches, len(loader)))]


def dataset_facts(loader: GlobalBatches) -> DatasetFacts:
    dataset = loader.dataset
    gpt = dataset.datasets[0] if hasattr(dataset, "datasets") else dataset
    tokens_per_epoch = int(np.sum(gpt.dataset.sequence_lengths[gpt.indices]))
    wanted = gpt.num_samples * loader.settings.seq_length + 1  # one extra token per sample (add_extra_token)
    return DatasetFacts(dataset=type(dataset).__name__, gpt_num_samples=int(gpt.num_samples),
                        epochs=max(1, math.ceil(wanted / tokens_per_epoch)), samples=len(dataset))


def _value(report: SampleOrderReport, name: str) -> str:
    return f"megatron {getattr(report.megatron, name)} vs mindformers {getattr(report.mindformers, name)}"
