"""The site's diagnose.dump setting becomes a config.json that msprobe 26.2.0's own config checkers accept."""

import json

import pytest

from crossalign.dump_settings import DumpSettings

SETTINGS = [
    DumpSettings(),
    DumpSettings(step=3, level="mix", task="md5", ranks=(0, 1)),
    DumpSettings(step=1, level="L0", task="tensor", ranks=(2,)),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: f"{s.level}-{s.task}")
def test_pytorch_checker_accepts(settings, tmp_path):
    from msprobe.pytorch.dump.pt_config import parse_json_config  # heavy: loads torch

    path = tmp_path / "config.json"
    path.write_text(json.dumps(settings.msprobe_config(tmp_path / "dump")))
    common, task = parse_json_config(str(path), None)
    assert common.task == ("tensor" if settings.task == "tensor" else "statistics")
    assert common.step == [settings.step] and common.rank == list(settings.ranks) and common.level == settings.level


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: f"{s.level}-{s.task}")
def test_mindspore_checker_accepts(settings, tmp_path):
    from msprobe.mindspore.dump.ms_config import parse_common_config, parse_task_config  # heavy: loads mindspore

    config = settings.msprobe_config(tmp_path / "dump")
    common = parse_common_config(config)
    parse_task_config(common.task, config)
    assert common.step == [settings.step] and common.level == settings.level
