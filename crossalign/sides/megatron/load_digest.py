"""What each Megatron rank really loaded, held against the checkpoint it was given.

Megatron carries on with random weights after a non-strict load, printing only ``load_return: None``
(SPEC section 4), so crossalign's launcher (``patches/megatron/pretrain_qwen35.py``) records what every
rank's model holds right after loading (``CROSSALIGN_LOAD_DIGEST_DIR``), and the step holds each record
against the rank's own file of the checkpoint (:func:`verify_load_digest`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from crossalign.config import AlignmentConfig
from crossalign.models.layout import split_stacked_experts
from crossalign.sides.megatron.te_local import local_to_te_names
from crossalign.tensorio.errors import LoadDigestError

if TYPE_CHECKING:
    import torch

LOAD_DIGEST_DIR = "load_digest"  # the launcher's record of what each rank loaded (CROSSALIGN_LOAD_DIGEST_DIR)


def _rank_state(directory: Path, rank: str) -> dict[str, torch.Tensor]:
    """One ``mp_rank_*`` folder's model tensors, as its file holds them (``_extra_state`` left out)."""
    # torch here, not at the top: the real backend imports this module on agents without torch
    import torch

    from crossalign.sides.megatron.checkpoint import MODEL_FILE

    model = torch.load(directory / rank / MODEL_FILE, map_location="cpu", weights_only=True)["model"]
    return {k: v for k, v in model.items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}


def _torch_dist_rank_states(checkpoint: Path, config: AlignmentConfig) -> dict[str, dict[str, torch.Tensor]]:
    """What each rank folder name of the layout would hold of a torch_dist checkpoint: the full model cut by the
    legacy layout rules (``sharding.shard_tensor``), as Megatron reshards it at load."""
    from crossalign.sides.megatron.checkpoint import read_megatron_checkpoint, rank_dir_name
    from crossalign.sides.megatron.sharding import shard_tensor

    model, layout = config.model, config.parallel.megatron
    tp, pp, ep, etp = layout.tensor, layout.pipeline, layout.expert, layout.expert_tensor_size
    full = split_stacked_experts(read_megatron_checkpoint(checkpoint, model,
                                                          config.training.megatron_core_version).state,
                                 model.num_experts)
    states: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in full.items():
        for (t, p, e), local_key, shard in shard_tensor(key, tensor, model, tp, pp, ep, etp):
            states.setdefault(rank_dir_name(t, p, pp, e, ep), {})[local_key] = shard
    return states


def verify_load_digest(digest_dir: Path, checkpoint: Path, config: AlignmentConfig) -> int:
    """Hold the launcher's load digest (one file per checkpoint folder a rank loads) against the checkpoint.

    The folders held are those the config's Megatron layout loads (``loaded_rank_folders``): a
    folder no rank reads is not asked for. A torch_dist checkpoint has no rank folders: each
    rank is held against its shard of the whole model by the legacy layout rules. The model's
    names may be megatron-core's local-module ones (a CPU rehearsal): they are mapped to the TE
    names (``te_local.py``); stacked routed experts are split per expert, as TE's load hook splits
    them. Raises :class:`LoadDigestError` naming every missing, extra, renamed or different tensor;
    returns how many tensors were verified.
    """
    # these load torch: the real backend imports this module on agents without torch
    from crossalign.sides.megatron.checkpoint import MODEL_FILE, find_iteration_dir, loaded_rank_folders
    from crossalign.sides.megatron.torch_dist import is_torch_dist
    from crossalign.tensorio.digest import compare_loaded, read_digest

    names = local_to_te_names(config.model, config.training.megatron_core_version)
    layout = config.parallel.megatron
    directory, _ = find_iteration_dir(checkpoint)
    resharded = _torch_dist_rank_states(checkpoint, config) if is_torch_dist(directory) else None
    verified = 0
    for rank in loaded_rank_folders(layout.tensor, layout.pipeline, layout.expert, layout.expert_tensor_size,
                                    layout.world_size):
        if resharded is None and not (directory / rank / MODEL_FILE).exists():
            raise LoadDigestError(f"{directory / rank / MODEL_FILE}: the checkpoint {checkpoint} has no file for "
                                  f"rank {rank}, which the layout {layout.ranks} loads")
        path = digest_dir / f"{rank}.json"
        if not path.exists():
            raise LoadDigestError(f"{path}: Megatron wrote no load digest for rank {rank} of {checkpoint} "
                                  f"(patches/megatron/pretrain_qwen35.py writes it after loading)")
        state = resharded[rank] if resharded is not None else split_stacked_experts(_rank_state(directory, rank),
                                                                                    config.model.num_experts)
        loaded = read_digest(path)
        compare_loaded(loaded, state, what=f"Megatron rank {rank} ({path}) vs the checkpoint {checkpoint}",
                       rename=lambda name: names.get(name, name))
        verified += len(loaded)
    return verified
