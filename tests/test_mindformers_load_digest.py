"""The mindformers-load-digest patch: MindFormers' own load, recorded after it, held against the checkpoint.

MindFormers' ``load_checkpoint`` loads only the network's own names and never reports a tensor it
left out, so the align run cannot rest on its messages. The patch makes the pynative trainer record
every parameter after the load; the backend's :func:`verify_load_digest` holds the record against
the checkpoint it gave. Here: the patch fits each release's real trainer.py; the align run through the
backend (the stand-in run_mindformer.py of tests/fixtures) fails without the record and names a renamed
tensor; and the recording code,
run on MindSpore after MindFormers 2.1.0's own ``load_checkpoint`` of a checkpoint crossalign wrote
in the layout that release builds (tests/helpers/mindformers_digest_driver.py), is accepted for the right
checkpoint and names a renamed and a missing expert tensor.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from crossalign.sides.launch import BackendRunError
from crossalign.sides.mindformers.backend import MindFormersBackend
from crossalign.sides.mindformers.load_digest import verify_load_digest
from crossalign.tensorio.errors import LoadDigestError
from crossalign.models.layout import mindformers_buffers
from crossalign.sides.mindformers.checkpoint import default_common, write_mindformers_checkpoint
from crossalign.config import load_config
from crossalign.patching import apply_patch, check_patch, load_patch
from helpers.mindformers_backend import FIXTURES, request_for, site_for
from helpers.mindformers_upstream import STUB, TIMEOUT_S, expected_public, generated, unpacked

TRAINER = "mindformers/pynative/trainer/trainer.py"
DRIVER = Path(__file__).resolve().parent / "helpers" / "mindformers_digest_driver.py"
MODEL = "qwen35_moe_tiny"
RENAMED = ("decoder.layers.1.mlp.experts.weight1", "decoder.layers.1.mlp.experts.weight_1")
MISSING = "decoder.layers.3.mlp.experts.weight2"


def patched_trainer(version: str, root: Path) -> Path:
    """The release's own trainer.py, copied under root and patched by crossalign; returns the patched file."""
    target = root / TRAINER
    target.parent.mkdir(parents=True)
    shutil.copy(unpacked(version) / TRAINER, target)
    patch = load_patch("mindformers-load-digest")
    assert check_patch(patch, root).status == "applicable"
    report = apply_patch(patch, root)
    assert report.status == "applied", report.detail
    return target


@pytest.mark.parametrize("version", ["1.9.0", "2.0.0", "2.1.0"])
def test_the_patch_records_after_the_load_and_before_the_first_step(version, tmp_path):
    """On each release's real trainer.py: applied once (a second apply changes nothing), the record is
    written in train() after the checkpoint load and right before on_train_begin."""
    path = patched_trainer(version, tmp_path)
    text = path.read_text()
    assert apply_patch(load_patch("mindformers-load-digest"), tmp_path).status == "applied"
    assert path.read_text() == text
    trainer = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    methods = {n.name: n for n in trainer.body if isinstance(n, ast.FunctionDef)}
    assert "_crossalign_write_load_digest" in methods
    train = ast.get_source_segment(text, methods["train"])
    load, record = train.index("self._load_checkpoint(checkpoint_path"), train.index("_crossalign_write_load_digest")
    assert load < record < train.index("self.callback_handler.on_train_begin") < train.index("_inner_train_loop")
    assert train.count("_crossalign_write_load_digest(checkpoint_path)") == 1


def test_the_patch_claims_the_releases_the_backend_supports():
    patch = load_patch("mindformers-load-digest")
    assert patch.needed_from == (2, 0, 0) and not patch.optional
    assert patch.needed_for((2, 1, 0)) and not patch.needed_for((1, 9, 0))


def checkpoint_state(seed: int = 1234) -> dict[str, torch.Tensor]:
    """Seeded fp32 weights (and the MoE token-count buffers) in the layout public MindFormers builds for the model."""
    generator = torch.Generator().manual_seed(seed)
    buffers = set(mindformers_buffers(load_config(MODEL).model))
    return {name: (torch.randint(0, 100, shape, generator=generator).float() if name in buffers
                   else 0.02 * torch.randn(shape, generator=generator))
            for name, shape in sorted(expected_public(MODEL).items())}


