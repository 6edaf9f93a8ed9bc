"""What the MindFormers network held right after its load, held against the checkpoint it was given.

What the step checks does not rest on MindFormers' load messages: ``load_checkpoint`` loads only the
network's own names and never reports a checkpoint tensor the network lacks (2.1.0
``checkpoint/checkpoint.py: load_checkpoint``, its ``filter_func``), so a network built without its
shared experts would load "completely" and drop their weights. The converted-config readback
(``shared_expert_num`` included) and the built-model line (:func:`verify_built_model`) say the network
is the one the config describes; "Network parameters not loaded" still fails the run. And with the
mindformers-load-digest patch the trainer records every parameter it holds right after the load, before
the first step (``CROSSALIGN_LOAD_DIGEST_DIR``, one file per rank), which the align run holds against the
checkpoint it gave (:func:`verify_load_digest`): a missing, extra, renamed or different tensor fails the
step, named. Releases before
2.0.0 are refused (``training.mindformers_version``): r1.9.0's TrainConfig rejects the generated
parallelism and recompute keys and its LossCallback logs neither the MTP nor the aux loss.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path


from crossalign.config import AlignmentConfig
from crossalign.tensorio.errors import LoadDigestError




LOAD_DIGEST_DIR = "load_digest"  # what each rank's network held after the load (CROSSALIGN_LOAD_DIGEST_DIR)
LOAD_DIGEST_ENV = "CROSSALIGN_LOAD_DIGEST_DIR"
LOAD_DIGEST_PATCH = "mindformers-load-digest"


class _LoadedTensors(Mapping):
    """The checkpoint's weights and buffers, each read when asked for, as a weights-only load takes them.

    ``load_checkpoint`` without an optimizer (``no_load_optim: True``) loads the model file's copy of
    each tensor (2.1.0 checkpoint/checkpoint.py:597-600 keeps the network's own names): for a weight
    that also has an fp32 master ``main_param.<name>`` in the ``-opt-`` file that is the bf16 copy, so
    the masters are left out here and each name reads its own entry.
    """

    def __init__(self, checkpoint_dir: Path):
        # loads torch: the real backend imports this module on agents without torch
        from crossalign.sides.mindformers.checkpoint import MASTER_PREFIX, read_mindformers_checkpoint

        whole = read_mindformers_checkpoint(checkpoint_dir)
        self.checkpoint = replace(whole, entries={name: info for name, info in whole.entries.items()
                                                  if not name.startswith(MASTER_PREFIX)})
        self.names = sorted({**self.checkpoint.model_entries(), **self.checkpoint.buffer_entries()})

    def __getitem__(self, name: str):
        if name not in self.names:
            raise KeyError(name)
        return self.checkpoint.tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def _rank_records(digest_dir: Path, cards: int) -> dict[int, tuple[Path, dict[str, dict]]]:
    """Each rank's record (path, tensors); LoadDigestError naming the ranks that wrote none."""
    from crossalign.tensorio.digest import read_digest  # loads torch, which an agent may lack

    records = {rank: digest_dir / f"rank_{rank}.json" for rank in range(cards)}
    absent = [rank for rank, path in records.items() if not path.exists()]
    if absent:
        raise LoadDigestError(
            f"{digest_dir}: MindFormers wrote no load digest for rank(s) {', '.join(map(str, absent))} of {cards} "
            f"(Trainer.train() writes rank_<r>.json after the load when the {LOAD_DIGEST_PATCH} patch is applied: "
            f"crossalign patch apply --mindformers <checkout>)")
    return {rank: (path, read_digest(path)) for rank, path in records.items()}


def verify_load_digest(digest_dir: Path, checkpoint: Path, config: AlignmentConfig) -> int | None:
    """Hold what each rank's network held after the load against the checkpoint it was given.

    Every parameter of every rank (pipeline stages hold different ones, data-parallel replicas the
    same: a name on several ranks must have one digest) together must be exactly the checkpoint's
    weights and buffers, each with its values. A parameter may be held in another dtype than the
    checkpoint's: from 2.1.0 the pynative Linear and GroupedMLP are created in the compute dtype
    whatever params_dtype says (bf16 MLP, expert, output-layer and eh_proj weights), and a bf16
    checkpoint may go into fp32 parameters; the checkpoint's tensor is cast to the loaded dtype
    (round to nearest even, as MindFormers 2.1.0's load of an fp32 checkpoint into its bf16 parameters
    rounds: tests/test_mindformers_load_digest.py) before it is hashed.

    With tensor or expert parallelism a rank holds slices, which the record cannot place in the
    whole tensor: the names are still held against the checkpoint's (a missing, extra or renamed
    tensor fails), but no value is compared, and None is returned. Otherwise returns how many
    tensors were verified. Raises :class:`LoadDigestError` naming every problem.
    """
    from crossalign.tensorio.digest import compare_loaded  # loads torch, which an agent may lack

    layout = config.parallel.mindformers
    records = _rank_records(digest_dir, layout.world_size)
    loaded: dict[str, dict] = {}
    first: dict[str, int] = {}
    disagree = []
    for rank, (_, tensors) in records.items():
        for name, digest in tensors.items():
            if name not in loaded:
                loaded[name], first[name] = digest, rank
            elif (digest["sha256"], list(digest["shape"])) != (loaded[name]["sha256"], list(loaded[name]["shape"])):
                disagree.append(f"{name} (rank {first[name]} and rank {rank})")
    sharded = layout.tensor > 1 or layout.expert > 1
    if disagree and not sharded:
        raise LoadDigestError(f"{digest_dir}: ranks hold different values of {len(disagree)} tensor(s) after the "
                              f"load: {', '.join(disagree[:8])}")
    tensors = _LoadedTensors(checkpoint)
    what = f"MindFormers ({digest_dir}, {len(records)} rank(s)) vs the checkpoint {checkpoint}"
    if sharded:  # names only: each side's shape and hash are taken as they are
        compare_loaded(loaded, {name: name for name in tensors.names}, what=what,
                       shape_of=lambda name: tuple(loaded[name]["shape"]), hash_in=lambda _, digest: digest["sha256"])
        return None
    compare_loaded(loaded, tensors, what=what)
    return len(loaded)
