"""DATA: the shipped dataset (tokenizer + Megatron indexed dataset) and the sample order of both sides."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from crossalign.config import load_config
from crossalign.data.corpus import corpus_documents
from crossalign.data.order import global_batches
from crossalign.sides.registry import batches_for
from crossalign.data.prepare import MANIFEST_NAME, prepare_dataset, read_manifest
from crossalign.preflight.data import compare_sample_order
from crossalign.data.settings import SampleOrderError, SampleOrderSettings
from crossalign.data.tokenizer import EOD_TOKEN, load_tokenizer, train_tokenizer
from crossalign.sides.megatron.args import sample_order as megatron_sample_order
from crossalign.sides.mindformers.yaml import sample_order as mindformers_sample_order
from crossalign.sides.megatron.args_reader import sample_order_from_args
from crossalign.sides.mindformers.yaml_reader import sample_order_from_yaml

VOCAB = 2048


@pytest.fixture(scope="module")
def tiny():
    return load_config("qwen35_dense_tiny")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    return prepare_dataset(out, VOCAB)


# ---- prepare ----------------------------------------------------------------------------------


def test_idx_header_matches_spec_byte_for_byte(dataset):
    raw = dataset.prefix.with_suffix(".idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, dtype_code = struct.unpack_from("<QB", raw, 9)
    n_seq, n_doc = struct.unpack_from("<QQ", raw, 18)
    assert (version, dtype_code) == (1, 8)  # uint16 for a vocab below 65500
    documents = corpus_documents()
    assert n_seq == len(documents) and n_doc == len(documents) + 1
    offset = 34
    lengths = np.frombuffer(raw, "<i4", n_seq, offset)
    pointers = np.frombuffer(raw, "<i8", n_seq, offset + 4 * n_seq)
    doc_idx = np.frombuffer(raw, "<i8", n_doc, offset + 12 * n_seq)
    assert offset + 12 * n_seq + 8 * n_doc == len(raw)
    assert np.array_equal(doc_idx, np.arange(n_doc))
    assert pointers[0] == 0 and np.array_equal(np.diff(pointers), 2 * lengths[:-1])

    tokens = np.fromfile(dataset.prefix.with_suffix(".bin"), dtype="<u2")
    assert tokens.size == lengths.sum()
    tokenizer = load_tokenizer(dataset.tokenizer)
    eod = tokenizer.token_to_id(EOD_TOKEN)
    ends = (pointers // 2) + lengths - 1
    assert np.all(tokens[ends] == eod) and np.count_nonzero(tokens == eod) == n_seq
    first = tokens[: lengths[0] - 1].tolist()
    assert tokenizer.decode(first) == documents[0]
    manifest = read_manifest(dataset.prefix.parent, VOCAB)
    assert manifest["tokens"] == tokens.size >= 70 * 4 * 129 * 3  # the tiny runs read well under an epoch


def test_tokenizer_is_deterministic_and_bounded(dataset):
    shipped = dataset.tokenizer.read_text()
    again = train_tokenizer(corpus_documents(), VOCAB)
    assert json.loads(again.to_str(pretty=True)) == json.loads(shipped)
    assert again.to_str(pretty=True) == shipped.rstrip("\n")
    small = train_tokenizer(corpus_documents()[:300], 400)
    assert small.get_vocab_size() <= 400 and small.token_to_id(EOD_TOKEN) == 0
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["abc"], 100)


def test_prepare_reuses_complete_output_and_rebuilds_identically(dataset):
    out = dataset.prefix.parent
    files = sorted(p for p in out.iterdir() if p.is_file())
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in files}
    assert prepare_dataset(out, VOCAB) == dataset
    assert {p.name: p.stat().st_mtime_ns for p in files} == {k: v[0] for k, v in before.items()}

    # A damaged file invalidates the manifest; the rebuild is byte-for-byte what it was.
    bin_path = dataset.prefix.with_suffix(".bin")
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    assert read_manifest(out, VOCAB) is None
    prepare_dataset(out, VOCAB)
    assert {p.name: p.read_bytes() for p in files} == {k: v[1] for k, v in before.items()}
    assert read_manifest(out, VOCAB) is not None


def test_failed_prepare_leaves_nothing_half_written(dataset, tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        prepare_dataset(tmp_path, 100)
    assert list(tmp_path.iterdir()) == []
    out = dataset.prefix.parent
    with pytest.raises(ValueError, match="vocab_size"):
        prepare_dataset(out, 100)  # a failed rebuild keeps the complete output it found
    assert read_manifest(out, VOCAB) is not None
    assert not [p for p in out.iterdir() if p.name.startswith(".prepare-")]
    assert (out / MANIFEST_NAME).is_file()


# ---- sample order -----------------------------------------------------------------------------


def _gpt_dataset(prefix: Path, settings: SampleOrderSettings, cache: Path):
    """megatron-core's GPTDataset built directly (no builder), the reference the Megatron side must match."""
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import Split

    class Tok:
        vocab_size, eod, unique_identifiers = VOCAB, 0, {"class": "test"}

    config = GPTDatasetConfig(random_seed=settings.seed, sequence_length=settings.seq_length,
                              blend=([str(prefix)], None), split=settings.split, path_to_cache=str(cache),
                              tokenizer=Tok(), reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, create_attention_mask=False)
    indexed = IndexedDataset(str(prefix))
    indices = np.arange(len(indexed.sequence_lengths), dtype=np.int32)
    return GPTDataset(indexed, str(prefix), indices, settings.num_samples, Split.train, config)


