"""The embedded Megatron trainer: Megatron's lr and loss semantics, its training_log lines, determinism."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from crossalign.data.files import DatasetFiles
from crossalign.sides.protocol import TrainRequest
from crossalign.models.torch_model import Qwen35Model, StateDictMismatch
from crossalign.sides.megatron.embedded.torch_trainer import _optimizer, megatron_lr, run_training
from crossalign.config import load_config
from helpers.embedded import config_with, initial_state, iteration_lines

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def random_batches(config, iterations, seed=0, repeat=False):
    t = config.training
    rng = np.random.default_rng(seed)
    shape = (1 if repeat else iterations, t.global_batch_size, t.seq_length + 1)
    tokens = rng.integers(0, config.model.vocab_size, shape, dtype=np.int64)
    return np.repeat(tokens, iterations, axis=0) if repeat else tokens


def train(tmp_path: Path, config, batches, state=None, name="run"):
    metrics = []
    request = TrainRequest(config=config, side="megatron", mode="align",
                           data=DatasetFiles(tmp_path / "corpus_text_document", tmp_path / "tokenizer.json"),
                           output_dir=tmp_path / name, init_checkpoint=tmp_path / "checkpoint",
                           on_step=lambda step, total, values: metrics.append(values))
    result = run_training(request, state if state is not None else initial_state(config), 7, batches)
    return result.log_path.read_text().splitlines(), metrics


def test_megatron_lr_warmup_counts_from_iteration_one():
    t = config_with("qwen35_dense_tiny", lr=1e-3, lr_warmup_iters=4, lr_warmup_init=1e-4).training
    assert [megatron_lr(t, k) for k in range(1, 7)] == pytest.approx([1e-4, 3.25e-4, 5.5e-4, 7.75e-4, 1e-3, 1e-3])
    assert megatron_lr(config_with("qwen35_dense_tiny", lr_warmup_iters=0).training, 1) == 3e-3


def test_log_lines_are_megatron_lines_with_the_iteration_two_mean(tmp_path):
    config = config_with("qwen35_dense_tiny", train_iters=4)
    lines, metrics = train(tmp_path, config, random_batches(config, 4))
    assert any(line.startswith(" loading checkpoint from ") and line.endswith("at iteration 7") for line in lines)
    assert any(line.startswith("  successfully loaded checkpoint from ") for line in lines)
    found = iteration_lines(lines)
    assert [int(m["it"]) for m in found] == [1, 2, 3, 4]
    assert [int(m["consumed"]) for m in found] == [4, 8, 12, 16]
    assert {int(m["total"]) for m in found} == {4} and {int(m["gbs"]) for m in found} == {4}
    # the printed lr is the next iteration's: 3e-3 * min(k, 5) / 5; the applied one lags by one
    assert [float(m["lr"]) for m in found] == pytest.approx([6e-4, 1.2e-3, 1.8e-3, 2.4e-3])
    assert [values["lr"] for values in metrics] == pytest.approx([0.0, 6e-4, 1.2e-3, 1.8e-3])

    true_lm = [values["lm_loss"] for values in metrics]
    true_mtp = [values["mtp_1_loss"] for values in metrics]
    printed_lm = [float(m["lm"]) for m in found]
    printed_mtp = [float(m["mtp"]) for m in found]
    # core 0.16: iteration 2 prints the mean of iterations 1 and 2, every other line its own value
    assert printed_lm == pytest.approx([true_lm[0], (true_lm[0] + true_lm[1]) / 2, true_lm[2], true_lm[3]], rel=2e-6)
    assert printed_mtp == pytest.approx([true_mtp[0], (true_mtp[0] + true_mtp[1]) / 2, true_mtp[2], true_mtp[3]], rel=2e-6)
    assert [float(m["grad"]) for m in found] == pytest.approx([v["grad_norm"] for v in metrics], abs=6e-4)
    assert printed_lm[1] != pytest.approx(true_lm[1], rel=1e-7)


@pytest.mark.parametrize("core", ["0.15.0", "0.20.0"])  # before the iteration-2 mean, and after its fix
def test_cores_without_the_iteration_two_mean_reset_after_the_first_iteration(tmp_path, core):
    config = config_with("qwen35_dense_tiny", train_iters=2, megatron_core_version=core)
    lines, metrics = train(tmp_path, config, random_batches(config, 2))
    found = iteration_lines(lines)
    assert [float(m["lm"]) for m in found] == pytest.approx([v["lm_loss"] for v in metrics], rel=2e-6)


def test_trains_on_one_thread_and_restores_the_process_settings(tmp_path):
    config = config_with("qwen35_dense_tiny", train_iters=1)
    seen = []
    request = TrainRequest(config=config, side="megatron", mode="align",
                           data=DatasetFiles(tmp_path / "corpus", tmp_path / "tokenizer.json"), output_dir=tmp_path,
                           on_step=lambda *_: seen.append((torch.get_num_threads(),
                                                           torch.are_deterministic_algorithms_enabled())))
    torch.set_num_threads(2)
    try:
        run_training(request, initial_state(config), 0, random_batches(config, 1))
        assert seen == [(1, True)]
        assert torch.get_num_threads() == 2 and not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.set_num_threads(1)


def test_moe_logs_the_mean_unscaled_aux_loss_per_moe_layer(tmp_path):
    config = config_with("qwen35_moe_tiny", train_iters=2)
    batches = random_batches(config, 2)
    state = initial_state(config)
    lines, metrics = train(tmp_path, config, batches, state=state)
    found = iteration_lines(lines)
    assert all(m["aux"] is not None for m in found)
    line = next(line for line in lines if " iteration " in line and "loss" in line)
    assert line.index(" lm loss:") < line.index(" load_balancing_loss:") < line.index(" mtp_1 loss:")

    net = Qwen35Model(config.model)
    net.load_state_dict(state)
    tokens = torch.as_tensor(batches[0])
    _, _, _, aux = net(tokens[:, :-1], tokens[:, 1:], torch.ones(4, config.training.seq_length))
    moe_layers = config.model.num_layers + config.model.mtp_num_layers
    expected = aux.item() / config.model.moe_aux_loss_coeff / moe_layers
    assert float(found[0]["aux"]) == pytest.approx(expected, rel=2e-6)
    assert 1.0 <= expected < 1.2  # a near-balanced router scores about 1 per layer


def test_first_iteration_trains_with_the_warmup_init_lr_and_loss_decreases(tmp_path):
    config = config_with("qwen35_dense_tiny", train_iters=8, lr_warmup_iters=2)
    _, metrics = train(tmp_path, config, random_batches(config, 8, repeat=True))
    lm = [values["lm_loss"] for values in metrics]
    assert lm[1] == lm[0]  # iteration 1 applied lr 0: the weights did not move
    assert lm[-1] < lm[0] - 0.3
    assert all(later < earlier for earlier, later in zip(lm[2:], lm[3:]))


def test_gradient_accumulation_over_micro_batches_matches_one_batch(tmp_path):
    whole = config_with("qwen35_dense_tiny", train_iters=2)
    split = config_with("qwen35_dense_tiny", train_iters=2, micro_batch_size=2)
    batches = random_batches(whole, 2)
    _, one = train(tmp_path, whole, batches, name="one")
    _, two = train(tmp_path, split, batches, name="two")
    for a, b in zip(one, two):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5), key


def test_same_request_twice_gives_identical_logs(tmp_path):
    config = config_with("qwen35_moe_tiny", train_iters=3)
    batches = random_batches(config, 3)
    first, _ = train(tmp_path, config, batches, name="first")
    second, _ = train(tmp_path, config, batches, name="second")

    def stable(lines):
        return [re.sub(r"\[[^\]]*\]|elapsed time per iteration \(ms\): [0-9.]+|datetime: .*|/\S+", "", line)
                for line in lines]

    assert stable(first) == stable(second)
    assert len(iteration_lines(first)) == 3


def test_refuses_to_start_on_missing_keys(tmp_path):
    config = config_with("qwen35_dense_tiny", train_iters=1)
    state = initial_state(config)
    del state["decoder.layers.2.self_attention.dt_bias"]
    with pytest.raises(StateDictMismatch, match=r"1 missing keys: decoder\.layers\.2\.self_attention\.dt_bias"):
        train(tmp_path, config, random_batches(config, 1), state=state)
    assert not any("lm loss" in line for line in (tmp_path / "run" / "train.log").read_text().splitlines())


def test_no_weight_decay_on_one_dimensional_parameters():
    config = load_config("qwen35_moe_tiny")
    net = Qwen35Model(config.model)
    decay, no_decay = _optimizer(net, config.training).param_groups
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in net.named_parameters()}
    assert {names[id(p)] for p in no_decay["params"]} == {n for n, p in net.named_parameters() if p.dim() == 1}
    assert "decoder.layers.0.self_attention.A_log" in {names[id(p)] for p in no_decay["params"]}
