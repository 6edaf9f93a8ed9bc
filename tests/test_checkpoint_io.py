"""Checkpoint files: streaming safetensors, the MindFormers 2.0 layout, the Megatron legacy layout, atomicity."""

import datetime
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from crossalign.tensorio.blocks import BlockCaster, ReusedBuffer, one_thread
from crossalign.tensorio.errors import CheckpointError
from crossalign.sides.megatron.checkpoint import (
    read_megatron_checkpoint,
    stream_megatron_checkpoint,
    write_megatron_checkpoint,
)
from crossalign.sides.mindformers.checkpoint import (
    default_common,
    read_mindformers_checkpoint,
    write_mindformers_checkpoint,
)
from crossalign.tensorio.safetensors_io import (
    SafetensorsWriter,
    TensorInfo,
    read_header,
    read_rows,
    read_tensor,
    write_safetensors,
)
from crossalign.tensorio.torch_file import TensorSpec, TorchFileWriter

TENSORS = {
    "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
    "step": torch.tensor([7], dtype=torch.int32),
    "lr": torch.tensor(0.25),
}


def test_streamed_safetensors_load_with_the_reference_library(tmp_path):
    path = tmp_path / "x.safetensors"
    write_safetensors(path, TENSORS, {"format": "ms"})
    loaded = load_file(path)
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in TENSORS.items())
    infos, metadata = read_header(path)
    assert metadata == {"format": "ms"}
    assert [i.name for i in infos] == list(TENSORS)
    header_length = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert header_length % 8 == 0


def test_tensors_are_read_and_converted_in_row_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr("crossalign.tensorio.safetensors_io.BLOCK_BYTES", 24)  # 3 rows of 8 bytes per block
    tensors = {"rows": torch.randn(10, 4).bfloat16(), "scalar": torch.tensor(2.5).bfloat16(), "ints": torch.arange(7)}
    path = tmp_path / "x.safetensors"
    save_file(tensors, path)
    infos = {info.name: info for info in read_header(path)[0]}
    for name, tensor in tensors.items():
        assert torch.equal(read_tensor(path, infos[name]), tensor)
        if tensor.is_floating_point():
            converted = read_tensor(path, infos[name], torch.float32)
            assert converted.dtype == torch.float32 and torch.equal(converted, tensor.float())


def test_writer_rejects_a_tensor_it_was_not_told_about(tmp_path):
    with pytest.raises(CheckpointError, match="expected 'a'"):
        with SafetensorsWriter(tmp_path / "x.safetensors", [TensorInfo("a", "F32", (2,))], None) as writer:
            writer.write("a", torch.zeros(3))
    with pytest.raises(CheckpointError, match="never written"):
        with SafetensorsWriter(tmp_path / "y.safetensors", [TensorInfo("a", "F32", (2,))], None):
            pass


@pytest.mark.parametrize("cut", [3, 20, 1])
def test_truncated_safetensors_is_named(tmp_path, cut):
    path = tmp_path / "x.safetensors"
    save_file(TENSORS, path)
    data = path.read_bytes()
    path.write_bytes(data[:cut] if cut < 8 else data[:-cut])
    with pytest.raises(CheckpointError, match="x.safetensors: not a readable safetensors file"):
        read_header(path)


def _mf(tmp_path: Path, iteration=3, optimizer=True) -> Path:
    opt = {"adam_m.w": torch.zeros(3, 4), "global_step": torch.tensor([iteration], dtype=torch.int32)}
    write_mindformers_checkpoint(tmp_path / "ck", iteration, {k: TENSORS[k] for k in ("w", "b")},
                                 opt if optimizer else None, default_common(iteration, 8))
    return tmp_path / "ck"


def test_mindformers_layout_as_mindformers_saves_it(tmp_path):
    root = _mf(tmp_path)
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "3"
    folder = root / "iteration_00000003"
    assert sorted(p.name for p in folder.iterdir()) == [
        "common.json", "qwen35-model-0000000-0000001.safetensors", "qwen35-opt-0000000-0000001.safetensors"]
    common = json.loads((folder / "common.json").read_text())
    assert common == {"epoch_num": 1, "step_num": 3, "global_step": 3, "loss_scale": 1.0, "global_batch_size": 8,
                      "consumed_samples": 24, "ckpt_status": None}
    assert read_header(folder / "qwen35-model-0000000-0000001.safetensors")[1] == {"format": "ms"}
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temporary sibling left