def test_megatron_side_is_gptdataset_item_by_item(dataset, tiny, tmp_path):
    training = tiny.training
    batches = batches_for("megatron", training, dataset.prefix)
    assert len(batches) == training.train_iters
    reference = _gpt_dataset(dataset.prefix, megatron_sample_order(training), tmp_path)
    gbs = training.global_batch_size
    for step in range(len(batches)):
        batch = batches[step]
        assert batch.shape == (gbs, training.seq_length + 1) and batch.dtype == np.int64
        for row in range(gbs):
            item = reference[step * gbs + row]
            assert np.array_equal(batch[row, :-1], item["tokens"].numpy())
            assert np.array_equal(batch[row, 1:], item["labels"].numpy())


def test_both_sides_identical_with_the_shared_config(dataset, tiny):
    training = tiny.training
    megatron = batches_for("megatron", training, dataset.prefix)
    mindformers = batches_for("mindformers", training, dataset.prefix)
    assert len(megatron) == len(mindformers) == training.train_iters
    assert all(np.array_equal(megatron[i], mindformers[i]) for i in range(len(megatron)))
    base = batches_for("mindformers", training, dataset.prefix,
                       num_samples=training.base_train_iters * training.global_batch_size)
    assert len(base) == training.base_train_iters
    # megatron-core's index cache is published next to the data, complete, with no staging left behind
    cache = dataset.prefix.parent / "cache"
    assert len(list(cache.glob("*-GPTDataset-train-shuffle_index.npy"))) >= 2
    assert not [p for p in dataset.prefix.parent.iterdir() if p.name.startswith(".staging-")]
    report = compare_sample_order(megatron_sample_order(training),
                                  mindformers_sample_order(training), dataset.prefix,
                                  training.global_batch_size, 5)
    assert report.identical and report.first_differing_step is None and report.differences == []


