"""The parts of the orchestration that need no Prefect server: the step table that drives store, tasks and
flows, the run request (config overrides, the run form's fields and words), failure kinds and retry
policy, the deployments file, the CLI's verdict from the flow's state, the nightly regression rule and
history."""

from __future__ import annotations

import subprocess
import sys
from datetime import date
from pathlib import Path

import pytest
import yaml

from crossalign.agents.worker import NIGHTLY_TIMEZONE_ENV
from crossalign.config import ConfigError, OverrideError, parse_override
from crossalign.dag import HF_IMPORT, STEP_NAMES, STEPS
from crossalign.flows.launch import (STEP_FLOW, STEP_FLOW_ENTRYPOINT, classify, deployment_name,
                                    missing_step_deployments)
from crossalign.flows.retry import backoff_delays, retry_on_infrastructure
from crossalign.request import RunRequest
from crossalign.tasks.errors import (
    EXIT_DETERMINISTIC,
    InfrastructureError,
    StepFailed,
    exit_code_error,
)
from crossalign.tasks.regression import find_regressions, history_entry, history_rows, plot_trend, record

REPO = Path(__file__).resolve().parent.parent


def _resolve_config(config: str, overrides: list[str]):
    resolved = RunRequest(config=config, overrides=overrides).resolve()
    return resolved.config, resolved.config_source