def faulty(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One routed-expert tensor renamed, one missing."""
    out = {(RENAMED[1] if name == RENAMED[0] else name): value for name, value in state.items()}
    del out[MISSING]
    return out


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """MindFormers 2.1.0 loads each checkpoint into a fresh model and the patched trainer records it."""
    version, tmp = "2.1.0", tmp_path_factory.mktemp("mindformers-load-digest")
    tree = unpacked(version)
    trainer = patched_trainer(version, tmp / "patched")
    state = checkpoint_state()
    cases = {}
    for name, tensors in (("right", state), ("faulty", faulty(state))):
        root = tmp / f"{name}-checkpoint"
        write_mindformers_checkpoint(root, 0, tensors, None, default_common(0, 4))
        cases[name] = {"checkpoint": str(root), "folder": str(tmp / f"{name}-digest")}
    job, result = tmp / "job.json", tmp / "result.json"
    job.write_text(json.dumps({"trainer": str(trainer), "yaml": generated(tmp, MODEL), "cases": cases,
                               "result": str(result)}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(STUB)]), "LOG_MF_PATH": str(tmp / "mf_log"),
           "GLOG_v": "3"}
    start = time.monotonic()
    with open(tmp / "driver.log", "w") as out:
        status = subprocess.run([sys.executable, str(DRIVER), str(job)], cwd=tmp, env=env, stdout=out,
                                stderr=subprocess.STDOUT, timeout=TIMEOUT_S).returncode
    if status != 0 or not result.exists():
        tail = "".join((tmp / "driver.log").read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise AssertionError(f"MindFormers {version} digest driver exited with status {status}:\n{tail}")
    print(f"MindFormers {version}: two loads and records in {time.monotonic() - start:.1f} s")
    return {name: (Path(case["checkpoint"]), Path(case["folder"])) for name, case in cases.items()}, state


def test_the_record_of_mindformers_own_load_passes_the_backend_comparison(records):
    (checkpoint, folder), state = records[0]["right"], records[1]
    tensors = json.loads((folder / "rank_0.json").read_text())["tensors"]
    assert set(tensors) == set(state)
    # 2.1.0 builds the MLP, expert, output-layer and eh_proj weights in bf16 whatever params_dtype says:
    # the fp32 checkpoint went into them cast, and the comparison casts it the same way
    bf16 = {name for name, digest in tensors.items() if digest["dtype"] == "bfloat16"}
    assert {"output_layer.weight", "mtp.layers.0.eh_proj.weight", "decoder.layers.0.mlp.experts.weight1"} <= bf16
    assert all(state[name].dtype == torch.float32 for name in bf16)
    assert verify_load_digest(folder, checkpoint, load_config(MODEL)) == len(state)


def test_a_renamed_and_a_missing_expert_tensor_fail_the_comparison_named(records):
    checkpoint, folder = records[0]["faulty"]
    with pytest.raises(LoadDigestError) as caught:
        verify_load_digest(folder, checkpoint, load_config(MODEL))
    message = str(caught.value)
    assert f"2 not in the checkpoint, so left at its initial value: {RENAMED[0]}, {MISSING}" in message
    assert f"1 in the checkpoint but never loaded (extra or renamed): {RENAMED[1]}" in message


def test_a_record_held_against_another_checkpoint_names_the_values(records, tmp_path):
    (_, folder), state = records[0]["right"], records[1]
    other = dict(state)
    other["decoder.layers.2.mlp.experts.weight2"] = other["decoder.layers.2.mlp.experts.weight2"] + 0.5
    write_mindformers_checkpoint(tmp_path / "other", 0, other, None, default_common(0, 4))
    with pytest.raises(LoadDigestError, match=r"1 loaded with other values: decoder\.layers\.2\.mlp\.experts"
                                              r"\.weight2 \(bfloat16\)"):
        verify_load_digest(folder, tmp_path / "other", load_config(MODEL))


def test_a_missing_record_names_the_rank_and_the_patch(tmp_path):
    with pytest.raises(LoadDigestError, match=r"no load digest for rank\(s\) 1 of 2 .*mindformers-load-digest"):
        (tmp_path / "digest").mkdir()
        (tmp_path / "digest" / "rank_0.json").write_text(json.dumps({"tensors": {}}))
        verify_load_digest(tmp_path / "digest", tmp_path, load_config(MODEL, ["parallel.mindformers.cards_per_node=2",
                                                                       "training.global_batch_size=8"]))


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    root = tmp_path / "mindformers-checkout"
    shutil.copytree(FIXTURES / "mindformers_tree", root)
    return root


@pytest.mark.timeout(60)
def test_the_align_run_records_its_load_and_the_step_verifies_it(tmp_path: Path, checkout: Path):
    apply_patch(load_patch("mindformers-load-digest"), checkout)
    request = request_for(tmp_path, "align", [])
    result = MindFormersBackend(site=site_for(checkout)).train(request)
    assert result.loaded_tensors_verified == 2
    folder = request.output_dir / "load_digest"
    script = (request.output_dir / "run_mindformers.sh").read_text()
    assert f"export CROSSALIGN_LOAD_DIGEST_DIR={folder.absolute()}" in script
    assert set(json.loads((folder / "rank_0.json").read_text())["tensors"]) == {"embedding.word_embeddings.weight",
                                                                               "output_layer.weight"}
    base = request_for(tmp_path, "base", [])
    assert MindFormersBackend(site=site_for(checkout)).train(base).loaded_tensors_verified is None
    assert "CROSSALIGN_LOAD_DIGEST_DIR" not in (base.output_dir / "run_mindformers.sh").read_text()


@pytest.mark.timeout(60)
def test_an_unpatched_trainer_fails_the_align_run_naming_the_patch(tmp_path: Path, checkout: Path):
    with pytest.raises(BackendRunError, match=r"MindFormers wrote no load digest for rank\(s\) 0 of 1 .*"
                                              r"mindformers-load-digest patch is applied"):
        MindFormersBackend(site=site_for(checkout)).train(request_for(tmp_path, "align", []))


@pytest.mark.timeout(60)
def test_a_network_that_took_another_name_fails_the_align_run_named(tmp_path: Path, checkout: Path):
    """The load "finishes" (MindFormers names no checkpoint tensor it left out): the record names both sides."""
    apply_patch(load_patch("mindformers-load-digest"), checkout)
    backend = MindFormersBackend(site=site_for(checkout, FAKE_MINDFORMERS="renamed-network"))
    with pytest.raises(BackendRunError, match=r"1 not in the checkpoint, so left at its initial value: "
                                              r"embedding\.word_embeddings\.weight_renamed; 1 in the checkpoint but "
                                              r"never loaded \(extra or renamed\): embedding\.word_embeddings\.weight"):
        backend.train(request_for(tmp_path, "align", []))


def _copy_record(source: Path, folder: Path, rank: int, change=None) -> None:
    record = json.loads((source / "rank_0.json").read_text())
    if change:
        change(record["tensors"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank_{rank}.json").write_text(json.dumps({**record, "rank": rank}))


def test_data_parallel_ranks_must_hold_the_same_values(records, tmp_path):
    (checkpoint, folder), state = records[0]["right"], records[1]
    config = load_config(MODEL, ["parallel.mindformers.cards_per_node=2", "training.global_batch_size=8"])
    for rank in (0, 1):
        _copy_record(folder, tmp_path / "same", rank)
    assert verify_load_digest(tmp_path / "same", checkpoint, config) == len(state)

    def other_value(tensors):
        tensors["output_layer.weight"]["sha256"] = "0" * 64

    _copy_record(folder, tmp_path / "differ", 0)
    _copy_record(folder, tmp_path / "differ", 1, other_value)
    with pytest.raises(LoadDigestError, match=r"ranks hold different values of 1 tensor\(s\) after the load: "
                                              r"output_layer\.weight \(rank 0 and rank 1\)"):
        verify_load_digest(tmp_path / "differ", checkpoint, config)


def test_with_tensor_parallelism_only_the_names_are_held_against_the_checkpoint(records, tmp_path):
    """Ranks of a tensor-parallel layout hold slices (shapes and hashes of their own): names are still checked."""
    (checkpoint, folder), (faulty_checkpoint, _) = records[0]["right"], records[0]["faulty"]
    config = load_config(MODEL, ["parallel.mindformers.tensor=2", "parallel.mindformers.cards_per_node=2"])

    def sliced(rank):
        def change(tensors):
            for digest in tensors.values():
                digest["shape"][0] = max(1, digest["shape"][0] // 2)
                digest["sha256"] = f"{rank}" * 64
        return change

    for rank in (0, 1):
        _copy_record(folder, tmp_path / "tp", rank, sliced(rank))
    assert verify_load_digest(tmp_path / "tp", checkpoint, config) is None
    with pytest.raises(LoadDigestError, match=r"1 in the checkpoint but never loaded \(extra or renamed\): "
                                              r"decoder\.layers\.1\.mlp\.experts\.weight_1"):
        verify_load_digest(tmp_path / "tp", faulty_checkpoint, config)