def test_cyclic_loader_permutes_by_epoch_not_by_seed(dataset, tiny):
    import torch

    settings = megatron_sample_order(tiny.training).with_setting("dataloader_type", "cyclic")
    cyclic = global_batches(settings, dataset.prefix, 4)
    reseeded = global_batches(settings.with_setting("seed", 7), dataset.prefix, 4)
    bucket = (cyclic.dataset_length // settings.micro_batch_size) * settings.micro_batch_size
    epochs = [torch.randperm(bucket, generator=torch.Generator().manual_seed(e)).numpy() for e in (0, 1)]
    stream = np.concatenate(epochs)
    last = bucket // 4  # the first global batch of epoch 1
    for step in (0, 1, last - 1, last):
        assert np.array_equal(cyclic.sample_indices(step), stream[step * 4:(step + 1) * 4])
        assert np.array_equal(reseeded.sample_indices(step), cyclic.sample_indices(step))


def _weighted_blend_boundary(dataset, seq_length: int, gbs: int) -> int:
    """A sample count that fits one epoch exactly while the blend's 0.5% surplus needs a second one."""
    tokens = read_manifest(dataset.prefix.parent)["tokens"]
    per_epoch = (tokens - 1) // seq_length
    n = per_epoch - per_epoch % gbs
    assert math.ceil(n * 1.005) > per_epoch
    return n


@pytest.mark.parametrize("name, megatron_value, mindformers_value", [
    ("seed", 42, 1234),
    ("split", "969,30,1", "1,0,0"),
    ("blend", "weighted", "bare"),
    ("dataloader_type", "cyclic", "single"),
    ("num_samples", 200, 8000),
])
def test_each_pitfall_is_detected_and_named(dataset, tiny, name, megatron_value, mindformers_value):
    training = tiny.training
    megatron = megatron_sample_order(training)
    mindformers = mindformers_sample_order(training)
    if name == "blend":
        n = _weighted_blend_boundary(dataset, training.seq_length, training.global_batch_size)
        megatron, mindformers = megatron.with_setting("num_samples", n), mindformers.with_setting("num_samples", n)
    report = compare_sample_order(megatron.with_setting(name, megatron_value),
                                  mindformers.with_setting(name, mindformers_value),
                                  dataset.prefix, training.global_batch_size, 3)
    assert not report.identical
    assert report.first_differing_step == 1
    assert report.explained_by == [name]
    assert name in report.summary() and "step 1" in report.summary()


def test_a_harmless_difference_is_reported_as_such(dataset, tiny):
    training = tiny.training
    report = compare_sample_order(megatron_sample_order(training).with_setting("blend", "weighted"),
                                  mindformers_sample_order(training), dataset.prefix,
                                  training.global_batch_size, 3)
    assert report.identical  # 200 vs ceil(200 * 1.005) samples: still one epoch
    assert [d.name for d in report.differences] == ["blend"] and not report.differences[0].changes_order
    assert report.megatron_facts.dataset == "BlendedDataset" and report.megatron_facts.gpt_num_samples == 201
    assert "do not change" in report.summary()


# ---- settings from real launches --------------------------------------------------------------


def test_settings_from_megatron_arguments_use_megatron_defaults():
    args = ["--data-path", "1", "/d/corpus_text_document", "--seq-length", "128", "--train-iters", "70",
            "--global-batch-size", "4", "--micro-batch-size", "2", "--lr", "3e-4"]
    settings = sample_order_from_args(args)
    assert (settings.seed, settings.split, settings.blend, settings.dataloader_type) == \
        (1234, "969, 30, 1", "weighted", "single")
    assert settings.num_samples == 280 and settings.micro_batch_size == 2
    explicit = sample_order_from_args(
        ["--data-path", "/d/p", "--split", "1,0,0", "--seed", "42", "--seq-length", "128",
         "--train-samples", "96", "--dataloader-type", "cyclic"])
    assert (explicit.seed, explicit.blend, explicit.num_samples, explicit.dataloader_type) == \
        (42, "bare", 96, "cyclic")
    with pytest.raises(SampleOrderError, match="--data-path"):
        sample_order_from_args(["--seq-length", "128", "--train-iters", "1"])
    # read by the one Megatron argument reader (launch_files): a bad value is named, not an argparse exit
    with pytest.raises(SampleOrderError, match="--seq-length '2k' is not an integer"):
        sample_order_from_args(["--data-path", "/d/p", "--seq-length", "2k", "--train-samples", "8"])
    assert sample_order_from_args(["--data-path=/d/p", "--seq-length=128",
                                                   "--train-samples=8"]).num_samples == 8


def test_settings_from_mindformers_yaml_use_mindformers_defaults(tiny):
    document = {"training": {"seed": 42, "global_batch_size": 4}, "train_dataset": {"dataloader": {
        "type": "BlendedMegatronDatasetDataLoader", "datasets_type": "GPTDataset", "sizes": [200, 0, 0],
        "shuffle": False,
        "config": {"split": "1, 0, 0", "seq_length": 128, "data_path": ["1", "/d/corpus_text_document"]}}}}
    settings = sample_order_from_yaml(document)
    # the top-level training seed is the model's; the dataset seed defaults to 1234
    assert (settings.seed, settings.blend, settings.num_samples) == (1234, "weighted", 200)
    bare = megatron_sample_order(tiny.training).with_setting("blend", "weighted")
    assert bare.differences(settings) == []  # "1, 0, 0" and "1,0,0" are the same split
    document["train_dataset"]["dataloader"]["shuffle"] = True
    with pytest.raises(SampleOrderError, match="train_dataset.dataloader.shuffle"):
        sample_order_from_yaml(document)


# ---- CLI --------------------------------------------------------------------------------------


def test_cli_prepare_and_preflight(dataset):
    from crossalign.cli import app

    runner = CliRunner()
    out = dataset.prefix.parent
    result = runner.invoke(app, ["data", "prepare", "--out", str(out), "--vocab-size", str(VOCAB)])
    assert result.exit_code == 0, result.output
    assert "reused" in result.output

    same = runner.invoke(app, ["preflight", "data", "--model", "qwen35_dense_tiny", "--data", str(out),
                               "--batches", "3"])
    assert same.exit_code == 0, same.output
    assert "identical" in same.output

    seed = runner.invoke(app, ["preflight", "data", "--model", "qwen35_dense_tiny", "--data", str(out),
                               "--batches", "3", "--megatron-seed", "42"])
    assert seed.exit_code == 1, seed.output
    assert "explained by seed" in " ".join(seed.output.split())

    bad = runner.invoke(app, ["preflight", "data", "--model", "qwen35_dense_tiny", "--data", str(out),
                              "--megatron-loader", "random"])
    assert bad.exit_code == 2 and "dataloader_type" in bad.output


def test_cli_preflight_data_reads_real_launch_files(dataset, tmp_path):
    """--megatron-args takes a run script's command line (continuations, comments) and --mindformers-yaml a
    generated YAML, read the same way as `preflight config`; a missing file is named."""
    from crossalign.sides.megatron.args import megatron_args
    from crossalign.sides.mindformers.yaml import dump_yaml, mindformers_yaml
    from crossalign.cli import app

    config = load_config("qwen35_dense_tiny")
    args = megatron_args(config, data_prefix=dataset.prefix, tokenizer=None, load_dir=tmp_path / "ckpt")
    script = tmp_path / "run_megatron.sh"
    script.write_text("#!/usr/bin/env bash\ncd /opt/Megatron-LM\n"
                      "exec python -m torch.distributed.run --nproc_per_node 1 pretrain_gpt.py \\\n    "
                      + " \\\n    ".join(args) + "\n# an earlier try used --seed 99\n")
    yaml_file = dump_yaml(mindformers_yaml(config, mode="align", data_prefix=dataset.prefix,
                                           load_dir=tmp_path / "bf16"), tmp_path / "align_train.yaml")
    runner = CliRunner()
    base = ["preflight", "data", "--model", "qwen35_dense_tiny", "--data", str(dataset.prefix.parent), "--batches", "2"]
    same = runner.invoke(app, [*base, "--megatron-args", str(script), "--mindformers-yaml", str(yaml_file)])
    assert same.exit_code == 0, same.output
    assert "identical" in same.output

    missing = runner.invoke(app, [*base, "--mindformers-yaml", str(tmp_path / "absent.yaml")])
    assert missing.exit_code == 2
    assert f"{tmp_path / 'absent.yaml'}: MindFormers YAML not found" in " ".join(missing.output.split())


# ---- layering ---------------------------------------------------------------------------------


def test_the_dataset_layer_never_imports_the_backends():
    """data/ sits below backends/: what both need (dataset files, launch-file readers) is in launch_files."""
    import ast

    import crossalign.data

    package = Path(crossalign.data.__file__).parent
    reaching_up = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            reaching_up += [f"{path.name}: {name}" for name in names if name.startswith("crossalign.backends")]
    assert reaching_up == []