def test_overrides_are_applied_and_validated():
    config, path = _resolve_config("qwen35_dense_tiny", ["training.train_iters=7", "training.lr=1e-3",
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
        _resolve_config("qwen35_dense_tiny", [override])
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
    for step in (*STEPS, HF_IMPORT):  # the step flow, once per way of carrying a step out, on its pool
        entry = deployments[deployment_name(step)]
        assert entry["work_pool"]["name"] == step.pool and entry["parameters"] == {"step": step.name}, entry
    assert sorted(name for name in deployments if name.startswith(f"{STEP_FLOW}/")) == sorted(
        deployment_name(step) for step in (*STEPS, HF_IMPORT)), "no step deployment the table does not name"
    assert import_object(STEP_FLOW_ENTRYPOINT).name == STEP_FLOW
    assert missing_step_deployments(spec["deployments"]) == []
    without_convert = [entry for entry in spec["deployments"] if entry["name"] != "convert"]
    assert missing_step_deployments(without_convert) == [
        "step/convert on the cpu pool with parameters {step: convert}"], "what `crossalign deploy` refuses"
    for parent in ("alignment/dense", "alignment/moe", "alignment/dense-tiny", "alignment/moe-tiny",
                   "rerun/rerun", "nightly/nightly"):
        assert deployments[parent]["work_pool"]["name"] == "orchestrator"
    assert deployments["alignment/dense-tiny"]["parameters"]["config"] == "qwen35_dense_tiny"
    assert deployments["alignment/moe-tiny"]["parameters"]["config"] == "qwen35_moe_tiny"
    nightly = deployments["nightly/nightly"]
    assert nightly["schedules"][0]["cron"] == "0 2 * * *"
    # the zone `crossalign deploy` gives it, stated in the description; what it aligns is the site's nightly.configs
    zone = "{{ " + NIGHTLY_TIMEZONE_ENV + " }}"
    assert nightly["schedules"][0]["timezone"] == zone and f"at 02:00 {zone};" in nightly["description"]
    assert nightly["parameters"] == {"mode": "distributed"}
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
    assert rerun["properties"]["dump"]["default"] is False  # the form's checkbox for rerun --dump
    assert rerun["properties"]["step"]["enum"] == list(STEP_NAMES)
    assert rerun["properties"]["dump_level"]["anyOf"][0]["enum"] == ["L0", "mix"]
    assert rerun["properties"]["dump_task"]["anyOf"][0]["enum"] == ["statistics", "md5", "tensor"]
    step = parameter_schema(import_object("crossalign.flows.steps:step_flow").fn).model_dump()
    assert step["required"] == ["step", "run_id"] and step["properties"]["step"]["enum"] == list(STEP_NAMES)


def test_form_lists_take_items_with_or_without_quotes_and_errors_name_the_form_field():
    from crossalign.request import as_typed, form_error

    assert as_typed(['"training.train_iters=10"', " training.seq_length=64 ", "'qwen35_moe_tiny'", "", '""']) == [
        "training.train_iters=10", "training.seq_length=64", "qwen35_moe_tiny"]
    assert as_typed(None) == []
    for bad in (["training.trian_iters=3"], ["training.train_iters"], ["training.train_iters=0"]):
        with pytest.raises(ConfigError) as raised:
            _resolve_config("qwen35_dense_tiny", bad)
        assert "--set" not in form_error(raised.value) and "overrides" in form_error(raised.value), form_error(
            raised.value)


# ---- the step table drives store, tasks and flows ----------------------------------------------------------


def _dataset(folder: Path):
    from crossalign.data.files import DatasetFiles

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corpus.bin").write_bytes(bytes(range(256)) * 8)
    (folder / "corpus.idx").write_bytes(b"MMIDIDX\x00\x00" + bytes(40))
    (folder / "tokenizer.json").write_text('{"model": "bpe"}')
    return DatasetFiles(prefix=folder / "corpus", tokenizer=folder / "tokenizer.json")


def _prepared(tmp_path: Path, run_id: str = "r1", **fields):
    from crossalign.tasks.prepare import prepare_run

    data = _dataset(tmp_path / "data")
    return prepare_run(RunRequest(config="qwen35_dense_tiny", run_id=run_id, store=str(tmp_path / "store"),
                                  dataset_prefix=str(data.prefix), tokenizer=str(data.tokenizer), **fields).resolve())


def _converted(run, spec, site, on_step=None):
    """A stand-in step function, named by the test's step table."""
    with run.commit(spec.name, command="stand-in") as out:
        (out.dir / "made-by").write_text(f"{spec.name} on {spec.pool}")
    return run.manifest(spec.name)


def test_a_steps_pool_timeout_deployment_and_function_come_from_its_spec(tmp_path, monkeypatch):
    """Change one row of the table (convert on gpu, training train_iters iterations, another function): the
    store's pool, the flow's time limit and deployment and the function run_step calls all follow it."""
    import dataclasses
    from operator import attrgetter

    from crossalign import dag
    from crossalign.flows.launch import step_timeout
    from crossalign.site import STEP_SETUP_S, SiteConfig
    from crossalign.tasks import run_step

    run = _prepared(tmp_path)
    site = SiteConfig.model_validate({"iteration_timeout_s": 10})
    assert run.pool("convert") == "cpu" and step_timeout(run, "convert", site) == STEP_SETUP_S
    moved = dataclasses.replace(dag.step_spec("convert"), pool="gpu", trains=attrgetter("train_iters"),
                                function="test_flow_units:_converted", deployment="convert-on-gpu")
    monkeypatch.setattr(dag, "STEPS", tuple(moved if spec.name == "convert" else spec for spec in dag.STEPS))
    assert run.pool("convert") == "gpu"
    assert step_timeout(run, "convert", site) == STEP_SETUP_S + 10 * run.config.training.train_iters
    assert deployment_name(run.spec("convert")) == f"{STEP_FLOW}/convert-on-gpu"
    for upstream in ("base-train", "cast-bf16"):  # committed by hand: convert reads cast-bf16
        with run.commit(upstream, command="by hand") as out:
            (out.dir / "checkpoint").mkdir()
    manifest = run_step(run, "convert", site)
    assert (run.step_dir("convert") / "made-by").read_text() == "convert on gpu" and manifest["command"] == "stand-in"


def test_the_table_names_each_steps_side_function_and_the_compared_trainings():
    from crossalign.dag import COMPARED, TRAIN, step_for
    from crossalign.report.live import SIDES
    from crossalign.sides.registry import side_of_pool
    from crossalign.stop import STOPPABLE
    from crossalign.tasks import step_function

    for spec in (*STEPS, HF_IMPORT):
        assert callable(step_function(spec)), spec.function
        if spec.function == TRAIN:  # the training steps: their side is their pool's
            assert spec.side == side_of_pool(spec.pool).name and spec.trains is not None
        else:
            assert spec.side is None and spec.trains is None
    assert STOPPABLE == tuple(spec.name for spec in COMPARED) == ("megatron-train", "pynative-train")
    assert SIDES == {"gpu": "megatron-train", "npu": "pynative-train"}
    hf = step_for("base-train", {"from": "huggingface", "path": "/hf"})
    assert hf is HF_IMPORT and hf.pool == "cpu" and hf.dirname == "01-base-train" and hf.iterations(None) == 0
    assert step_for("base-train", {"from": "base-train"}) is STEPS[0] and step_for("convert", {"from": "huggingface"})\
        is STEPS[2]


def test_the_training_steps_are_one_function_told_apart_by_their_specs(tmp_path, monkeypatch):
    """base-train trains from a random init and saves; the alignment trainings start from their input's
    checkpoint and only log, each on its side."""
    from crossalign.dag import step_spec
    from crossalign.sides.protocol import TrainResult
    from crossalign.site import SiteConfig
    from crossalign.tasks import run_step, training

    asked = []

    class Backend:
        name = "stand-in"

        def train(self, request):
            asked.append(request)
            request.log_path.write_text("log\n")
            return TrainResult(request.log_path, None, request.iterations, 0.0)

    monkeypatch.setattr(training, "training_backend", lambda pool, site: Backend())
    run = _prepared(tmp_path)
    for step in ("base-train", "cast-bf16", "convert"):
        if step == "base-train":
            run_step(run, step, SiteConfig())
        else:
            with run.commit(step, command="by hand") as out:
                (out.dir / "checkpoint").mkdir()
    for step in ("megatron-train", "pynative-train"):
        run_step(run, step, SiteConfig())
    seen = {(r.side, r.mode, r.save, None if r.init_checkpoint is None else r.init_checkpoint.parent.name)
            for r in asked}
    assert seen == {("mindformers", "base", True, None), ("megatron", "align", False, "03-convert"),
                    ("mindformers", "align", False, "02-cast-bf16")}
    assert run.manifest("base-train")["command"].endswith("--step base-train")
    assert [step_spec(s).function for s in ("base-train", "megatron-train")] == ["crossalign.tasks.training:train"] * 2


# ---- the run request ----------------------------------------------------------------------------------------


def test_the_alignment_forms_fields_are_the_run_requests_own():
    import inspect

    from crossalign.flows.alignment import alignment

    parameters = inspect.signature(alignment.fn).parameters
    assert list(parameters) == list(RunRequest.model_fields)
    assert RunRequest(**{name: p.default for name, p in parameters.items()}) == RunRequest()


def test_the_run_request_refuses_bad_input_naming_the_forms_field():
    from crossalign.request import RequestError, form_error
    from crossalign.store import StoreError

    with pytest.raises(ConfigError) as raised:
        RunRequest(config="qwen35_dense_tiny", overrides=['"training.trian_iters=3"']).resolve()
    said = form_error(raised.value)
    assert "training.trian_iters: unknown field" in said and "overrides" in said and "--set" not in said, said
    with pytest.raises(OverrideError) as raised:
        RunRequest(config="qwen35_dense_tiny", overrides=["training.train_iters"]).resolve()
    assert form_error(raised.value).startswith("overrides: 'training.train_iters': expected KEY=VALUE")
    with pytest.raises(ConfigError, match="no_such_model: no such config file"):
        RunRequest(config="no_such_model").resolve()
    with pytest.raises(RequestError, match="^dataset_prefix and tokenizer go together: give both or neither$"):
        RunRequest(dataset_prefix="/data/corpus")
    with pytest.raises(RequestError, match="^config: give a config, or the run_id of an existing run to reopen$"):
        RunRequest(config=" ", run_id="")
    with pytest.raises(RequestError, match="^retries: Input should be greater than or equal to 0$"):
        RunRequest(retries=-1)
    with pytest.raises(RequestError, match=r"^rerun\.0: Input should be 'base-train', "):
        RunRequest(rerun=["convrt"])
    with pytest.raises(StoreError) as raised:
        RunRequest(from_hf="/nowhere").resolve()
    assert form_error(raised.value).startswith("from_hf /nowhere: no config.json there")
    assert RunRequest(overrides=['"training.train_iters=10"', " ", "'model.mtp_num_layers=0'"],
                      rerun=[' "convert" ']).model_dump(include={"overrides", "rerun"}) == {
        "overrides": ["training.train_iters=10", "model.mtp_num_layers=0"], "rerun": ["convert"]}


def test_the_config_is_parsed_once_and_frozen_into_the_run(tmp_path, monkeypatch):
    import crossalign.request
    from crossalign.config import load_config

    loads = []
    monkeypatch.setattr(crossalign.request, "load_config", lambda *a: loads.append(a) or load_config(*a))
    run = _prepared(tmp_path, overrides=["training.train_iters=7"], mode="embedded")
    assert len(loads) == 1, loads
    assert run.config.training.train_iters == 7
    assert run.info["parameters"] == {"config": "qwen35_dense_tiny", "overrides": ["training.train_iters=7"],
                                      "mode": "embedded", "dataset": run.info["parameters"]["dataset"]}
    assert run.info["config_source"].endswith("qwen35_dense_tiny.yaml")


def test_a_flow_takes_the_resolution_its_caller_handed_over_for_its_own_request():
    from crossalign.request import handing_over, resolution

    resolved = RunRequest(config="qwen35_dense_tiny", run_id="r1", store="/tmp/store").resolve()
    with handing_over(resolved):
        assert resolution(RunRequest(**resolved.request.form())) is resolved
        other = resolution(RunRequest(**{**resolved.request.form(), "run_id": "r2"}))
        assert other is not resolved and other.run_id == "r2"
    assert resolution(RunRequest(**resolved.request.form())) is not resolved


# ---- the CLI's outcome is the flow's -------------------------------------------------------------------------


@pytest.fixture
def cli_with_flow(tmp_path, monkeypatch):
    """``crossalign run`` in this process, its alignment flow replaced by one that returns the given state (and
    records the request it was handed); no Prefect, and nothing in the store."""
    from typer.testing import CliRunner

    import crossalign.cli.run
    import crossalign.flows.alignment
    from crossalign.cli import app
    from crossalign.request import resolution

    site = tmp_path / "site.yaml"
    site.write_text(f"store: {tmp_path / 'store'}\n")
    monkeypatch.setenv("CROSSALIGN_SITE", str(site))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setattr(crossalign.cli.run, "quiet_prefect", lambda verbose: None)
    handed = []

    def invoke(state, *args: str):
        def alignment(return_state: bool, **form):
            handed.append(resolution(RunRequest(**form)))
            return state
        monkeypatch.setattr(crossalign.flows.alignment, "alignment", alignment)
        return CliRunner().invoke(app, ["run", "qwen35_dense_tiny", *args], env={"COLUMNS": "200"})

    invoke.handed = handed
    return invoke


def test_the_cli_prints_the_verdict_of_the_flows_state_and_exits_by_it(cli_with_flow, tmp_path):
    """No summary.json anywhere (the run is not even in the store): what is printed and the exit code are the
    state's. The flow got the request the CLI resolved, not one it would have parsed again."""
    from prefect.states import Completed

    from crossalign.flows.outcome import failed

    report = "http://reports:8080/r1/06-compare/report.html"
    passed = cli_with_flow(Completed(message="run r1: verdict pass", data={
        "run_id": "r1", "verdict": "pass", "report": report, "summary": {"verdict": "pass"}}),
        "--run-id", "r1", "--set", "training.train_iters=30")
    assert passed.exit_code == 0, passed.output
    assert f"verdict: pass    report: {report}" in passed.output
    request = cli_with_flow.handed[0].request
    assert (request.run_id, request.mode, request.overrides, request.store) == (
        "r1", "embedded", ["training.train_iters=30"], str(tmp_path / "store"))
    assert cli_with_flow.handed[0].config.training.train_iters == 30
    assert not (tmp_path / "store" / "r1").exists()

    fail = cli_with_flow(failed("run r2: verdict fail", {"run_id": "r2", "verdict": "fail", "report": "r.html"}),
                         "--run-id", "r2")
    assert fail.exit_code == 1 and "verdict: fail    report: r.html" in fail.output, fail.output
    invalid = cli_with_flow(failed("run r3: verdict invalid", {"run_id": "r3", "verdict": "invalid",
                                                               "report": "r.html"}), "--run-id", "r3")
    assert invalid.exit_code == 2 and "verdict: invalid" in invalid.output, invalid.output


def test_the_cli_tells_bad_input_from_a_failed_step_by_the_flows_state(cli_with_flow):
    from prefect.states import Failed

    from crossalign.flows.outcome import failed
    from crossalign.tasks.errors import PreflightFailed

    bad = cli_with_flow(failed("refused", cause=PreflightFailed("sample order differs")), "--run-id", "b1")
    assert bad.exit_code == 2 and "run b1: invalid input: step preflight: sample order differs" in bad.output
    broken = cli_with_flow(Failed(message="failed", data=StepFailed("convert", "missing key")), "--run-id", "b2")
    assert broken.exit_code == 1 and "run b2 failed: StepFailed: step convert: missing key" in broken.output
    refused = cli_with_flow(Failed(), "--run-id", "b3", "--set", "training.trian_iters=3")
    assert refused.exit_code == 2 and "training.trian_iters: unknown field" in refused.output
    assert len(cli_with_flow.handed) == 2, "a request refused by the CLI starts no flow"


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


def test_the_rerun_form_offers_what_crossalign_rerun_offers():
    """Every option of `crossalign rerun` is a field of the UI's rerun form (the rerun flow, which the command runs),
    under the form's name; the form's dump fields are checked as the command's options are, named as the form names
    them."""
    import typer
    from prefect.utilities.callables import parameter_schema

    from crossalign.cli import app
    from crossalign.dump_settings import DumpSettings, rerun_dump
    from crossalign.flows.alignment import rerun

    command = typer.main.get_command(app).commands["rerun"]
    form_name = {"run_id": "run_id", "step": "step", "store": "store", "distributed": "mode", "retries": "retries",
                 "retry_delay": "retry_delay_s", "dump": "dump", "dump_step": "dump_step", "dump_level": "dump_level",
                 "dump_task": "dump_task", "verbose": None}  # verbose: the terminal's Prefect log lines
    assert {param.name for param in command.params} == set(form_name)
    form = parameter_schema(rerun.fn).model_dump()["properties"]
    assert {name for name in form_name.values() if name} <= set(form), sorted(form)
    base = DumpSettings(step=2, task="md5")
    assert rerun_dump(base, True, {"step": None, "level": "mix", "task": None}, option="dump", separator="_") == \
        DumpSettings(step=2, level="mix", task="md5")
    with pytest.raises(ValueError, match="^dump_step is given without dump$"):
        rerun_dump(base, False, {"step": 1}, option="dump", separator="_")
    with pytest.raises(ValueError, match="^dump_task: Input should be 'statistics', 'md5' or 'tensor'"):
        rerun_dump(None, True, {"task": "tensors"}, option="dump", separator="_")


def test_a_later_attempt_of_a_flow_run_takes_the_run_id_its_first_attempt_named_it_after(prefect_client_settings):
    """An automatic retry of a flow run in its own process (Prefect's flow retries; a Retry in the UI is the same
    flow run in a new process, tests/test_flow_distributed.py): the first attempt finds no run id to keep and names
    the flow run after a new one; the second reads that name back from the server."""
    from prefect import flow

    from crossalign.flows.alignment import first_attempts_run_id, name_flow_run
    from crossalign.store import new_run_id

    made, kept = [], []

    @flow(retries=1, retry_delay_seconds=0)
    def two_attempts() -> None:
        kept.append(first_attempts_run_id())
        if not made:
            made.append(new_run_id("qwen35_dense_tiny"))
            name_flow_run(made[0])
            raise RuntimeError("the first attempt fails")

    assert two_attempts(return_state=True).is_completed()
    assert kept == [None, made[0]], (kept, made)
