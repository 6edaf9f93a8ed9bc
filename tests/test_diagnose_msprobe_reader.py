"""crossalign reads msprobe's dump.json in every mode users take, from dumps msprobe itself wrote."""

import json
import shutil

import numpy as np
import pytest

from crossalign.diagnose.msprobe_dump import MsprobeDumpError, read_dump
from tests.helpers.msprobe_dumps import torch_dump_subprocess

pytest.importorskip("msprobe")

MODES = [("statistics", "L0"), ("md5", "L0"), ("tensor", "L0"), ("statistics", "mix")]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """(task, level) -> dump root, each written once by msprobe from the torch reference model."""
    root = tmp_path_factory.mktemp("msprobe")
    return {(task, level): torch_dump_subprocess("qwen35_dense_tiny", root / f"{task}_{level}", task, level)
            for task, level in MODES}


@pytest.mark.slow
@pytest.mark.parametrize("task,level", MODES)
def test_every_mode_reads_forward_backward_and_parameter_grads(dumps, task, level):
    dump = read_dump(dumps[task, level])
    assert dump.framework == "pytorch" and dump.step == 0 and list(dump.ranks) == [0]
    assert dump.mode == ("md5" if task == "md5" else task)
    rank = dump.ranks[0]
    assert rank.level == level
    modules = [e for e in rank.entries.values() if e.is_module]
    assert {e.direction for e in modules} == {"forward", "backward", "parameters_grad"}
    in_proj = next(e for e in modules if e.name == "decoder.layers.0.self_attention.in_proj" and e.direction == "forward")
    assert in_proj.cls == "LayerNormLinear" and in_proj.outputs[0].shape[-1] > in_proj.inputs[0].shape[-1]
    assert set(in_proj.parameters) >= {"weight"}
    grads = {e.name for e in modules if e.direction == "parameters_grad"}
    assert "output_layer" in grads and "embedding.word_embeddings" in grads
    apis = [e for e in rank.entries.values() if not e.is_module]
    assert bool(apis) == (level == "mix")
    if task == "md5":
        assert all(len(r.md5) == 8 for r in in_proj.outputs)
    if task == "tensor":
        whole = in_proj.outputs[0].load()
        assert whole.shape == in_proj.outputs[0].shape
        assert np.isclose(whole.max(), in_proj.outputs[0].stats["Max"], rtol=1e-6)
        assert np.isclose(np.linalg.norm(whole), in_proj.outputs[0].stats["Norm"], rtol=1e-5)


@pytest.mark.slow
def test_bad_dumps_name_their_file(dumps, tmp_path):
    with pytest.raises(MsprobeDumpError, match="empty dump"):
        read_dump(tmp_path)
    truncated = tmp_path / "t" / "step0" / "rank0"
    shutil.copytree(next(dumps["statistics", "L0"].glob("step0/*")), truncated)
    text = (truncated / "dump.json").read_text()
    (truncated / "dump.json").write_text(text[: len(text) // 2])
    with pytest.raises(MsprobeDumpError, match=r"rank0/dump.json: not valid JSON"):
        read_dump(tmp_path / "t")
    mixed = tmp_path / "m" / "step0"
    shutil.copytree(next(dumps["statistics", "L0"].glob("step0/*")), mixed / "rank0")
    shutil.copytree(next(dumps["tensor", "L0"].glob("step0/*")), mixed / "rank1")
    with pytest.raises(MsprobeDumpError, match=r"rank1/dump.json: mode tensor"):
        read_dump(tmp_path / "m")
    with pytest.raises(MsprobeDumpError, match="no step3"):
        read_dump(tmp_path / "m", step=3)
    stripped = tmp_path / "s" / "step0" / "rank0"
    shutil.copytree(next(dumps["statistics", "L0"].glob("step0/*")), stripped)
    document = json.loads((stripped / "dump.json").read_text())
    del document["framework"]
    (stripped / "dump.json").write_text(json.dumps(document))
    with pytest.raises(MsprobeDumpError, match=r"rank0/dump.json: missing framework"):
        read_dump(tmp_path / "s")
