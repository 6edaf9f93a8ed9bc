"""The two embedded reference models side by side: one batch, each model built and loaded, one forward each.

The self-check and the layer-by-layer diagnosis both run the MindSpore model on the
MindFormers checkpoint and the PyTorch model on the converted Megatron checkpoint with the
same tokens; this module holds that shared part. Frameworks are imported on first use.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from crossalign.config import AlignmentConfig, ModelConfig


class SideError(ValueError):
    """A side that cannot run: its checkpoint does not load into its model, or the batch is unusable."""


@dataclass(frozen=True)
class Batch:
    """One batch for both sides: int64 input_ids and labels [B, T], float32 loss_mask [B, T] (numpy)."""

    input_ids: np.ndarray
    labels: np.ndarray
    loss_mask: np.ndarray
    source: str

    @classmethod
    def from_tokens(cls, tokens: np.ndarray, source: str) -> "Batch":
        """tokens [B, T+1]: inputs [:, :-1], labels [:, 1:], every position counts."""
        tokens = np.asarray(tokens, dtype=np.int64)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        return cls(np.ascontiguousarray(inputs), np.ascontiguousarray(labels),
                   np.ones(inputs.shape, dtype=np.float32), source)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)  # type: ignore[return-value]


def random_batch(model: ModelConfig, seq: int, batch: int, seed: int = 1234) -> Batch:
    """Uniform random token ids below vocab_size, reproducible from the seed."""
    if seq < 1 or batch < 1:
        raise SideError(f"batch {batch} x seq {seq}: both must be at least 1")
    rng = np.random.default_rng(seed)
    return Batch.from_tokens(rng.integers(0, model.vocab_size, size=(batch, seq + 1)),
                             f"random tokens (seed {seed})")


def dataset_batch(config: AlignmentConfig, prefix: Path, seq: int, batch: int) -> Batch:
    """The first ``batch`` samples of global batch 0 as Megatron reads them, cut to ``seq`` tokens."""
    from crossalign.sides.registry import batches_for

    prefix = Path(prefix)
    if prefix.is_dir():
        found = sorted(prefix.glob("*.idx"))
        if len(found) != 1:
            raise SideError(f"{prefix}: expected exactly one indexed dataset (*.idx) in the folder, found {len(found)}")
        prefix = found[0].with_suffix("")
    if seq > config.training.seq_length:
        raise SideError(f"seq {seq} is longer than the dataset samples (training.seq_length "
                        f"{config.training.seq_length})")
    if batch > config.training.global_batch_size:
        raise SideError(f"batch {batch} exceeds the global batch size {config.training.global_batch_size}")
    tokens = batches_for("megatron", config.training, prefix)[0][:batch, : seq + 1]
    return Batch.from_tokens(tokens, f"first batch of {prefix}")


def make_batch(config: AlignmentConfig, seq: int | None, batch: int | None, data: Path | None,
               seed: int) -> Batch:
    """The batch both sides run: the config's sizes by default, random tokens unless a dataset is given."""
    seq = seq or config.training.seq_length
    batch = batch or config.training.micro_batch_size
    if data is not None:
        return dataset_batch(config, Path(data), seq, batch)
    return random_batch(config.model, seq, batch, seed)


@dataclass
class Outputs:
    """The four outputs of the forward contract, as float64 numpy (logits [B,T,V], scalars, mtp [n])."""

    logits: np.ndarray
    lm_loss: float
    mtp_losses: np.ndarray
    aux_loss: float


# ---- MindSpore -------------------------------------------------------------------------------------


def build_mindspore(model: ModelConfig, state: Mapping[str, Any]) -> Any:
    """The MindSpore reference model with ``state`` (MindFormers names) loaded strictly."""
    from crossalign.models.ms_model import Qwen35Model, load_mindformers_state

    net = Qwen35Model(model)
    net.set_train(False)
    try:
        load_mindformers_state(net, state)
    except ValueError as exc:
        raise SideError(f"MindSpore load: {exc}") from None
    return net


def run_mindspore(net: Any, batch: Batch) -> Outputs:
    import mindspore as ms

    logits, lm_loss, mtp, aux = net(ms.Tensor(batch.input_ids), ms.Tensor(batch.labels), ms.Tensor(batch.loss_mask))
    return Outputs(logits=logits.asnumpy().astype(np.float64), lm_loss=float(lm_loss.asnumpy()),
                   mtp_losses=mtp.asnumpy().astype(np.float64).reshape(-1), aux_loss=float(aux.asnumpy()))


# ---- PyTorch (Megatron layout) -----------------------------------------------------------------------


def build_megatron(model: ModelConfig, state: Mapping[str, Any], core_version: str, *,
                   strict: bool = True) -> tuple[Any, list[str]]:
    """The PyTorch reference model with a Megatron ``state`` loaded; returns (net, load problems).

    strict: any missing, unexpected or misshaped key raises :class:`SideError` naming them.
    Lenient (what Megatron itself does after its strict load fails): loadable keys are loaded,
    the rest keep their seeded initial values, and the problems are returned.
    """
    import torch

    from crossalign.models.torch_model import Qwen35Model, load_megatron_state

    torch.manual_seed(0)
    net = Qwen35Model(model, core_version=core_version)
    net.eval()
    try:
        load_megatron_state(net, state)
        return net, []
    except ValueError as exc:
        if strict:
            raise SideError(f"Megatron load: {exc}") from None
        return net, [str(exc), *_load_fitting(net, state)]


def _load_fitting(net: Any, state: Mapping[str, Any]) -> list[str]:
    """Load every key whose shape fits (after stacked experts are split), skip the rest; name what was skipped."""
    from crossalign.models.layout import unstack_expert_weights

    expected = net.state_dict()
    incoming = {k: v for k, v in state.items() if not k.endswith("._extra_state")}
    experts = net.config.num_experts
    if experts is not None:
        for key in list(incoming):
            if key.endswith((".mlp.experts.linear_fc1.weight", ".mlp.experts.linear_fc2.weight")):
                unstack_expert_weights(incoming, key[: -len("weight")], experts)
    fitting = {k: v.float() for k, v in incoming.items()
               if k in expected and tuple(v.shape) == tuple(expected[k].shape)}
    net.load_state_dict(fitting, strict=False)
    kept = sorted(set(expected) - set(fitting))
    skipped = sorted(set(incoming) - set(fitting))
    notes = []
    if kept:
        notes.append(f"kept at their initial values (as Megatron does after load_return): {', '.join(kept)}")
    if skipped:
        notes.append(f"not loaded: {', '.join(skipped)}")
    return notes


def run_megatron(net: Any, batch: Batch) -> Outputs:
    import torch

    with torch.no_grad(), warnings.catch_warnings():
        # flash-linear-attention says on import that it falls back to CPU: expected here.
        warnings.filterwarnings("ignore", message="Triton is not supported")
        logits, lm_loss, mtp, aux = net(torch.from_numpy(batch.input_ids), torch.from_numpy(batch.labels),
                                        torch.from_numpy(batch.loss_mask))
    return Outputs(logits=logits.double().numpy(), lm_loss=float(lm_loss), mtp_losses=mtp.double().numpy().reshape(-1),
                   aux_loss=float(aux))
