"""Runs the mindformers-msprobe-dump patch's own code around steps of a MindFormers module, under real msprobe.

Started by tests/test_mindformers_msprobe_dump.py in a subprocess whose PYTHONPATH starts with an unpacked
MindFormers wheel and the ``hyper_parallel`` stand-in. The patched trainer.py's ``Trainer._crossalign_msprobe_begin``
and ``_crossalign_msprobe_end`` are called around each step, as the patched ``_inner_train_loop`` calls them, on a
stand-in trainer whose ``model`` is the list of stages. (A whole Trainer.train() needs NPU kernels; the step is a
forward and backward of MindFormers' own pynative gated MLP in fp32, the part of its model that runs on CPU, as
tests/helpers/mindformers_driver.py ``modules_task`` runs it.) On CPU msprobe's norm statistic needs
crossalign's stand-in (``crossalign/sides/mindformers/dump.py``), which an NPU run does not.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mindformers_driver import convert, patched_trainer, public  # noqa: E402


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    import mindspore as ms
    import numpy as np
    from mindformers.pynative.layers.linear import Linear
    from mindformers.pynative.transformers.mlp import MLP, MLPSubmodules

    from crossalign.sides.mindformers.dump import msprobe_norm_on_cpu

    patched = patched_trainer(job["trainer"])
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    model = public({**yaml.safe_load(Path(job["yaml"]).read_text())["model"], "compute_dtype": "float32"})
    mlp = MLP(convert(model, Path(job["log"])), MLPSubmodules(linear_fc1=Linear, linear_fc2=Linear))
    trainer = SimpleNamespace(model=[mlp])
    grad = ms.value_and_grad(lambda x: mlp(x).sum(), None, mlp.trainable_params())
    os.environ["CROSSALIGN_MSPROBE_CONFIG"] = job["config"]
    os.environ["CROSSALIGN_MSPROBE_RECORD"] = job["record"]
    outputs = []
    with msprobe_norm_on_cpu():
        for step in range(job["steps"]):
            x = ms.Tensor(np.random.default_rng(step).standard_normal((2, 3, model["hidden_size"]), np.float32))
            patched.Trainer._crossalign_msprobe_begin(trainer)
            _, grads = grad(x)
            outputs.append(float(mlp(x).sum().asnumpy()))
            patched.Trainer._crossalign_msprobe_end(trainer)
    Path(job["result"]).write_text(json.dumps({"fc1_norm": float(np.linalg.norm(mlp.linear_fc1.weight.asnumpy())),
                                               "sums": outputs}))


if __name__ == "__main__":
    main()
