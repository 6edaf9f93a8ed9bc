"""The conversion rules' outputs, pinned: ms2mg, mg2ms and the HF import keep their exact tensor contents.

The digests below are tensor-content digests (key, dtype, shape and bytes of every output tensor, in key
order) of the conversion of the seeded tiny checkpoints, computed with the rule tables as they stood before
the MindFormers / Megatron / Hugging Face rules were merged into one table. A change to any rule's
transform, key or output order shows here.
"""

import hashlib

import pytest
import torch
from helpers.hf_tiny import make_hf_checkpoint

from crossalign.checkpoint.convert import convert_state
from crossalign.checkpoint.hf import read_hf_checkpoint
from crossalign.config import load_config
from crossalign.models.layout import random_mindformers_state

CONFIGS = {"dense": load_config("qwen35_dense_tiny").model, "moe": load_config("qwen35_moe_tiny").model}

# computed with the code before the rule tables were merged; see the module docstring
DIGESTS = {
    "dense": {
        "ms2mg/0.16.1/per_expert": "ac18d3e2235c4eabe0291350a93b63094b188b8d5b148a0749ddb7c696e9c7c0",
        "mg2ms/0.16.1/per_expert": "948d031c7a3d4d5b9a5a30887d6d065ab6d15a028263b6f4379c8c19d568612d",
        "ms2mg/0.16.1/stacked": "ac18d3e2235c4eabe0291350a93b63094b188b8d5b148a0749ddb7c696e9c7c0",
        "mg2ms/0.16.1/stacked": "948d031c7a3d4d5b9a5a30887d6d065ab6d15a028263b6f4379c8c19d568612d",
        "ms2mg/0.17.0/per_expert": "3f8288c6c51d0b11659a8fd5627d16fa082f398dc936e75f2ecacc9de99f60de",
        "mg2ms/0.17.0/per_expert": "948d031c7a3d4d5b9a5a30887d6d065ab6d15a028263b6f4379c8c19d568612d",
        "ms2mg/0.17.0/stacked": "3f8288c6c51d0b11659a8fd5627d16fa082f398dc936e75f2ecacc9de99f60de",
        "mg2ms/0.17.0/stacked": "948d031c7a3d4d5b9a5a30887d6d065ab6d15a028263b6f4379c8c19d568612d",
        "hf2mg/0.16.1/stacked": "2a6bf2603721154fbd4b5c64f225b9ec5d6516e6a06e522dcfa599b3e83873dd",
        "hf2mg/0.17.0/per_expert": "54152318875a61781baee724a0d12ed79d95bab9b2e2c074ca6ccb6d85b920d4",
        "hf2ms": "31b756625eb4e5580755a575e220502abdd51b09df8d5e476f4a90a9527a0d6b",
        "mg2hf": "13a9a7ca5b2d53b76694adb4deac7a479624e11f434b3e9eba6f5b153ba6a5ae",
    },
    "moe": {
        "ms2mg/0.16.1/per_expert": "d2efe3a317b87e9986fac3f28998153fb19ab72055e54878a5b622c8eed76298",
        "mg2ms/0.16.1/per_expert": "95afd6cf137579b61ce61158a5a0a20c71d91e34ba04718fcacdb865ceb1fa40",
        "ms2mg/0.16.1/stacked": "5105be329703c2c9b466c51bbbe7a2d41df7e59ff02b367c9e0e271fc1209329",
        "mg2ms/0.16.1/stacked": "95afd6cf137579b61ce61158a5a0a20c71d91e34ba04718fcacdb865ceb1fa40",
        "ms2mg/0.17.0/per_expert": "b504f82231731baabcef61fcda7dd371690b74801122003cccdcecf8b44c023b",
        "mg2ms/0.17.0/per_expert": "95afd6cf137579b61ce61158a5a0a20c71d91e34ba04718fcacdb865ceb1fa40",
        "ms2mg/0.17.0/stacked": "a3e4eb9efeb42820c729c9f043bde2cc424427796f13cd64dcfe99465dda5c78",
        "mg2ms/0.17.0/stacked": "95afd6cf137579b61ce61158a5a0a20c71d91e34ba04718fcacdb865ceb1fa40",
        "hf2mg/0.16.1/stacked": "157fcaea0cc226e8654eb8a82314acad2b50ab4735bf20a3290ed9f65f989669",
        "hf2mg/0.17.0/per_expert": "fcf8e45c605d14b7be16c2033abf44c1a5500391792897f847f7bddaa690ef20",
        "hf2ms": "e93ccec458eb18906f13da6abd3771b7001c867419de953700745c411715fc40",
        "mg2hf": "3ebcd13b03c46baf8a534bf1d83be138ef524b0a6b673b8eaa7c79808b1b6ccc",
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
    ms = random_mindformers_state(model, seed=21)
    out = {}
    for core in ("0.16.1", "0.17.0"):
        for experts in ("per_expert", "stacked"):
            mg = convert_state(ms, model, "ms2mg", core, experts)
            out[f"ms2mg/{core}/{experts}"] = _digest(mg)
            out[f"mg2ms/{core}/{experts}"] = _digest(convert_state(mg, model, "mg2ms", core))
    source = read_hf_checkpoint(make_hf_checkpoint(tmp_path / "hf", kind))
    hf = {key: source.tensor(key) for key in source.entries}
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
