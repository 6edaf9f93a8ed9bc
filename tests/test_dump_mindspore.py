"""msprobe's own MindSpore PyNative dump on CPU, with the one stand-in it needs there (crossalign/sides/mindformers/dump.py
replaces msprobe's ``mint.norm`` statistic, whose kernel LinalgVectorNorm MindSpore's CPU backend lacks)."""

import json
import subprocess
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

from crossalign.dump_settings import DumpSettings
from crossalign.sides.mindformers.dump import msprobe_norm_on_cpu


class _Tiny(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Dense(4, 3)
        self.fc2 = nn.Dense(3, 2)

    def construct(self, x):
        return self.fc2(self.fc1(x))


def _dump_one_step(tmp_path):
    from msprobe.mindspore import PrecisionDebugger  # heavy: msprobe's MindSpore side loads its hooks on import

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(DumpSettings(step=0).msprobe_config(tmp_path / "dump")))
    debugger = PrecisionDebugger(config_path=str(config))
    net = _Tiny()
    x = ms.Tensor(np.arange(8, dtype=np.float32).reshape(2, 4))
    debugger.start(net)
    net(x)
    debugger.stop()
    debugger.step()
    # Without a communication group msprobe names the rank folder proc{pid} (rank{R} under distributed runs).
    (dump_json,) = (tmp_path / "dump" / "step0").glob("*/dump.json")
    return net, x, dump_json


def test_statistics_dump_on_cpu_with_the_norm_stand_in(tmp_path):
    with msprobe_norm_on_cpu():
        net, x, dump_json = _dump_one_step(tmp_path)
    data = json.loads(dump_json.read_text())["data"]
    fc1_forward = data["Cell.fc1.Dense.forward.0"]
    out = fc1_forward["output"][0]
    expected = net.fc1(x).asnumpy()
    assert out["Max"] == pytest.approx(float(expected.max()), rel=1e-5)
    assert out["Norm"] == pytest.approx(float(np.linalg.norm(expected)), rel=1e-5)


def test_without_the_stand_in_msprobe_fails_on_cpu(tmp_path):
    """What the stand-in replaces: msprobe's own mint.norm, whose kernel MindSpore's CPU backend lacks. msprobe's
    PrecisionDebugger is one per process (msprobe/core/dump/debugger/precision_debugger.py:27-38), so the bare dump
    runs in a process of its own."""
    script = (
        "import sys, pathlib; sys.path.insert(0, sys.argv[1]); import test_dump_mindspore as t; "
        "t._dump_one_step(pathlib.Path(sys.argv[2]))"
    )
    done = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "The kernel LinalgVectorNorm unregistered" in done.stderr
