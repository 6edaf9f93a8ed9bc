"""The global batches each framework would read, built with megatron-core's own dataset code.

The dataset side is megatron-core's ``GPTDataset`` built through ``BlendedMegatronDatasetBuilder``
with the settings of the side (MindFormers' port of the same code takes the same settings, so one
implementation serves both; what differs is the settings, see ``settings.py``). On top of it sits
the loader: Megatron's ``single`` sampler reads dataset indices in order, ``cyclic`` draws them
through a ``torch.randperm`` seeded by the epoch number (not by the seed), per data-parallel
bucket, exactly as ``MegatronPretrainingRandomSampler`` does. MindFormers reads in order.

Megatron caches the index arrays it builds (``*-document_index.npy`` etc.) in a folder; ours is
``<data dir>/cache``. It writes them in place, so it writes into a private staging folder and the
finished files are renamed into the shared cache: the two trainers start at the same time and
must never read each other's half-written files. Built datasets are also kept per process.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from collections.abc import Sequence
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import numpy as np

from crossalign.data.mcore import quiet_megatron_import
from crossalign.data.prepare import CACHE_DIR_NAME, MANIFEST_NAME
from crossalign.data.settings import SampleOrderError, SampleOrderSettings


_BUILD_LOCK = threading.Lock()  # one build at a time per process: they share the process group


class GlobalBatches(Sequence):
    """Item i: int64 array [global_batch_size, seq_length + 1], the tokens of global batch i in read order.

    inputs = [:, :-1], labels = [:, 1:]. Within a global batch, samples are ordered by micro
    step, then data-parallel rank, then position in the micro batch.
    """

    def __init__(self, dataset, settings: SampleOrderSettings, global_batch_size: int) -> None:
        per_step = settings.micro_batch_size * settings.data_parallel_size
        if global_batch_size % per_step:
            raise SampleOrderError(f"global_batch_size: {global_batch_size} is not a multiple of micro_batch_size "
                                   f"{settings.micro_batch_size} x data_parallel_size {settings.data_parallel_size}")
        self.dataset = dataset
        self.settings = settings
        self.global_batch_size = global_batch_size
        self.dataset_length = len(dataset)
        if settings.dataloader_type == "single" and self.dataset_length < settings.num_samples:
            raise SampleOrderError(f"the dataset holds {self.dataset_length} samples, fewer than num_samples "
                                   f"{settings.num_samples}")
        self._bucket = (self.dataset_length // per_step) * settings.micro_batch_size

    def __len__(self) -> int:
        return self.settings.num_samples // self.global_batch_size

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"global batch {index} of {len(self)}")
        return np.stack([self.sample(int(i)) for i in self.sample_indices(index)])

    def sample(self, dataset_index: int) -> np.ndarray:
        """The seq_length + 1 tokens of one dataset sample (what GPTDataset splits into tokens and labels)."""
        item = self.dataset[dataset_index]
        return np.concatenate([item["tokens"].numpy(), item["labels"].numpy()[-1:]]).astype(np.int64)

    def sample_indices(self, index: int) -> np.ndarray:
        """Dataset indices of global batch ``index``, in the order the sampler hands them out."""
        s = self.settings
        gbs = self.global_batch_size
        if s.dataloader_type == "single":
            return np.arange(index * gbs, (index + 1) * gbs, dtype=np.int64)
        micro_steps = gbs // (s.micro_batch_size * s.data_parallel_size)
        out = []
        for step in range(index * micro_steps, (index + 1) * micro_steps):
            for rank in range(s.data_parallel_size):
                for j in range(s.micro_batch_size):
                    position = step * s.micro_batch_size + j  # position in this rank's endless stream
                    epoch, offset = divmod(position, self._bucket)
                    out.append(rank * self._bucket + int(_epoch_permutation(self._bucket, epoch)[offset]))
        return np.asarray(out, dtype=np.int64)


@lru_cache(maxsize=8)
def _epoch_permutation(bucket_size: int, epoch: int) -> np.ndarray:
    """MegatronPretrainingRandomSampler's per-epoch permutation: torch.randperm seeded with the epoch."""
    # torch: an optional framework (not in the base install), needed only here
    import torch

    generator = torch.Generator()
    generator.manual_seed(epoch)
    return torch.randperm(bucket_size, generator=generator).numpy()


