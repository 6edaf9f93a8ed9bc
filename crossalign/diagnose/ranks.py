"""A converted Megatron checkpoint read the way Megatron's ranks load it, even when its rank files do not fit.

A checkpoint whose ranks assemble into one model (``checkpoint.megatron``) is read as it is. One
whose ranks do not (a rank holds keys its model does not have, such as routed experts still under
their global numbers on EP rank 1) is read as each Megatron rank would load its own file after
the strict load fails: the keys that fit the rank's part of the model are loaded, the others keep
the model's initial values (``load_state_dict(strict=False)``, core_v0.16.1
``megatron/training/checkpointing.py``, ``load_checkpoint``'s ``strict`` fallback). The parts are
then merged into the one model the PyTorch reference runs, so that the diagnosis shows where those
initial values first change the output, and the load problems say which rank held which keys.

A rank's part of the routed experts follows Megatron's expert layout, ETP x EP x EDP (core_v0.16.1
``megatron/core/parallel_state.py:785-805``, the expert RankGenerator beside the dense one at :775): the
experts are split over the expert tensor size (``expert_tensor``), not over TP, and the rank of
tensor rank t holds expert slice t % ETP (``sides/megatron/sharding.py`` :func:`shard_tensor`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from crossalign.tensorio.errors import CheckpointError
from crossalign.config import ModelConfig

Layout = tuple[int, int, int]  # (tp, pp, ep)


@dataclass
class LoadedMegatron:
    """The full state the PyTorch reference runs, the checkpoint's layout, and what its ranks could not load."""

    state: dict[str, torch.Tensor]
    layout: Layout
    format: str
    problems: list[str] = field(default_factory=list)


def read_as_megatron_loads(path: Path, model: ModelConfig, core_version: str,
                           expert_tensor: int | None = None) -> LoadedMegatron:
    """The checkpoint at ``path`` merged strictly, or, when its ranks do not fit together, as each rank loads it.

    ``expert_tensor``: the expert tensor parallel size the ranks run with (None: read off the width of the routed
    experts' fc2 shards in the files, TP where there are none)."""
    from crossalign.sides.megatron.checkpoint import find_iteration_dir, read_megatron_checkpoint, read_rank_states
    from crossalign.sides.megatron.merge import merge_rank_states

    try:
        checkpoint = read_megatron_checkpoint(Path(path), model, core_version)
        return LoadedMegatron(checkpoint.state, (checkpoint.tp, checkpoint.pp, checkpoint.ep), checkpoint.format)
    except CheckpointError as exc:
        strict_error = str(exc)
        directory, _ = find_iteration_dir(Path(path))
        try:
            shards = read_rank_states(directory)
        except CheckpointError:
            raise exc from None
    layout: Layout = tuple(1 + max(rank[i] for rank in shards) for i in range(3))  # type: ignore[assignment]
    problems = [f"the ranks do not fit together ({strict_error}); each rank loaded what fits its part of the "
                "model, as Megatron does after its strict load fails"]
    etp = expert_tensor if expert_tensor is not None else expert_tensor_in_files(shards, model, layout[0])
    problems += fit_ranks_to_model(shards, model, core_version, layout, directory, etp)
    try:
        state = merge_rank_states(shards, model)
    except CheckpointError as exc:
        raise CheckpointError(f"{directory}: {strict_error}; even loaded rank by rank they do not merge: {exc}") \
            from None
    return LoadedMegatron(state, layout, "torch", problems)


def expert_tensor_in_files(shards: dict, model: ModelConfig, tp: int) -> int:
    """How many ways the rank files split the routed experts: the moe_ffn width over an fc2 shard's input width
    (TP when no rank holds a routed expert or the widths do not tell)."""
    from crossalign.sides.megatron.sharding import routed_expert_index

    for state in shards.values():
        for key, tensor in state.items():
            if routed_expert_index(key) is not None and ".linear_fc2." in key:
                width = tensor.shape[-1]  # fc2 [H, i / ETP] (as sides/megatron/merge.py reads it)
                if width and model.moe_ffn_hidden_size % width == 0 and tp % (model.moe_ffn_hidden_size // width) == 0:
                    return model.moe_ffn_hidden_size // width
    return tp


def _initial_rank_parts(model: ModelConfig, core_version: str, layout: Layout, etp: int | None) -> dict:
    """Each rank's part of the PyTorch reference at its initial values (the seed ``sides.build_megatron`` uses), the
    routed experts split over ``etp`` tensor ranks (None: TP)."""
    from crossalign.sides.megatron.sharding import shard_tensor
    from crossalign.models.torch_model import Qwen35Model

    torch.manual_seed(0)
    initial = Qwen35Model(model, core_version=core_version).state_dict()
    parts: dict = {}
    for key, tensor in initial.items():
        for rank, local_key, part in shard_tensor(key, tensor, model, *layout, etp):
            parts.setdefault(rank, {})[local_key] = part
    return parts


def _some(keys: list[str], shown: int = 8) -> str:
    """The first ``shown`` keys, and how many more (a real MoE rank can miss thousands)."""
    more = len(keys) - shown
    return ", ".join(keys[:shown]) + (f" and {more} more" if more > 0 else "")


def fit_ranks_to_model(shards: dict, model: ModelConfig, core_version: str, layout: Layout,
                       directory: Path, etp: int | None = None) -> list[str]:
    """Make every rank's state in ``shards`` hold exactly its part of the model, in place, as a lenient load does:
    keys it lacks or holds misshaped take the initial values, keys its part does not have are dropped. The routed
    experts are split over ``etp`` tensor ranks (None: TP). Returns one line per rank that did not fit, naming its
    folder and the keys."""
    from crossalign.sides.megatron.checkpoint import rank_dir_name
    from crossalign.models.layout import unstack_expert_weights

    tp, pp, ep = layout
    expected = _initial_rank_parts(model, core_version, layout, etp)
    local_experts = model.num_experts // ep if model.is_moe else None
    problems = []
    for rank in sorted(shards, key=lambda r: (r[1], r[2], r[0])):
        state = dict(shards[rank])
        if local_experts is not None:
            for key in list(state):
                if key.endswith((".mlp.experts.linear_fc1.weight", ".mlp.experts.linear_fc2.weight")):
                    unstack_expert_weights(state, key[: -len("weight")], local_experts)
        part = expected.get(rank, {})
        unexpected = sorted(key for key in state if key not in part)
        kept = sorted(key for key, tensor in part.items()
                      if key not in state or tuple(state[key].shape) != tuple(tensor.shape))
        if unexpected or kept:
            folder = directory / rank_dir_name(rank[0], rank[1], pp, rank[2], ep)
            notes = []
            if unexpected:
                notes.append(f"not loaded (its part of the model has no such key): {_some(unexpected)}")
            if kept:
                notes.append(f"kept at their initial values: {_some(kept)}")
            problems.append(f"{folder.name} (tp, pp, ep) = {rank}: " + "; ".join(notes))
        shards[rank] = {key: state[key] if key not in kept else tensor for key, tensor in part.items()}
    return problems
