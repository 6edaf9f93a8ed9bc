"""bf16 cast (DAG step 2): any model, same layout, floats cast, everything else carried over, one tensor at a time."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from crossalign.checkpoint.cast import cast_bf16
from crossalign.tensorio.errors import CheckpointError
from crossalign.sides.mindformers.checkpoint import default_common, write_mindformers_checkpoint
from crossalign.tensorio.safetensors_io import read_header
from crossalign.cli import app

MODEL = {
    "layer.weight": torch.randn(6, 4),
    "half.weight": torch.randn(3).half(),
    "already.weight": torch.randn(2).bfloat16(),
    "counts": torch.arange(4, dtype=torch.int64),
    "decoder.layers.0.mlp.tokens_per_expert": torch.tensor([5.0, 3.0, 0.0, 8.0]),  # MindFormers' MoE buffer
}
# as MindFormers 2.1.0's pynative AdamW saves it: moments and an int64 step count
OPTIMIZER = {"adam_m.layer.weight": torch.randn(6, 4), "global_step": torch.tensor([9], dtype=torch.int64)}


def _source(tmp_path: Path) -> Path:
    write_mindformers_checkpoint(tmp_path / "src", 9, MODEL, OPTIMIZER, default_common(9, 8))
    return tmp_path / "src"


def test_cast_keeps_the_layout_and_casts_only_weights(tmp_path):
    report = cast_bf16(_source(tmp_path), tmp_path / "out")
    src, out = tmp_path / "src" / "iteration_00000009", tmp_path / "out" / "iteration_00000009"
    assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").read_text() == "9"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in src.iterdir())
    assert (out / "common.json").read_bytes() == (src / "common.json").read_bytes()
    model = "qwen35-model-0000000-0000001.safetensors"
    before, after = load_file(src / model), load_file(out / model)
    assert list(after) == list(before)
    for key, tensor in before.items():
        if tensor.is_floating_point() and key != "decoder.layers.0.mlp.tokens_per_expert":
            assert after[key].dtype == torch.bfloat16 and torch.equal(after[key], tensor.to(torch.bfloat16))
        else:  # integers and the buffer, which MindFormers keeps in fp32
            assert after[key].dtype == tensor.dtype and torch.equal(after[key], tensor)
    assert read_header(out / model)[1] == {"format": "ms"}
    assert [i.name for i in read_header(out / model)[0]] == [i.name for i in read_header(src / model)[0]]
    optimizer = "qwen35-opt-0000000-0000001.safetensors"  # fp32 moments for a resume: copied as they are
    assert (out / optimizer).read_bytes() == (src / optimizer).read_bytes()
    assert report.optimizer_files == [tmp_path / "out" / "iteration_00000009" / optimizer]
    assert (report.tensors, report.cast, report.buffers) == (5, 2, 1)  # bf16, integer and buffer are not cast
    assert report.bytes_out < report.bytes_in
    assert json.loads((out / "common.json").read_text())["global_step"] == 9


def test_cast_of_a_bare_folder(tmp_path):
    folder = tmp_path / "bare"
    folder.mkdir()
    save_file({"w": torch.ones(3)}, folder / "net.safetensors")
    cast_bf16(folder, tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["net.safetensors"]
    assert load_file(tmp_path / "out" / "net.safetensors")["w"].dtype == torch.bfloat16


def test_large_tensors_are_cast_in_row_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr("crossalign.checkpoint.cast.BLOCK_BYTES", 64)  # 4 rows of 16 bytes per block
    folder = tmp_path / "bare"
    folder.mkdir()
    tensors = {"rows": torch.randn(10, 4), "scalar": torch.tensor(3.0), "cube": torch.randn(5, 2, 3)}
    save_file(tensors, folder / "net.safetensors")
    cast_bf16(folder, tmp_path / "out")
    out = load_file(tmp_path / "out" / "net.safetensors")
    assert all(torch.equal(out[k], v.to(torch.bfloat16)) for k, v in tensors.items())


def test_truncated_input_fails_before_writing_anything(tmp_path):
    source = _source(tmp_path)
    file = next((source / "iteration_00000009").glob("*-opt-*.safetensors"))
    file.write_bytes(file.read_bytes()[:-5])
    with pytest.raises(CheckpointError, match=f"{file.name}: not a readable safetensors file"):
        cast_bf16(source, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_missing_common_json_and_busy_output_are_refused(tmp_path):
    source = _source(tmp_path)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "old").write_text("x")
    with pytest.raises(CheckpointError, match="not empty"):
        cast_bf16(source, tmp_path / "busy")
    (source / "iteration_00000009" / "common.json").unlink()
    with pytest.raises(CheckpointError, match="common.json is missing"):
        cast_bf16(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cast_holds_one_tensor_at_a_time(tmp_path):
    """24 tensors of 4 MiB: peak memory grows by a few tensors, not by the 96 MiB file."""
    folder = tmp_path / "big"
    folder.mkdir()
    save_file({f"t{i}": torch.full((2**20,), float(i)) for i in range(24)}, folder / "big.safetensors")
    script = (  # resets the peak after the imports (clear_refs 5), then reads the peak of the cast alone
        "import sys\n"
        "from crossalign.checkpoint.cast import cast_bf16\n"
        "def kib(field): return int(open('/proc/self/status').read().split(field + ':')[1].split()[0])\n"
        "open('/proc/self/clear_refs', 'w').write('5')\n"
        "base = kib('VmRSS')\n"
        "cast_bf16(sys.argv[1], sys.argv[2])\n"
        "print((kib('VmHWM') - base) // 1024)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(folder), str(tmp_path / "out")],
                          capture_output=True, text=True, check=True)
    growth_mib = int(done.stdout.strip())
    assert growth_mib < 48, f"peak memory grew by {growth_mib} MiB while casting a 96 MiB file"
    assert load_file(tmp_path / "out" / "big.safetensors")["t23"][0] == 23


def test_cli_cast(tmp_path):
    result = CliRunner().invoke(app, ["cast-bf16", "--input", str(_source(tmp_path)), "--output", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert "cast 2 of 5 tensors" in result.output
    assert "kept 1 buffer(s) and 1 optimizer file(s) as they are" in result.output
    again = CliRunner().invoke(app, ["cast-bf16", "--input", str(tmp_path / "src"), "--output", str(tmp_path / "o")])
    assert again.exit_code == 2 and "not empty" in again.output
