"""Pins the tensors that ms2mg and mg2ms write today, so a rewrite of the conversion paths stays bit-exact.

The digests below were produced once with the in-memory/streaming code of commit 5e6384f by
running this file's ``_digests`` helpers (``PIN_PRINT=1 pytest tests/test_checkpoint_convert_pins.py -s``
prints them). Each digest is sha256 over the sorted keys of one output, each key's name, dtype,
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
from crossalign.models.layout import random_mindformers_state
from crossalign.sides.mindformers.checkpoint import default_common, read_mindformers_checkpoint, write_mindformers_checkpoint

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
    write_mindformers_checkpoint(root, 4, random_mindformers_state(MOE, seed=21), None, default_common(4, 4))
    return root


def _show(name, value):
    if os.environ.get("PIN_PRINT"):
        print(name, value)


PINS_MS2MG_TP2_PP2_EP2: dict[str, str] = {
    "mp_rank_00_000_000": "33650e63ae6091e618d19a2cce7aca2ba2199a88c83da35829c2c2f910786d71",
    "mp_rank_00_000_001": "239c02b16c4be8590b15d903ad94a1d88eb85b67ea0635c3b1c5728b78df9e20",
    "mp_rank_00_001_000": "f05a90da81405c3f2b18fb7102a3c93e4c33e49905131c07aa7ef0dd7819e109",
    "mp_rank_00_001_001": "56af6717357d7446ce632dd4cf49069c8190f520a6fae7af6e34645169b6134f",
    "mp_rank_01_000_000": "89b750058cc3d1845a95b10cd87c7ed79536c72fcb5c6aea01b8c84ef042d2fc",
    "mp_rank_01_000_001": "4e06b1a90f4f030508558d0002550b3dadc7aaa87f6d02b9081ac3ab7dae8718",
    "mp_rank_01_001_000": "451c5db2b3671614c73d195129c76a21cfcab8a93a989fb05734c993b120d4ca",
    "mp_rank_01_001_001": "11a716b09cf2f24d81168288f6b62e984897236540c94205fe597b1d8b7598c4",
}
PIN_MG2MS_FROM_TP2_PP2_EP2 = "36e1762f1d082e47ad65c8a8eb8f5578df164bde1cbb71bf5dc59ddd09da9602"  # the same as from torch_dist
PIN_MG2MS_FROM_TORCH_DIST = "36e1762f1d082e47ad65c8a8eb8f5578df164bde1cbb71bf5dc59ddd09da9602"


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
