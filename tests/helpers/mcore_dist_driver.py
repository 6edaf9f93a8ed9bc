"""megatron-core's own dist_checkpointing on a torch_dist checkpoint, in a process group of a given layout.

    python tests/helpers/mcore_dist_driver.py CONFIG FREQ SOURCE CHECKPOINT SAVE CORE TP PP EP ETP

Each of the TP x PP x (EP x ETP / TP) gloo processes builds megatron-core's GPTModel at the
layout, loads CHECKPOINT (an iteration folder) with ``dist_checkpointing.load`` and a strict
``load_state_dict``, and checks every parameter bit for bit against the shard that crossalign's
legacy layout rules cut for its rank from the MindFormers SOURCE converted in memory; then
megatron-core saves the model from that layout into SAVE. The megatron-core that runs is the
one first on PYTHONPATH (the test puts 0.17.0's folder there); FREQ overrides the config's
``linear_attention_freq`` (1: megatron-core stacks the layers under one key).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.mcore_dist import load_sharded, save_sharded  # noqa: E402


def _rank(rank: int, world: int, args: list[str], rendezvous: str) -> None:
    from megatron.core import __version__

    from crossalign.checkpoint.convert import mindformers_to_megatron
    from crossalign.config import MegatronParallel, load_config
    from crossalign.sides.megatron.embedded.mcore_cpu import CudaLiteralsToCpu, ProcessGroup, megatron_core_on_cpu
    from crossalign.sides.megatron.embedded.mcore_model import Shard, build_gpt_model, load_converted_state
    from crossalign.sides.mindformers.checkpoint import read_mindformers_checkpoint

    config_name, freq, source, checkpoint, save, core = args[:6]
    tp, pp, ep, etp = (int(x) for x in args[6:10])
    if __version__ != core:
        raise SystemExit(f"megatron-core {__version__} is first on the path, not {core}")
    config = load_config(config_name)
    model = type(config.model).model_validate({**config.model.model_dump(), "linear_attention_freq": int(freq)})
    state = read_mindformers_checkpoint(Path(source))
    full = mindformers_to_megatron({key: state.tensor(key) for key in state.model_entries()}, model, core)
    sizes = dict(tensor=tp, pipeline=pp, expert=ep, expert_tensor=etp)
    layout = MegatronParallel(**sizes, cards_per_node=world)
    with megatron_core_on_cpu(1, ProcessGroup(rank, world, rendezvous, **sizes)):
        with CudaLiteralsToCpu():  # the pipeline's stages share the MTP embedding with .cuda()
            loaded = build_gpt_model(model, config.training, bf16=True, layout=layout).to(torch.bfloat16)
            expected = build_gpt_model(model, config.training, bf16=True, layout=layout).to(torch.bfloat16)
        load_sharded(loaded, Path(checkpoint), model, core)
        load_converted_state(expected, full, model, core, Shard.of_this_process(layout))
        got, want = loaded.state_dict(), expected.state_dict()
        differ = [key for key in want if not key.endswith("_extra_state") and not torch.equal(got[key], want[key])]
        if differ:
            raise AssertionError(f"rank {rank}: megatron-core {core} loaded {differ[:5]} differently from "
                                 "crossalign's legacy shards")
        save_sharded(loaded, Path(save), model, core)


def main() -> None:
    args = sys.argv[1:]
    tp, pp, ep, etp = (int(x) for x in args[6:10])
    world = tp * pp * max(1, ep * etp // tp)
    Path(args[4]).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as meeting:
        mp.spawn(_rank, nprocs=world, join=True, args=(world, args, f"file://{meeting}/rendezvous"))


if __name__ == "__main__":
    main()
