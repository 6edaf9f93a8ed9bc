"""What the tests of the embedded Megatron trainers share: a tiny config with other training settings, a seeded
initial state, and the shape of Megatron's training_log iteration line that the trainers write."""

from __future__ import annotations

import re

import torch

from crossalign.config import load_config
from crossalign.models.torch_model import Qwen35Model

LINE = re.compile(
    r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] iteration +(?P<it>\d+)/ +(?P<total>\d+) \|"
    r" consumed samples: +(?P<consumed>\d+) \| elapsed time per iteration \(ms\): [0-9.]+ \|"
    r" learning rate: (?P<lr>[0-9.]+E[+-]\d+) \| global batch size: +(?P<gbs>\d+) \|"
    r" lm loss: (?P<lm>[0-9.]+E[+-]\d+) \|(?: load_balancing_loss: (?P<aux>[0-9.]+E[+-]\d+) \|)?"
    r" mtp_1 loss: (?P<mtp>[0-9.]+E[+-]\d+) \| loss scale: 1\.0 \| grad norm: (?P<grad>[0-9.]+) \|"
    r" number of skipped iterations: +0 \| number of nan iterations: +0 \|$"
)


def config_with(name: str, **training):
    config = load_config(name)
    return config.model_copy(update={"training": config.training.model_copy(update=training)})


def initial_state(config, seed=3):
    torch.manual_seed(seed)
    return Qwen35Model(config.model, config.training.megatron_core_version).state_dict()


def iteration_lines(lines):
    matches = [LINE.match(line) for line in lines if " iteration " in line and "loss" in line]
    assert all(matches), [line for line, m in zip(lines, matches) if not m]
    return matches
