"""The conversion rules' outputs, pinned: ms2mg, mg2ms and the HF import keep their exact tensor contents.

The digests below are tensor-content digests (key, dtype, shape and bytes of every output tensor, in key
order) of the conversion of the seeded tiny checkpoints, computed with the conversion code of commit 7ca8fb6.
The values of both sources are ``helpers/portable_state.py``'s, whose bits are the same on every machine.
A change to any rule's transform, key or output order shows here.
"""

import hashlib

import pytest
import torch
from helpers.hf_tiny import make_hf_checkpoint
from helpers.portable_state import portable_mindformers_state, portable_values

from crossalign.checkpoint.convert import convert_state
from crossalign.checkpoint.hf import read_hf_checkpoint
from crossalign.config import load_config

CONFIGS = {"dense": load_config("qwen35_dense_tiny").model, "moe": load_config("qwen35_moe_tiny").model}

# see the module docstring
DIGESTS = {
    "dense": {
        "ms2mg/0.16.1/per_expert": "a3cd99b12277695696367e381c64580bd1d73a7d9ce4b93838344bdd29b80a88",
        "mg2ms/0.16.1/per_expert": "53184d6400ff7ea89e45b06e40aeef6dc97be198b6346a68bbf916bf05619198",
        "ms2mg/0.16.1/stacked": "a3cd99b12277695696367e381c64580bd1d73a7d9ce4b93838344bdd29b80a88",
        "mg2ms/0.16.1/stacked": "53184d6400ff7ea89e45b06e40aeef6dc97be198b6346a68bbf916bf05619198",
        "ms2mg/0.17.0/per_expert": "d6762b4817f322f2ebc90f846366a1bd46b01a42c8360f38521f811949809fa3",
        "mg2ms/0.17.0/per_expert": "53184d6400ff7ea89e45b06e40aeef6dc97be198b6346a68bbf916bf05619198",
        "ms2mg/0.17.0/stacked": "d6762b4817f322f2ebc90f846366a1bd46b01a42c8360f38521f811949809fa3",
        "mg2ms/0.17.0/stacked": "53184d6400ff7ea89e45b06e40aeef6dc97be198b6346a68bbf916bf05619198",
        "hf2mg/0.16.1/stacked": "e8f9f2f9a343483d0776343e5642f7f6dde8577e5f97f33f98c7de6501f77d60",
        "hf2mg/0.17.0/per_expert": "48c24bf364ff02764006704fbf1b752293923da275bcd7e2c32e9cb8f4b4503a",
        "hf2ms": "331e53548b608e5dbe3f490fbdaeb252412290331cdd631d80a777d4d8738f93",
        "mg2hf": "dc3f16569da8e88611e4132c91892bca09deae18a8f5bd48c1e5ca7c2f193c8d",
    },
    "moe": {
        "ms2mg/0.16.1/per_expert": "ca17c39983b8fed78a6498c380a79422bcadfc5a954c07f1c342d58a200bd806",
        "mg2ms/0.16.1/per_expert": "4d86a46253fa55572ffecfef0dd9884609564df833e37ce358fc6d9e6f730c5b",
        "ms2mg/0.16.1/stacked": "0070b9153165ff3c29f9e9223a415df3f1d4d2a3eeb59eceeccb76b5eacef95e",
        "mg2ms/0.16.1/stacked": "4d86a46253fa55572ffecfef0dd9884609564df833e37ce358fc6d9e6f730c5b",
        "ms2mg/0.17.0/per_expert": "adc196d7dd3170b910cee06e10f826d2d6e493b858dfa7b0c3be69c7c1d0bd85",
        "mg2ms/0.17.0/per_expert": "4d86a46253fa55572ffecfef0dd9884609564df833e37ce358fc6d9e6f730c5b",
        "ms2mg/0.17.0/stacked": "97ca5fe8ee3de3a57d16c3e158d660ed8973022c085dff666c43b70df9894452",
        "mg2ms/0.17.0/stacked": "4d86a46253fa55572ffecfef0dd9884609564df833e37ce358fc6d9e6f730c5b",
        "hf2mg/0.16.1/stacked": "d3510b0139866457fc2e5aaaa9361078b24aaec92159137a550f52c21b019029",
        "hf2mg/0.17.0/per_expert": "4a712316e620b00f931fc2d89274ca740127111a025c8eceadbec77b583d81e2",
        "hf2ms": "62aa110fc6d707f73699bc26380af34324bbc51a4d14ae9155bbb9a46c4bbe22",
        "mg2hf": "894c64b1932acc77325ae375f31b04cec4cc192522c3a81578966e8a7a5c136a",
    },
}


def _digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(state):
        tensor = state[key].contiguous()
        h.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        h.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return h.hexdigest()


def _outputs(kind: str, tmp_path) -> dict[str, str]:
    model = CONFIGS[kind]
    ms = portable_mindformers_state(model, seed=21)
    out = {}
    for core in ("0.16.1", "0.17.0"):
        for experts in ("per_expert", "stacked"):
            mg = convert_state(ms, model, "ms2mg", core, experts)
            out[f"ms2mg/{core}/{experts}"] = _digest(mg)
            out[f"mg2ms/{core}/{experts}"] = _digest(convert_state(mg, model, "mg2ms", core))
    source = read_hf_checkpoint(make_hf_checkpoint(tmp_path / "hf", kind))
    hf = portable_values({key: source.tensor(key) for key in source.entries}, seed=22)
    hf_mg = convert_state(hf, model, "hf2mg", "0.16.1", "stacked")
    out["hf2mg/0.16.1/stacked"] = _digest(hf_mg)
    out["hf2mg/0.17.0/per_expert"] = _digest(convert_state(hf, model, "hf2mg", "0.17.0", "per_expert"))
    out["hf2ms"] = _digest(convert_state(hf_mg, model, "mg2ms"))
    assert _digest(convert_state(hf, model, "hf2ms")) == out["hf2ms"]  # the same, through Megatron in one call
    out["mg2hf"] = _digest(convert_state(convert_state(ms, model, "ms2mg", experts="stacked"), model, "mg2hf"))
    assert _digest(convert_state(ms, model, "ms2hf")) == out["mg2hf"]
    return out


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_conversions_of_the_tiny_checkpoints_keep_their_tensor_digests(kind, tmp_path):
    assert _outputs(kind, tmp_path) == DIGESTS[kind]