def global_batches(settings: SampleOrderSettings, prefix: Path, global_batch_size: int) -> GlobalBatches:
    """The global batches of any settings (the preflight uses this to reproduce pitfalls)."""
    return GlobalBatches(build_dataset(settings, prefix), settings, global_batch_size)


def build_dataset(settings: SampleOrderSettings, prefix: Path):
    """The top-level train dataset (GPTDataset, or BlendedDataset for a weighted blend), kept per process."""
    prefix = Path(prefix).resolve()
    for suffix in (".bin", ".idx"):
        if not prefix.with_name(prefix.name + suffix).is_file():
            raise SampleOrderError(f"{prefix}{suffix}: indexed dataset file not found (run `crossalign data prepare`)")
    idx = prefix.with_name(prefix.name + ".idx").stat()
    return _build_dataset_cached(settings, str(prefix), idx.st_size, idx.st_mtime_ns)


@lru_cache(maxsize=16)
def _build_dataset_cached(settings: SampleOrderSettings, prefix: str, idx_size: int, idx_mtime_ns: int):
    with quiet_megatron_import():
        # megatron-core: an optional framework (the local and gpu extras), needed only here
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    cache_dir = Path(prefix).parent / CACHE_DIR_NAME
    with _BUILD_LOCK, _staged_cache(cache_dir) as staging, _single_process_group():
        config = GPTDatasetConfig(
            random_seed=settings.seed,
            sequence_length=settings.seq_length,
            blend=([prefix], None if settings.blend == "bare" else [1.0]),
            split=settings.split,
            path_to_cache=str(staging),
            tokenizer=_DatasetTokenizer.next_to(Path(prefix)),
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            create_attention_mask=False,
            mid_level_dataset_surplus=settings.surplus,
        )
        builder = BlendedMegatronDatasetBuilder(GPTDataset, [settings.num_samples, 0, 0], lambda: True, config)
        train, _, _ = builder.build()
    if train is None:
        raise SampleOrderError(f"split: {settings.split!r} leaves no training documents")
    return train


class _DatasetTokenizer:
    """The few tokenizer attributes GPTDataset reads: vocab size (index dtype), eod, cache-key identifiers.

    They come from the dataset manifest written by ``prepare``; any other dataset gets none,
    which changes nothing in the order (the tokenizer only names the cache files).
    """

    def __init__(self, vocab_size: int | None, eod: int | None) -> None:
        self.vocab_size = vocab_size
        self.eod = eod
        self.unique_identifiers = {"class": "crossalign", "vocab_size": vocab_size, "eod": eod}

    @classmethod
    def next_to(cls, prefix: Path) -> "_DatasetTokenizer":
        try:
            manifest = json.loads((prefix.parent / MANIFEST_NAME).read_text())
            return cls(manifest["tokenizer_vocab_size"], manifest["eod_id"])
        except (OSError, ValueError, KeyError):
            return cls(None, None)


@contextmanager
def _staged_cache(cache_dir: Path) -> Iterator[Path]:
    """A private copy of the index cache for megatron-core to read and write; new files are published by rename."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=cache_dir.parent))
    try:
        for entry in cache_dir.iterdir():
            try:
                os.link(entry, staging / entry.name)
            except OSError:
                shutil.copy2(entry, staging / entry.name)
        yield staging
        for entry in staging.iterdir():
            if not (cache_dir / entry.name).exists():
                os.replace(entry, cache_dir / entry.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def _single_process_group() -> Iterator[None]:
    """A one-rank gloo group while building: megatron-core's BlendedDataset asks for the rank when it
    writes its cache. A process that already has a group keeps it."""
    # torch: an optional framework (not in the base install), needed only here
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory(prefix="crossalign-pg-") as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()