@pytest.mark.parametrize("where", ["root", "iteration", "bare"])
def test_mindformers_checkpoint_is_found_from_any_of_its_folders(tmp_path, where):
    root = _mf(tmp_path)
    if where == "bare":
        bare = tmp_path / "bare"
        bare.mkdir()
        for file in (root / "iteration_00000003").glob("*.safetensors"):
            file.rename(bare / file.name)
        path = bare
    else:
        path = root if where == "root" else root / "iteration_00000003"
    checkpoint = read_mindformers_checkpoint(path)
    assert checkpoint.iteration == (None if where == "bare" else 3)
    assert (checkpoint.common is None) == (where == "bare")
    state = checkpoint.model_state()
    assert sorted(state) == ["b", "w"]  # optimizer entries are not model weights
    assert torch.equal(state["w"], TENSORS["w"])
    assert sorted(checkpoint.optimizer_state()) == ["adam_m.w", "global_step"]


def test_missing_common_json_is_an_error_in_the_iteration_layout(tmp_path):
    root = _mf(tmp_path)
    (root / "iteration_00000003" / "common.json").unlink()
    with pytest.raises(CheckpointError, match="common.json is missing"):
        read_mindformers_checkpoint(root)


def test_bad_trackers_and_folders_are_named(tmp_path):
    root = _mf(tmp_path)
    (root / "latest_checkpointed_iteration.txt").write_text("9")
    with pytest.raises(CheckpointError, match="names iteration 9"):
        read_mindformers_checkpoint(root)
    (root / "latest_checkpointed_iteration.txt").write_text("soon")
    with pytest.raises(CheckpointError, match="found 'soon'"):
        read_mindformers_checkpoint(root)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no .safetensors files"):
        read_mindformers_checkpoint(empty)
    with pytest.raises(CheckpointError, match="not a folder"):
        read_mindformers_checkpoint(tmp_path / "nowhere")


def test_a_tensor_stored_twice_is_an_error(tmp_path):
    folder = tmp_path / "bare"
    folder.mkdir()
    save_file({"w": torch.zeros(2)}, folder / "a.safetensors")
    save_file({"w": torch.ones(2)}, folder / "b.safetensors")
    with pytest.raises(CheckpointError, match="'w' is stored twice"):
        read_mindformers_checkpoint(folder)


def test_a_second_save_adds_an_iteration_and_moves_the_tracker(tmp_path):
    root = _mf(tmp_path, iteration=3)
    write_mindformers_checkpoint(root, 5, {"w": TENSORS["w"] * 2}, None, default_common(5))
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "5"
    assert torch.equal(read_mindformers_checkpoint(root).model_state()["w"], TENSORS["w"] * 2)
    with pytest.raises(CheckpointError, match="already saved"):
        write_mindformers_checkpoint(root, 5, {"w": TENSORS["w"]}, None, default_common(5))


def test_megatron_checkpoint_holds_only_plain_data_and_loads_with_weights_only(tmp_path):
    state = {"a.weight": torch.randn(4, 2), "b.weight": torch.randn(3)}
    written = write_megatron_checkpoint(tmp_path / "mg", 12, state)
    assert written == tmp_path / "mg" / "iter_0000012"
    assert (tmp_path / "mg" / "latest_checkpointed_iteration.txt").read_bytes() == b"12"
    file = written / "mp_rank_00" / "model_optim_rng.pt"
    raw = torch.load(file, weights_only=True)
    assert set(raw) == {"checkpoint_version", "iteration", "model"}
    assert raw["checkpoint_version"] == 3.0 and raw["iteration"] == 12
    assert torch.serialization.get_unsafe_globals_in_checkpoint(file) == []  # no argparse Namespace or the like
    loaded = read_megatron_checkpoint(tmp_path / "mg")
    assert loaded.iteration == 12 and (loaded.tp, loaded.pp) == (1, 1)
    assert all(torch.equal(loaded.state[k], v) for k, v in state.items())


def test_megatron_checkpoint_of_parameters_that_require_grad(tmp_path):
    weight = torch.nn.Parameter(torch.randn(3, 2))
    write_megatron_checkpoint(tmp_path / "mg", 1, {"w": weight})
    assert torch.equal(read_megatron_checkpoint(tmp_path / "mg").state["w"], weight.detach())


