"""The two sides, by name and by pool: what shared code iterates over instead of naming a framework."""

from __future__ import annotations

from pathlib import Path

from crossalign.config import TrainingConfig
from crossalign.data.order import GlobalBatches, global_batches
from crossalign.sides.megatron.side import MEGATRON
from crossalign.sides.mindformers.side import MINDFORMERS
from crossalign.sides.protocol import Side

SIDES: dict[str, Side] = {MEGATRON.name: MEGATRON, MINDFORMERS.name: MINDFORMERS}


def side_named(name: str) -> Side:
    try:
        return SIDES[name]
    except KeyError:
        raise ValueError(f"side: {name!r} is not one of {', '.join(SIDES)}") from None


def side_of_pool(pool: str) -> Side:
    for side in SIDES.values():
        if side.pool == pool:
            return side
    raise ValueError(f"pool {pool!r} trains no side (pools: {', '.join(s.pool for s in SIDES.values())})")


def batches_for(side: str, training: TrainingConfig, prefix: Path, num_samples: int | None = None) -> GlobalBatches:
    """The global batches ``side``'s generated launch reads from the indexed dataset ``prefix``.

    ``num_samples`` defaults to train_iters * global_batch_size (pass base_train_iters * gbs for a base run).
    """
    settings = side_named(side).sample_order(training, num_samples)
    return global_batches(settings, prefix, training.global_batch_size)
