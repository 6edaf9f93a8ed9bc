"""The parts of the orchestration that need no Prefect server: config overrides, failure kinds and
retry policy, the deployments file, the nightly regression rule and history."""

from __future__ import annotations

import subprocess
import sys
from datetime import date
from pathlib import Path

import pytest
import yaml

from crossalign.config import ConfigError
from crossalign.flows.launch import classify, deployment_name
from crossalign.flows.retry import backoff_delays, retry_on_infrastructure
from crossalign.store import STEP_NAMES, STEPS
from crossalign.tasks.errors import (
    EXIT_DETERMINISTIC,
    InfrastructureError,
    StepFailed,
    exit_code_error,
)
from crossalign.config import OverrideError, parse_override
from crossalign.tasks.prepare import resolve_config
from crossalign.tasks.regression import find_regressions, history_entry, history_rows, plot_trend, record

REPO = Path(__file__).resolve().parent.parent


def test_overrides_are_applied_and_validated():
    config, path = resolve_config("qwen35_dense_tiny", ["training.train_iters=7", "training.lr=1e-3",
                                                        "model.mtp_num_layers=0"])
    assert path.name == "qwen35_dense_tiny.yaml"
    assert config.training.train_iters == 7 and config.training.lr == 1e-3 and config.model.mtp_num_layers == 0
    assert parse_override("training.split=1,0,0") == (["training", "split"], "1,0,0")