def test_megatron_views_are_saved_without_their_whole_storage(tmp_path):
    big = torch.randn(1000, 100)
    write_megatron_checkpoint(tmp_path / "mg", 1, {"row": big[3]})
    size = (tmp_path / "mg" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt").stat().st_size
    assert size < 20_000


def test_megatron_reader_drops_extra_state_and_rejects_foreign_pickles(tmp_path):
    folder = tmp_path / "iter_0000002" / "mp_rank_00"
    folder.mkdir(parents=True)
    torch.save({"checkpoint_version": 3.0, "iteration": 2,
                "model": {"x.weight": torch.ones(2), "x._extra_state": None}}, folder / "model_optim_rng.pt")
    loaded = read_megatron_checkpoint(tmp_path / "iter_0000002")
    assert list(loaded.state) == ["x.weight"] and loaded.iteration == 2
    torch.save({"checkpoint_version": 3.0, "model": {"x.weight": torch.ones(2)}, "saved": datetime.date(2026, 1, 1)},
               folder / "model_optim_rng.pt")
    with pytest.raises(CheckpointError, match="weights_only"):
        read_megatron_checkpoint(tmp_path / "iter_0000002")


def test_megatron_release_tracker(tmp_path):
    folder = tmp_path / "mg" / "release" / "mp_rank_00"
    folder.mkdir(parents=True)
    torch.save({"checkpoint_version": 3.0, "iteration": 0, "model": {"x": torch.ones(1)}}, folder / "model_optim_rng.pt")
    (tmp_path / "mg" / "latest_checkpointed_iteration.txt").write_text("release")
    assert read_megatron_checkpoint(tmp_path / "mg").iteration == 0


def test_a_failed_write_leaves_nothing_behind(tmp_path):
    with pytest.raises(CheckpointError, match="'bad' has dtype torch.complex64"):
        write_mindformers_checkpoint(tmp_path / "new", 1, {"w": torch.ones(2), "bad": torch.ones(2, dtype=torch.complex64)},
                                     None, default_common(1))
    assert list(tmp_path.iterdir()) == []
    root = _mf(tmp_path)
    with pytest.raises(CheckpointError):
        write_mindformers_checkpoint(root, 4, {"bad": torch.ones(2, dtype=torch.complex64)}, None, default_common(4))
    assert sorted(p.name for p in root.iterdir()) == ["iteration_00000003", "latest_checkpointed_iteration.txt"]
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "3"


def _announce(tensors: dict) -> dict:
    return {name: TensorSpec(tuple(t.shape), t.dtype) for name, t in tensors.items()}


def test_torch_file_written_tensor_by_tensor_loads_with_weights_only(tmp_path):
    """Same content as torch.save, bit for bit, with floats cast on the way (bf16 in, fp32 out)."""
    tensors = {"w": torch.randn(5, 3).bfloat16(), "scalar": torch.tensor(2.5).bfloat16(), "step": torch.arange(4),
               "empty": torch.zeros(0, 2), "flag": torch.tensor([True, False])}
    specs = {name: TensorSpec(tuple(t.shape), torch.float32 if t.is_floating_point() else t.dtype)
             for name, t in tensors.items()}
    file = tmp_path / "model.pt"
    with TorchFileWriter(file, {"iteration": 3, "note": "x"}, "model", specs, BlockCaster(max_bytes=8)) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
    loaded = torch.load(file, weights_only=True)
    assert loaded["iteration"] == 3 and loaded["note"] == "x" and list(loaded["model"]) == list(tensors)
    for name, tensor in tensors.items():
        assert loaded["model"][name].dtype == specs[name].dtype
        assert torch.equal(loaded["model"][name], tensor.to(specs[name].dtype))
    assert torch.serialization.get_unsafe_globals_in_checkpoint(file) == []


def test_torch_file_rejects_what_was_not_announced(tmp_path):
    specs = _announce({"a": torch.zeros(2), "b": torch.zeros(3, dtype=torch.int64)})
    cases = [("b", torch.zeros(3, dtype=torch.int64), "expected 'a'"),
             ("a", torch.zeros(3), r"expected 'a' torch.float32 \[2\], got 'a' torch.float32 \[3\]"),
             ("a", torch.zeros(2, dtype=torch.int32), "got 'a' torch.int32")]
    for name, tensor, message in cases:
        with pytest.raises(CheckpointError, match=message):
            with TorchFileWriter(tmp_path / "x.pt", {}, "model", specs) as writer:
                writer.write(name, tensor)
    with pytest.raises(CheckpointError, match="'b' torch.int64 \\[3\\], got 'b' torch.float32"):
        with TorchFileWriter(tmp_path / "x.pt", {}, "model", specs) as writer:
            writer.write("a", torch.ones(2))
            writer.write("b", torch.ones(3))  # an integer record is never cast into
    with pytest.raises(CheckpointError, match="1 announced tensors were never written, first 'b'"):
        with TorchFileWriter(tmp_path / "x.pt", {}, "model", specs) as writer:
            writer.write("a", torch.ones(2))
    with pytest.raises(CheckpointError, match="'c' was not announced"):
        with TorchFileWriter(tmp_path / "x.pt", {}, "model", specs) as writer:
            writer.write("a", torch.ones(2))
            writer.write("b", torch.ones(3, dtype=torch.int64))
            writer.write("c", torch.ones(1))
    with pytest.raises(CheckpointError, match="stored 3 tensors, 2 were announced"):
        TorchFileWriter(tmp_path / "y.pt", {"extra": torch.ones(1)}, "model", specs)


def test_megatron_checkpoint_streams_and_a_bad_tensor_leaves_nothing(tmp_path):
    specs = {"a.weight": TensorSpec((4, 2), torch.float32), "b.weight": TensorSpec((3,), torch.float32)}
    a, b = torch.randn(4, 2).bfloat16(), torch.randn(3).bfloat16()
    stream_megatron_checkpoint(tmp_path / "mg", 7, specs, iter([("a.weight", a), ("b.weight", b)]))
    loaded = read_megatron_checkpoint(tmp_path / "mg").state
    assert torch.equal(loaded["a.weight"], a.float()) and torch.equal(loaded["b.weight"], b.float())

    def wrong_second():
        yield "a.weight", a
        yield "b.weight", torch.zeros(4)

    with pytest.raises(CheckpointError, match=r"expected 'b.weight' torch.float32 \[3\]"):
        stream_megatron_checkpoint(tmp_path / "new", 7, specs, wrong_second())
    with pytest.raises(CheckpointError, match="'b.weight' was not announced in this place"):
        stream_megatron_checkpoint(tmp_path / "new", 7, specs, iter([("b.weight", b), ("a.weight", a)]))
    with pytest.raises(CheckpointError, match="never written, first 'b.weight'"):
        stream_megatron_checkpoint(tmp_path / "new", 7, specs, iter([("a.weight", a)]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mg"]


def test_reused_buffer_hands_out_the_same_memory():
    buffer = ReusedBuffer()
    first = buffer.view((4, 4), torch.float32)
    assert buffer.view((2, 8), torch.bfloat16).data_ptr() == first.data_ptr()  # smaller: the same memory
    grown = buffer.view((100,), torch.float32)
    assert grown.shape == (100,) and buffer.view((3,), torch.int64).data_ptr() == grown.data_ptr()


def test_rows_are_read_into_a_buffer_kept_across_tensors(tmp_path):
    path = tmp_path / "x.safetensors"
    tensors = {"a": torch.randn(10, 4), "b": torch.randn(6, 4).bfloat16(), "s": torch.tensor(1.5)}
    save_file(tensors, path)
    infos = {info.name: info for info in read_header(path)[0]}
    buffer = ReusedBuffer()
    buffer.view((1024,), torch.uint8)  # large enough for every tensor here: it never moves
    pointers = set()
    for name, tensor in tensors.items():
        blocks = [block.clone() for block in read_rows(path, infos[name], 48, buffer)]  # 3 rows of a, 6 of b
        pointers.add(buffer.view((1,), torch.uint8).data_ptr())
        assert torch.equal(torch.cat(blocks) if tensor.dim() else blocks[0], tensor)
        assert torch.equal(read_tensor(path, infos[name], buffer=buffer), tensor)
    assert len(pointers) == 1


def test_megatron_checkpoint_is_written_in_near_constant_memory(tmp_path):
    """24 bf16 tensors of 2 MiB stored as fp32 (a 96 MiB file): memory grows by a few tensors, not by the file."""
    script = (  # resets the peak after the imports (clear_refs 5), then reads the peak of the save alone
        "import sys, torch\n"
        "from crossalign.sides.megatron.checkpoint import stream_megatron_checkpoint\n"
        "from crossalign.tensorio.torch_file import TensorSpec\n"
        "def kib(field): return int(open('/proc/self/status').read().split(field + ':')[1].split()[0])\n"
        "specs = {f't{i}': TensorSpec((2**20,), torch.float32) for i in range(24)}\n"
        "tensors = ((f't{i}', torch.full((2**20,), float(i), dtype=torch.bfloat16)) for i in range(24))\n"
        "open('/proc/self/clear_refs', 'w').write('5')\n"
        "base = kib('VmRSS')\n"
        "stream_megatron_checkpoint(sys.argv[1], 1, specs, tensors)\n"
        "print((kib('VmHWM') - base) // 1024)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "mg")], capture_output=True, text=True,
                          check=True)
    growth_mib = int(done.stdout.strip())
    assert growth_mib < 48, f"peak memory grew by {growth_mib} MiB while writing a 96 MiB checkpoint"
    model = read_megatron_checkpoint(tmp_path / "mg").state
    assert model["t23"].dtype == torch.float32 and model["t23"][0] == 23 and len(model) == 24


def test_one_thread_is_scoped():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError):
        with one_thread():
            assert torch.get_num_threads() == 1
            raise RuntimeError("the setting comes back after an error too")
    assert torch.get_num_threads() == before
