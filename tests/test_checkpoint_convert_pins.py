"""Pins the tensors that ms2mg and mg2ms write today, so a rewrite of the conversion paths stays bit-exact.

The digests below were produced with the conversion code of commit 7ca8fb6 (``PIN_PRINT=1 pytest
tests/test_checkpoint_convert_pins.py -s`` prints them), from a source whose bits are the same on every machine
(``helpers/portable_state.py``: torch's CPU ``normal_`` differs in its last bits between vector instruction sets). Each digest is sha256 over the sorted keys of one output, each key's name, dtype,
shape and raw bytes: tensor contents, not file bytes, so a different but equivalent file writer
still matches. Layouts: ms2mg into TP 2 x PP 2 x EP 2 (legacy torch files), mg2ms back from that
layout, and mg2ms from a torch_dist checkpoint.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

from crossalign.checkpoint.convert import convert_checkpoint
from crossalign.config import load_config
from crossalign.sides.mindformers.checkpoint import default_common, read_mindformers_checkpoint, write_mindformers_checkpoint
from tests.helpers.portable_state import portable_mindformers_state

MOE = load_config("qwen35_moe_tiny").model


def _digest(state: dict) -> str:
    h = hashlib.sha256()
    for key in sorted(k for k, v in state.items() if isinstance(v, torch.Tensor)):
        t = state[key].detach().contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _megatron_digests(out: Path) -> dict[str, str]:
    return {f.parent.name: _digest(torch.load(f, weights_only=True)["model"])
            for f in sorted((out / "iter_0000004").glob("*/model_optim_rng.pt"))}


def _mindformers_digest(out: Path) -> str:
    ckpt = read_mindformers_checkpoint(out)
    return _digest({k: ckpt.tensor(k) for k in ckpt.entries})


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("ms")
    write_mindformers_checkpoint(root, 4, portable_mindformers_state(MOE, seed=21), None, default_common(4, 4))
    return root


def _show(name, value):
    if os.environ.get("PIN_PRINT"):
        print(name, value)


PINS_MS2MG_TP2_PP2_EP2: dict[str, str] = {
    "mp_rank_00_000_000": "036094f236589daaf4ef5b5de436f942c3ab0b328880e97369ee7661572d2a52",
    "mp_rank_00_000_001": "4fb43b0b7526bfe8b59cf924d6a688f61b47556bafbf6bebe24c28abbe7def76",
    "mp_rank_00_001_000": "18bb0890d582420e579cb412a075bd7b79f2c3ea6a1c794dea1383c4f3676531",
    "mp_rank_00_001_001": "c29ae1d2e4ba5a820740856f9760020039f23a8f37b1404aa8b0229acc895864",
    "mp_rank_01_000_000": "5a37ed1d99730ed4b8228b90bda0521f95760b1f2eca77b882e6b047b2b77e6a",
    "mp_rank_01_000_001": "3683a7a3c2ba0fc3f07d1896d592675f27238b914328cff22a27cb2f6cd2f1a1",
    "mp_rank_01_001_000": "c762ad037792117a27af2067f60846b9d1a05d96ffac80c40b8025cf2c264c76",
    "mp_rank_01_001_001": "8c5d1bedf9c8b2b25f77bf1da09138bd5074249d6675742af7267ac4041605e4",
}
PIN_MG2MS_FROM_TP2_PP2_EP2 = "fcdb68262d4bd46b6f2f2fb8ff61891d7db90ca976adbcd69e8b20b65ce7e86c"  # the same as from torch_dist
PIN_MG2MS_FROM_TORCH_DIST = "fcdb68262d4bd46b6f2f2fb8ff61891d7db90ca976adbcd69e8b20b65ce7e86c"


def test_ms2mg_into_tp2_pp2_ep2_and_back_is_bit_exact(tmp_path, source):
    out = tmp_path / "mg"
    convert_checkpoint(MOE, "ms2mg", source, out, tp=2, pp=2, ep=2)
    ranks = _megatron_digests(out)
    _show("PINS_MS2MG_TP2_PP2_EP2", ranks)
    assert len(ranks) == 8
    assert ranks == PINS_MS2MG_TP2_PP2_EP2
    convert_checkpoint(MOE, "mg2ms", out, tmp_path / "ms")
    back = _mindformers_digest(tmp_path / "ms")
    _show("PIN_MG2MS_FROM_TP2_PP2_EP2", back)
    assert back == PIN_MG2MS_FROM_TP2_PP2_EP2


def test_mg2ms_from_torch_dist_is_bit_exact(tmp_path, source):
    out = tmp_path / "mg"
    convert_checkpoint(MOE, "ms2mg", source, out, ckpt_format="torch_dist")
    convert_checkpoint(MOE, "mg2ms", out, tmp_path / "ms")
    back = _mindformers_digest(tmp_path / "ms")
    _show("PIN_MG2MS_FROM_TORCH_DIST", back)
    assert back == PIN_MG2MS_FROM_TORCH_DIST


@pytest.mark.parametrize("experts_per_chunk", [1, 3])
def test_experts_converted_a_chunk_at_a_time_give_the_same_bits(tmp_path, source, monkeypatch, experts_per_chunk):
    """The real model's experts go a chunk at a time (``expert_chunks.py``); here chunks of 1 and of 3 of the
    tiny model's 4 experts (the last one short), both ways, must give the pinned tensors."""
    from crossalign.checkpoint import expert_chunks

    fc1 = read_mindformers_checkpoint(source).entries["decoder.layers.0.mlp.experts.weight1"]
    monkeypatch.setattr(expert_chunks, "CHUNK_BYTES", experts_per_chunk * fc1.nbytes // MOE.num_experts)
    out = tmp_path / "mg"
    convert_checkpoint(MOE, "ms2mg", source, out, tp=2, pp=2, ep=2)
    assert _megatron_digests(out) == PINS_MS2MG_TP2_PP2_EP2
    convert_checkpoint(MOE, "mg2ms", out, tmp_path / "ms")
    assert _mindformers_digest(tmp_path / "ms") == PIN_MG2MS_FROM_TP2_PP2_EP2
