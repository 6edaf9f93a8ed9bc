"""The embedded MindFormers trainer: learning, log format, determinism, accumulation, checkpoints."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("mindspore")

from crossalign.data.files import DatasetFiles
from crossalign.sides.protocol import TrainRequest
from crossalign.sides.mindformers.embedded.trainer import (  # noqa: E402
    LocalMindFormersBackend,
    TrainingSetupError,
    train_on_batches,
    warmup_lr,
)
from crossalign.sides.mindformers.checkpoint import (  # noqa: E402
    default_common,
    read_mindformers_checkpoint,
    write_mindformers_checkpoint,
)
from crossalign.config import load_config  # noqa: E402
from crossalign.sides.mindformers.log_parser import parse_mindformers_log  # noqa: E402

LINE = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} - mindformers(?P<logdir>/\S*)"
    r"\[mindformers/pynative/callback/loss_callback\.py:337\] - INFO - "
    r"\{ step:\[(?P<step> {0,4}\d+)/(?P<total> {0,4}\d+)\], consumed_samples: (?P<consumed>\d+), "
    r"global_batch_size: (?P<gbs>\d+), loss: (?P<loss> *\d+\.\d{6}), per_step_time: (?P<time> *\d+)ms, "
    r"(?:load_balancing_loss: (?P<lbl> *\d+\.\d{6}), )?mtp_1_loss: (?P<mtp> *\d+\.\d{6}), "
    r"lr: (?P<lr>\d\.\d{6}e[-+]\d\d), grad_norm: (?P<norm> *\d+\.\d{6}) \}$")


def _config(name="qwen35_dense_tiny", **training):
    config = load_config(name)
    settings = {"seq_length": 32, "global_batch_size": 4, "micro_batch_size": 4, "base_train_iters": 4,
                "train_iters": 3, "lr_warmup_iters": 2}
    settings.update(training)
    return config.model_copy(update={"training": config.training.model_copy(update=settings)})


def _request(config, tmp_path: Path, name: str, mode="base", init=None, on_step=None) -> TrainRequest:
    return TrainRequest(config=config, side="mindformers", mode=mode, data=DatasetFiles(tmp_path / "none", tmp_path),
                        output_dir=tmp_path / name, init_checkpoint=init, on_step=on_step)


def _batches(config, count, seed=0):
    t = config.training
    rng = np.random.default_rng(seed)
    return [rng.integers(0, config.model.vocab_size, (t.global_batch_size, t.seq_length + 1)) for _ in range(count)]


def _lines(path: Path) -> list[re.Match]:
    matches = [LINE.match(line) for line in path.read_text().splitlines()]
    assert all(matches), path.read_text()
    return matches


def _without_times(path: Path) -> list[str]:
    return [re.sub(r"per_step_time: *\d+ms", "", line.split(" - INFO - ")[1]) for line in path.read_text().splitlines()]


def test_constant_warmup_lr_applies_init_on_step_one_and_max_after_warmup():
    training = _config(lr=1e-3, lr_warmup_iters=4, lr_warmup_init=0.0).training
    assert [warmup_lr(training, k) for k in range(1, 7)] == pytest.approx([0, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    assert warmup_lr(training.model_copy(update={"lr_warmup_iters": 0}), 1) == 1e-3


@pytest.fixture(scope="module")
def repeated_run(tmp_path_factory):
    """Six steps on the same batch (step 1 at the warmup init lr 0), the callback recording what it is told."""
    tmp_path = tmp_path_factory.mktemp("repeated")
    config = _config(base_train_iters=6, lr=5e-3, lr_warmup_iters=1)
    calls = []
    request = _request(config, tmp_path, "run", on_step=lambda step, total, metrics: calls.append((step, total, metrics)))
    batch = _batches(config, 1)[0]
    result = train_on_batches(request, [batch] * 6)
    return config, request, result, calls, batch


def test_loss_decreases_on_repeated_data(repeated_run):
    _, _, result, _, _ = repeated_run
    losses = [float(m["loss"]) for m in _lines(result.log_path)]
    mtp = [float(m["mtp"]) for m in _lines(result.log_path)]
    assert losses[0] == pytest.approx(np.log(2048), abs=0.1)
    assert losses[1] == pytest.approx(losses[0], abs=1e-6)  # step 1 trains with the warmup init lr 0
    assert losses[-1] < losses[0] - 0.5
    assert mtp[-1] < mtp[0] - 0.3


def test_log_lines_follow_the_pynative_loss_callback(repeated_run):
    config, request, result, calls, _ = repeated_run
    matches = _lines(result.log_path)
    assert len(matches) == 6
    for step, match in enumerate(matches, start=1):
        assert int(match["step"]) == step and int(match["total"]) == 6
        assert int(match["consumed"]) == 4 * step and int(match["gbs"]) == 4
        assert float(match["lr"]) == pytest.approx(warmup_lr(config.training, step + 1))  # the next step's lr
        assert match["lbl"] is None  # dense: no load balancing loss
        assert match["logdir"] == str((request.output_dir / "log").resolve())
    assert "{ step:[    1/    6], consumed_samples: 4, global_batch_size: 4, loss:   7.6" in result.log_path.read_text()

    frame = parse_mindformers_log(result.log_path)
    assert list(frame["step"]) == list(range(1, 7))
    np.testing.assert_allclose(frame["lm_loss"], [float(m["loss"]) for m in matches])

    assert [(step, total) for step, total, _ in calls] == [(k, 6) for k in range(1, 7)]
    assert calls[-1][2]["lm_loss"] == pytest.approx(float(matches[-1]["loss"]), abs=1e-6)
    assert set(calls[0][2]) == {"lm_loss", "mtp_1_loss", "lr", "grad_norm", "step_time_ms"}


def test_base_run_saves_a_checkpoint_2_0(repeated_run):
    config, request, result, _, _ = repeated_run
    assert result.checkpoint_dir == request.checkpoint_dir
    assert (request.checkpoint_dir / "latest_checkpointed_iteration.txt").read_text() == "6"
    common = json.loads((request.checkpoint_dir / "iteration_00000006" / "common.json").read_text())
    assert common == {"epoch_num": 1, "step_num": 6, "global_step": 6, "loss_scale": 1.0, "global_batch_size": 4,
                      "consumed_samples": 24, "ckpt_status": None}
    # file names and optimizer entries as MindFormers 2.1.0's pynative CheckpointCallback writes them
    assert sorted(p.name for p in (request.checkpoint_dir / "iteration_00000006").iterdir()) == [
        "common.json", "qwen35-model-0000000-0000001.safetensors", "qwen35-opt-0000000-0000001.safetensors"]
    checkpoint = read_mindformers_checkpoint(request.checkpoint_dir)
    model = checkpoint.model_state()
    optimizer = checkpoint.optimizer_state()
    assert all(t.dtype == torch.float32 for t in model.values())
    assert checkpoint.buffer_entries() == {}  # dense: no MoE buffers
    assert set(optimizer) == {f"adam_m.{n}" for n in model} | {f"adam_v.{n}" for n in model} | {"global_step"}
    assert optimizer["global_step"].dtype == torch.int64 and optimizer["global_step"].tolist() == [6]
    assert float(optimizer["adam_v.output_layer.weight"].abs().max()) > 0


def test_gradient_accumulation_matches_one_large_micro_batch(tmp_path):
    whole = _config(base_train_iters=2, micro_batch_size=4, lr_warmup_iters=0)
    split = _config(base_train_iters=2, micro_batch_size=2, lr_warmup_iters=0)
    batches = _batches(whole, 2, seed=3)
    a = _lines(train_on_batches(_request(whole, tmp_path, "whole"), batches).log_path)
    b = _lines(train_on_batches(_request(split, tmp_path, "split"), batches).log_path)
    for x, y in zip(a, b):
        assert float(x["loss"]) == pytest.approx(float(y["loss"]), abs=2e-6)
        assert float(x["mtp"]) == pytest.approx(float(y["mtp"]), abs=2e-6)
        assert float(x["norm"]) == pytest.approx(float(y["norm"]), rel=1e-4)


def test_align_from_a_base_checkpoint_continues_where_it_stopped(tmp_path):
    """Base for 2 steps, then align from its checkpoint: the align run's first loss is the loss a
    3-step base run logs at step 3 (same weights, same batch), in fp32 and, nearly, from bf16."""
    config = _config(base_train_iters=2, train_iters=1, lr_warmup_iters=0)
    batches = _batches(config, 3, seed=5)
    base = train_on_batches(_request(config, tmp_path, "base2"), batches[:2])
    longer = _config(base_train_iters=3, train_iters=1, lr_warmup_iters=0)
    step3 = float(_lines(train_on_batches(_request(longer, tmp_path, "base3"), batches).log_path)[2]["loss"])

    aligned = train_on_batches(_request(config, tmp_path, "align", mode="align", init=base.checkpoint_dir),
                               batches[2:])
    assert aligned.checkpoint_dir is None
    assert float(_lines(aligned.log_path)[0]["loss"]) == pytest.approx(step3, abs=2e-6)

    state = read_mindformers_checkpoint(base.checkpoint_dir).model_state()
    bf16_root = tmp_path / "bf16"
    write_mindformers_checkpoint(bf16_root, 2, {k: v.to(torch.bfloat16) for k, v in state.items()}, None,
                                 default_common(2, 4))
    from_bf16 = train_on_batches(_request(config, tmp_path, "align16", mode="align", init=bf16_root), batches[2:])
    assert float(_lines(from_bf16.log_path)[0]["loss"]) == pytest.approx(step3, abs=5e-3)


def test_moe_logs_the_mean_unscaled_load_balancing_loss_and_saves_the_token_counts(tmp_path):
    config = _config("qwen35_moe_tiny", base_train_iters=1)
    result = train_on_batches(_request(config, tmp_path, "moe"), _batches(config, 1))
    match = _lines(result.log_path)[0]
    # a balanced router gives about 1.0 per layer; the coefficient (0.001) is divided out
    assert 0.9 < float(match["lbl"]) < 1.5
    # every MoE layer, the MTP one too, saves mlp.tokens_per_expert: one forward of 4 x 32 tokens, top-2
    buffers = read_mindformers_checkpoint(result.checkpoint_dir).buffer_state()
    m = config.model
    assert sorted(buffers) == sorted([f"decoder.layers.{i}.mlp.tokens_per_expert" for i in range(m.num_layers)]
                                     + ["mtp.layers.0.transformer_layer.mlp.tokens_per_expert"])
    for counts in buffers.values():
        assert counts.dtype == torch.float32 and counts.shape == (m.num_experts,)
        assert float(counts.sum()) == 4 * 32 * m.moe_router_topk and bool((counts > 0).all())


def test_align_without_a_checkpoint_is_refused(tmp_path):
    config = _config()
    with pytest.raises(TrainingSetupError, match="init_checkpoint"):
        train_on_batches(_request(config, tmp_path, "x", mode="align"), _batches(config, 3))


def test_wrongly_shaped_batches_are_refused_naming_the_step(tmp_path):
    config = _config(base_train_iters=1)
    with pytest.raises(TrainingSetupError, match="step 1"):
        train_on_batches(_request(config, tmp_path, "x"), [np.zeros((4, 10), np.int64)])


def test_backend_reads_the_mindformers_sample_order_and_reruns_identically(tmp_path):
    """train() on the prepared dataset equals a second run on batches_for's batches: the same order,
    and the same numbers run to run (timestamps and step times aside)."""
    from crossalign.sides.registry import batches_for
    from crossalign.data.prepare import prepare_dataset

    files = prepare_dataset(tmp_path / "data", 2048)
    config = _config(base_train_iters=2)
    request = TrainRequest(config=config, side="mindformers", mode="base", data=files, output_dir=tmp_path / "run")
    result = LocalMindFormersBackend().train(request)
    expected = train_on_batches(_request(config, tmp_path, "direct"),
                                batches_for("mindformers", config.training, files.prefix, num_samples=8))
    assert _without_times(result.log_path) == _without_times(expected.log_path)
    assert result.iterations == 2 and result.checkpoint_dir == request.checkpoint_dir


def test_a_release_2_0_0_run_prints_its_mtp_loss_scaled_and_compares_it_unscaled_against_megatron(tmp_path):
    """MindFormers 2.0.0 prints mtp_1_loss multiplied by mtp_loss_scaling_factor / mtp_num_layers
    (pynative/transformers/multi_token_prediction.py:644-649) and the compare divides it back; an embedded run
    claiming 2.0.0 prints it so, and its MTP loss then equals the embedded megatron-core run's, which prints it
    unscaled (with the 2.1.0 line the compare would read it 1 / 0.3 times too large)."""
    from crossalign.sides.megatron.embedded.trainer import run_training
    from crossalign.checkpoint.convert import convert_checkpoint
    from crossalign.models.layout import random_mindformers_state
    from crossalign.sides.megatron.checkpoint import read_megatron_checkpoint
    from crossalign.report.compare import options_from_config, parse_both

    config = _config(train_iters=2, lr_warmup_iters=1, mindformers_version="2.0.0")
    config = config.model_copy(update={"model": config.model.model_copy(update={"mtp_loss_scaling_factor": 0.3})})
    state = random_mindformers_state(config.model, seed=3)
    write_mindformers_checkpoint(tmp_path / "mindformers", 1, state, None, default_common(1, 4))
    batches = _batches(config, 2, seed=7)
    ms = train_on_batches(_request(config, tmp_path, "ms", mode="align", init=tmp_path / "mindformers"), batches)
    text = ms.log_path.read_text()
    assert "[mindformers/pynative/callback/loss_callback.py:310] - INFO - { step:[    1/    2], loss: " in text
    assert "consumed_samples" not in text  # 2.0.0 prints neither consumed_samples nor global_batch_size

    convert_checkpoint(config.model, "ms2mg", tmp_path / "mindformers", tmp_path / "converted",
                       core_version=config.training.megatron_core_version, dtype="fp32")
    checkpoint = read_megatron_checkpoint(tmp_path / "converted", config.model)
    request = TrainRequest(config=config, side="megatron", mode="align", data=DatasetFiles(tmp_path / "none", tmp_path),
                           output_dir=tmp_path / "megatron", init_checkpoint=tmp_path / "converted")
    mg = run_training(request, checkpoint.state, checkpoint.iteration, batches)

    npu, gpu = parse_both(ms.log_path, mg.log_path, options_from_config(config))
    printed = np.array([float(line.split("mtp_1_loss: ")[1].split(",")[0]) for line in text.splitlines()])
    np.testing.assert_allclose(npu["mtp_1_loss"], printed / 0.3)
    assert float(npu["mtp_1_loss"].iloc[0]) == pytest.approx(np.log(2048), abs=0.1)  # the plain cross entropy
    np.testing.assert_allclose(npu["lm_loss"], gpu["lm_loss"], atol=2e-6)
    np.testing.assert_allclose(npu["mtp_1_loss"], gpu["mtp_1_loss"], atol=1e-5)