@pytest.mark.parametrize("override, message", [
    ("training.trian_iters=3", "training.trian_iters: unknown field"),
    ("training.train_iters=0", "training.train_iters"),
    ("training.train_iters", "expected KEY=VALUE"),
    ("runtime.x=1", "keys start with 'model.', 'training.' or 'parallel.'"),
    ("training.lr.x=1", "training.lr is not a config section"),
    ("training.train_iters=[1", "not valid YAML"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(".", r"\.")):
        resolve_config("qwen35_dense_tiny", [override])
    assert issubclass(OverrideError, ValueError)


def test_exit_codes_of_a_step_process_tell_retry_from_no_retry():
    assert isinstance(exit_code_error("convert", -9), InfrastructureError)
    assert isinstance(exit_code_error("convert", 75), InfrastructureError)
    assert isinstance(exit_code_error("convert", 137), InfrastructureError)
    assert isinstance(exit_code_error("convert", EXIT_DETERMINISTIC), StepFailed)
    assert isinstance(exit_code_error("convert", 1), StepFailed)
    assert "killed by signal 9" in str(exit_code_error("convert", -9))
    assert isinstance(classify("convert", ValueError("bad key")), StepFailed)
    assert isinstance(classify("convert", ConnectionResetError("reset")), InfrastructureError)


def test_retry_condition_accepts_only_infrastructure_failures():
    from prefect.states import Failed

    assert retry_on_infrastructure(None, None, Failed(data=InfrastructureError("megatron-train", "worker lost")))
    assert not retry_on_infrastructure(None, None, Failed(data=StepFailed("convert", "missing key")))
    assert not retry_on_infrastructure(None, None, Failed(data=ValueError("bad input")))
    assert backoff_delays(10, 3) == [10, 30, 90]


def test_a_step_process_with_a_bad_run_exits_deterministic(tmp_path):
    done = subprocess.run([sys.executable, "-m", "crossalign.tasks", "--store", str(tmp_path), "--run", "nope",
                           "--step", "convert"], capture_output=True, text=True, timeout=120)
    assert done.returncode == EXIT_DETERMINISTIC
    assert f"no run 'nope' in {tmp_path}" in done.stderr


def test_prefect_yaml_routes_every_step_to_its_pool():
    from prefect.flows import Flow
    from prefect.utilities.importtools import import_object

    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    deployments = {}
    for entry in spec["deployments"]:
        flow = import_object(entry["entrypoint"])
        assert isinstance(flow, Flow), entry["entrypoint"]
        deployments[f"{flow.name}/{entry['name']}"] = entry
    for step in STEPS:
        entry = deployments[deployment_name(step.name)]
        assert entry["work_pool"]["name"] == step.pool
    for parent in ("alignment/dense", "alignment/moe", "alignment/dense-tiny", "alignment/moe-tiny",
                   "rerun/rerun", "nightly/nightly"):
        assert deployments[parent]["work_pool"]["name"] == "orchestrator"
    assert deployments["alignment/dense-tiny"]["parameters"]["config"] == "qwen35_dense_tiny"
    assert deployments["alignment/moe-tiny"]["parameters"]["config"] == "qwen35_moe_tiny"
    assert deployments["nightly/nightly"]["schedules"][0]["cron"] == "0 2 * * *"
    assert deployments["nightly/nightly"]["concurrency_limit"] == 1
    assert spec["pull"] == []


def test_run_forms_explain_every_parameter_as_written_and_take_what_a_user_types():
    """What the UI's run form shows is the flow's parameter schema: a description for every parameter, with
    nothing the UI would read as HTML (it drops <model>); config and the configs/overrides items are plain
    text fields (no "str | str" choice, no JSON quotes), the shipped configs named in the help; the six
    steps are the rerun form's choices."""
    import re

    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.importtools import import_object

    from crossalign.config import CONFIG_DIR

    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    for entrypoint in {entry["entrypoint"] for entry in spec["deployments"]}:
        properties = parameter_schema(import_object(entrypoint).fn).model_dump()["properties"]
        undocumented = [name for name, field in properties.items() if not field.get("description")]
        assert not undocumented, f"{entrypoint}: no description for {undocumented}"
        tags = {name: field["description"] for name, field in properties.items()
                if re.search(r"<[A-Za-z/!]", field["description"])}
        assert not tags, f"{entrypoint}: the UI would drop these as HTML: {tags}"
    alignment = parameter_schema(import_object("crossalign.flows.alignment:alignment").fn).model_dump()
    config = alignment["properties"]["config"]
    assert config["anyOf"] == [{"type": "string"}, {"type": "null"}], config
    shipped = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    assert all(name in config["description"] for name in shipped), config["description"]
    assert "MODEL-YYYYMMDD-HHMMSS-XXXX" in alignment["properties"]["run_id"]["description"]
    nightly = parameter_schema(import_object("crossalign.flows.nightly:nightly").fn).model_dump()
    for schema, name in ((alignment, "overrides"), (nightly, "configs"), (nightly, "overrides")):
        assert schema["properties"][name]["anyOf"][0] == {"items": {"type": "string"}, "type": "array"}, name
    rerun = parameter_schema(import_object("crossalign.flows.alignment:rerun").fn).model_dump()
    assert rerun["required"] == ["run_id", "step"]
    assert rerun["properties"]["step"]["enum"] == list(STEP_NAMES)


def test_form_lists_take_items_with_or_without_quotes_and_errors_name_the_form_field():
    from crossalign.flows.alignment import as_typed, form_error
    from crossalign.tasks.prepare import resolve_config

    assert as_typed(['"training.train_iters=10"', " training.seq_length=64 ", "'qwen35_moe_tiny'", "", '""']) == [
        "training.train_iters=10", "training.seq_length=64", "qwen35_moe_tiny"]
    assert as_typed(None) == []
    for bad in (["training.trian_iters=3"], ["training.train_iters"], ["training.train_iters=0"]):
        with pytest.raises(ConfigError) as raised:
            resolve_config("qwen35_dense_tiny", bad)
        assert "--set" not in form_error(raised.value) and "overrides" in form_error(raised.value), form_error(
            raised.value)


def _summary(verdict: str, lm: float, mtp: float) -> dict:
    return {"verdict": verdict, "series": {
        "lm_loss": {"status": "compared", "step1_rel_err": lm, "mean_rel_err": lm},
        "mtp_1_loss": {"status": "compared", "step1_rel_err": mtp, "mean_rel_err": mtp}}}


def test_regression_rule():
    night1, night2 = date(2026, 11, 1), date(2026, 11, 2)
    good = history_entry("dense", "r1", night1, _summary("pass", 1e-3, 1e-3))
    same = history_entry("dense", "r2", night2, _summary("pass", 1.5e-3, 0.8e-3))
    assert find_regressions(good, same) == []
    worse = history_entry("dense", "r2", night2, _summary("pass", 1e-3, 3e-3))
    assert find_regressions(good, worse) == ["dense: mtp_1_loss step1_rel_err 0.1% on 2026-11-01 -> 0.3% "
                                             "(more than 2x)",
                                             "dense: mtp_1_loss mean_rel_err 0.1% on 2026-11-01 -> 0.3% "
                                             "(more than 2x)"]
    noise = history_entry("dense", "r2", night2, _summary("pass", 1e-9, 1e-9))
    tiny_before = history_entry("dense", "r1", night1, _summary("pass", 1e-10, 1e-10))
    assert find_regressions(tiny_before, noise) == [], "errors at bf16 noise level are not regressions"
    failed = history_entry("dense", "r2", night2, _summary("fail", 0.2, 0.2))
    assert any("verdict pass on 2026-11-01 -> fail" in p for p in find_regressions(good, failed))
    crashed = history_entry("dense", "r2", night2, None, error="Crashed")
    assert find_regressions(good, crashed) == ["dense: no verdict (Crashed)"]
    assert find_regressions(None, same) == []


def test_history_keeps_one_entry_per_night_and_model_and_plots_a_trend(tmp_path):
    path = tmp_path / "nightly" / "history.json"
    record(path, [history_entry("dense", "a", date(2026, 11, 1), _summary("pass", 1e-3, 2e-3)),
                  history_entry("moe", "b", date(2026, 11, 1), _summary("pass", 3e-3, 4e-3))])
    history = record(path, [history_entry("dense", "c", date(2026, 11, 2), _summary("pass", 1e-3, 2e-3)),
                            history_entry("dense", "d", date(2026, 11, 1), _summary("fail", 1e-1, 2e-1))])
    assert [(e["date"], e["model"], e["run_id"]) for e in history] == [
        ("2026-11-01", "dense", "d"), ("2026-11-01", "moe", "b"), ("2026-11-02", "dense", "c")]
    rows = history_rows(history)
    assert rows[0]["verdict"] == "fail" and rows[0]["lm_loss mean_rel_err %"] == 10.0
    png = plot_trend(history, tmp_path / "trend.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
