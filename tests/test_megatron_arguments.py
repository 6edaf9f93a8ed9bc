"""Megatron-LM's own argument parsing and validation (``megatron/training/arguments.py``: ``parse_args``,
``validate_args``) accept the generated launch arguments at real layouts, as torchrun's first rank of
the job would see them, in the environment the run script gives it (``DETERMINISTIC_ENV``: Megatron's
``--deterministic-mode`` asserts ``NCCL_ALGO``, core_v0.16.1 ``megatron/training/arguments.py:1078``).

Needs a Megatron-LM checkout (MEGATRON_LM_PATH, a clone at tag core_v0.16.1 kept outside the
repository); skips naming it otherwise. The one stand-in: this machine has no GPU, so
``torch.cuda.get_device_capability`` and ``get_device_properties`` answer an H200's (9, 0), which
``validate_args`` asks for grouped GEMM (core_v0.16.1 ``megatron/training/arguments.py:852-854``) and
for TP or CP (``:927-928``, ``megatron/training/utils.py:446-448``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from crossalign.sides.megatron.backend import DETERMINISTIC_ENV
from crossalign.sides.megatron.args import megatron_args
from crossalign.config import load_config

CHECKOUT = os.environ.get("MEGATRON_LM_PATH")
pytestmark = pytest.mark.skipif(not CHECKOUT, reason="MEGATRON_LM_PATH is not set (a Megatron-LM checkout, "
                                                     "tag core_v0.16.1, kept outside the repository)")

VALIDATE = textwrap.dedent("""
    import json, sys
    import torch
    import types
    # the GPU's identity, answered as an H200's: grouped GEMM's assert and the TP/CP arch check ask it
    torch.cuda.get_device_capability = lambda *device: (9, 0)
    torch.cuda.get_device_properties = lambda *device: types.SimpleNamespace(major=9, minor=0, name="NVIDIA H200")
    args_file, result_file = sys.argv[1], sys.argv[2]
    sys.argv = ["pretrain_gpt.py", *json.load(open(args_file))]
    from megatron.training.arguments import parse_args, validate_args
    args = parse_args()
    validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})  # pretrain_gpt.py's args_defaults
    names = ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
             "expert_model_parallel_size", "expert_tensor_parallel_size", "context_parallel_size",
             "sequence_parallel", "data_parallel_size", "num_experts", "moe_router_topk", "mtp_num_layers",
             "num_layers", "global_batch_size", "micro_batch_size", "bf16")
    json.dump({name: getattr(args, name, None) for name in names}, open(result_file, "w"))
""")


def validated(args: list[str], world: int, tmp_path) -> dict:
    """What Megatron-LM's parse_args and validate_args make of ``args`` on rank 0 of ``world`` ranks."""
    args_file, result_file = tmp_path / "args.json", tmp_path / "result.json"
    args_file.write_text(json.dumps(args))
    env = {**os.environ, **DETERMINISTIC_ENV, "WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0",
           "PYTHONPATH": os.pathsep.join([CHECKOUT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", VALIDATE, str(args_file), str(result_file)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(result_file.read_text())


@pytest.mark.parametrize("name, layout, world, expected", [
    ("qwen35_moe", ["tensor=2", "pipeline=2", "expert=4", "sequence_parallel=true", "cards_per_node=8", "nodes=2"],
     16, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "expert_model_parallel_size": 4,
          "expert_tensor_parallel_size": 2, "data_parallel_size": 4, "sequence_parallel": True}),
    ("qwen35_dense", ["tensor=4", "pipeline=4", "sequence_parallel=true", "cards_per_node=8", "nodes=4"],
     32, {"tensor_model_parallel_size": 4, "pipeline_model_parallel_size": 4, "data_parallel_size": 2,
          "sequence_parallel": True}),
    ("qwen35_moe_tiny", ["expert=2", "expert_tensor=1", "cards_per_node=2"],
     2, {"expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1, "data_parallel_size": 2}),
])
def test_megatron_accepts_the_generated_arguments_of_a_layout(name, layout, world, expected, tmp_path):
    config = load_config(name, [f"parallel.megatron.{setting}" for setting in layout] +
                         ["training.global_batch_size=16"])
    args = megatron_args(config, data_prefix=tmp_path / "data" / "text_document", tokenizer=None, load_dir="/ckpt",
                         save_dir=tmp_path / "save", data_cache_dir=tmp_path / "cache")
    got = validated(args, world, tmp_path)
    m = config.model
    assert got["world_size"] == world
    assert {key: got[key] for key in expected} == expected
    assert (got["num_layers"], got["mtp_num_layers"], got["global_batch_size"]) == (m.num_layers, m.mtp_num_layers, 16)
    if m.is_moe:
        assert (got["num_experts"], got["moe_router_topk"]) == (m.num_experts, m.moe_router_topk)
