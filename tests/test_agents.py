"""Agent bootstrap: machine probes per pool, the worker's environment, the automation definitions."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from crossalign.agents.automation import NIGHTLY, ZOMBIE, AutomationError, load_definition
from crossalign.agents.probe import missing, probe_imports, probe_pool
from crossalign.agents.worker import worker_argv, worker_environment
from crossalign.site import SiteConfig, SiteError, load_site


def test_probe_imports_in_a_separate_interpreter():
    found = probe_imports(["json", "no_such_module_for_crossalign"])
    assert found["json"]["ok"] is True
    assert found["no_such_module_for_crossalign"] == {
        "ok": False, "version": "ModuleNotFoundError: No module named 'no_such_module_for_crossalign'"}
    absent = probe_imports(["json"], python="/nonexistent/python3")
    assert absent["json"] == {"ok": False, "version": "interpreter /nonexistent/python3 not found"}


def test_real_gpu_pool_is_refused_without_its_interpreter_and_checkout(tmp_path):
    site = SiteConfig.model_validate({"backends": {"gpu": "megatron"},
                                      "megatron": {"path": str(tmp_path / "Megatron-LM"), "python": "/opt/none/python"}})
    checks = probe_pool("gpu", site)
    absent = {c.name: c.detail for c in missing(checks)}
    assert set(absent) == {"torch with CUDA", "TransformerEngine", "flash-linear-attention", "Megatron-LM checkout",
                           "GPU environment"}
    assert absent["torch with CUDA"] == "interpreter /opt/none/python not found"
    assert absent["GPU environment"].startswith("reading the GPU environment with /opt/none/python failed")
    assert "no pretrain_gpt.py there" in absent["Megatron-LM checkout"]


def test_real_npu_pool_needs_cann_and_a_mindformers_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)
    site = SiteConfig.model_validate({"backends": {"npu": "mindformers"},
                                      "mindformers": {"path": str(tmp_path), "python": "/opt/none/python"}})
    absent = {c.name for c in missing(probe_pool("npu", site))}
    assert absent == {"MindSpore", "CANN toolkit", "MindFormers checkout"}
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path))
    (tmp_path / "run_mindformer.py").write_text("")
    checks = {c.name: c for c in probe_pool("npu", site)}
    assert checks["CANN toolkit"].ok and checks["MindFormers checkout"].ok
    assert not checks["MindFormers Qwen3.5 model"].ok and not [name for name in checks if name.startswith("patch ")]
    with pytest.raises(ValueError, match="pool 'tpu'"):
        probe_pool("tpu", site)


def test_worker_gets_absolute_store_and_site_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    site_file = Path("site.yaml")
    site_file.write_text("store: shared/runs\n")
    monkeypatch.delenv("PREFECT_WORKER_QUERY_SECONDS", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    env = worker_environment(load_site(site_file), site_file)
    assert env == {"CROSSALIGN_STORE": str(tmp_path / "shared" / "runs"), "CROSSALIGN_SITE": str(tmp_path / "site.yaml"),
                   "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PREFECT_WORKER_QUERY_SECONDS": "1"}
    monkeypatch.setenv("PREFECT_WORKER_QUERY_SECONDS", "5")
    assert worker_environment(load_site(site_file), site_file)["PREFECT_WORKER_QUERY_SECONDS"] == "5"
    monkeypatch.setenv("CROSSALIGN_STORE", env["CROSSALIGN_STORE"])
    monkeypatch.setenv("CROSSALIGN_SITE", env["CROSSALIGN_SITE"])
    monkeypatch.chdir("/")
    assert load_site().store == tmp_path / "shared" / "runs", "a flow run in another directory finds the same store"
    argv = worker_argv("npu", limit=1)
    assert argv[:6] == [sys.executable, "-m", "prefect", "worker", "start", "--pool"]
    assert argv[6:9] == ["npu", "--type", "process"] and argv[-2:] == ["--limit", "1"]


def test_site_refuses_a_backend_on_the_wrong_pool(tmp_path):
    path = tmp_path / "site.yaml"
    path.write_text("backends: {npu: megatron}\n")
    with pytest.raises(SiteError, match="backends.npu.*cannot train on the npu pool"):
        load_site(path)
    path.write_text("megatron: {ssh_host: gpu9}\n")
    with pytest.raises(SiteError, match="ssh host 'gpu9' is not defined"):
        load_site(path)


def test_the_example_site_config_sets_and_explains_every_field(tmp_path):
    """crossalign.site.example.yaml is the site config's documentation: it loads, and every field of
    every section is set in it with a comment line naming it."""
    import yaml

    from crossalign.site import MindFormersSite, NightlySite, SshHost

    path = Path(__file__).resolve().parent.parent / "crossalign.site.example.yaml"
    site = load_site(path)
    raw = yaml.safe_load(path.read_text())
    comments = "\n".join(line for line in path.read_text().splitlines() if line.lstrip().startswith("#"))
    sections = {SiteConfig: [raw], MindFormersSite: [raw["mindformers"], raw["megatron"]],
                SshHost: list(raw["ssh_hosts"].values()), NightlySite: [raw["nightly"]]}
    for model, examples in sections.items():
        unset = set(model.model_fields) - {key for example in examples for key in example}
        assert not unset, f"{model.__name__}: {sorted(unset)} not in the example"
        unexplained = [name for name in model.model_fields if name not in comments]
        assert not unexplained, f"{model.__name__}: {unexplained} have no comment"
    assert site.report_url == "http://prefect.example:8080/" and site.prefect_api_url.endswith("/api")
    (tmp_path / "site.yaml").write_text("report_url: file:///runs\n")
    with pytest.raises(SiteError, match="report_url: .*'file:///runs' is not an http"):
        load_site(tmp_path / "site.yaml")


def test_the_nightly_and_the_server_data_are_the_sites(tmp_path, monkeypatch):
    """Without a site's word the nightly aligns the tiny configs in this machine's zone; a site names its configs
    and zone (an unknown zone is refused, named). The server's data and the record of what `crossalign down` ends
    live in one folder per site file (per working directory without one) under $CROSSALIGN_HOME."""
    from zoneinfo import ZoneInfo

    from crossalign.site import machine_timezone, site_home

    assert load_site(None).nightly.configs == ("qwen35_dense_tiny", "qwen35_moe_tiny")
    assert ZoneInfo(machine_timezone()) is not None
    monkeypatch.setenv("TZ", "Europe/Berlin")
    assert machine_timezone() == "Europe/Berlin"
    path = tmp_path / "site.yaml"
    path.write_text("nightly: {configs: [qwen35_dense], timezone: Asia/Shanghai}\n")
    assert load_site(path).nightly.timezone == "Asia/Shanghai" and load_site(path).nightly.configs == ("qwen35_dense",)
    path.write_text("nightly: {timezone: Mars/Olympus}\n")
    with pytest.raises(SiteError, match="nightly.timezone: .*'Mars/Olympus' is not an IANA time zone"):
        load_site(path)

    monkeypatch.setenv("CROSSALIGN_HOME", str(tmp_path / "home"))
    (tmp_path / "checkout-a").mkdir()
    (tmp_path / "checkout-b").mkdir()
    first, second = (site_home(tmp_path / name / "crossalign.site.yaml") for name in ("checkout-a", "checkout-b"))
    assert first.parent == second.parent == tmp_path / "home" / "sites" and first != second
    assert first.name.startswith("checkout-a-") and second.name.startswith("checkout-b-")
    monkeypatch.chdir(tmp_path / "checkout-a")
    assert site_home(None) != first and site_home(None).name.startswith("checkout-a-")


def test_automation_definitions_are_valid_prefect_automations():
    from prefect.automations import AutomationCore

    zombie = AutomationCore.model_validate(load_definition(ZOMBIE, {"ZOMBIE_AFTER_S": 120}))
    assert zombie.trigger.posture == "Proactive" and zombie.trigger.within.total_seconds() == 120
    assert zombie.actions[0].type == "change-flow-run-state" and zombie.actions[0].state.value == "CRASHED"
    ids = {"NIGHTLY_DEPLOYMENT_ID": "0b8e3f7a-7c50-4c3a-9d1f-3f1f9a0c1d2e",
           "WEBHOOK_BLOCK_ID": "5f0c1e9a-2b7d-4e8f-a1c3-9d8e7f6a5b4c"}
    nightly = AutomationCore.model_validate(load_definition(NIGHTLY, ids))
    assert nightly.trigger.posture == "Reactive"
    assert "prefect.flow-run.Failed" in nightly.trigger.expect
    assert str(nightly.actions[0].block_document_id) == ids["WEBHOOK_BLOCK_ID"]
    assert "{{ flow_run.name }}" in nightly.actions[0].subject, "Prefect's own templates stay for the server"
    with pytest.raises(AutomationError, match=r"placeholder \$\{WEBHOOK_BLOCK_ID\} has no value"):
        load_definition(NIGHTLY, {"NIGHTLY_DEPLOYMENT_ID": "x"})


def test_flow_runs_start_as_one_engine_process_of_this_interpreter():
    """prefect.yaml starts every flow run as `python3 -m prefect.engine`, and on the agent's PATH that
    python3 is the interpreter crossalign runs in (the probe checks it is there)."""
    import shutil

    import yaml

    from crossalign.agents.pools import FLOW_RUN_PYTHON
    from crossalign.agents.worker import flow_run_path

    spec = yaml.safe_load((Path(__file__).resolve().parent.parent / "prefect.yaml").read_text())
    commands = {d["name"] + ":" + d["entrypoint"]: d["work_pool"]["job_variables"].get("command")
                for d in spec["deployments"]}
    assert set(commands.values()) == {f"{FLOW_RUN_PYTHON} -m prefect.engine"}, commands
    found = shutil.which(FLOW_RUN_PYTHON, path=flow_run_path())
    assert found and Path(found).parent == Path(sys.executable).parent
    check = next(c for c in probe_pool("cpu", load_site(None)) if c.name == "flow-run interpreter")
    assert check.ok, check.detail


def test_an_agent_name_is_locked_on_its_machine_while_its_agent_or_worker_lives(tmp_path, monkeypatch):
    """The lock is held by a process (here a stand-in for a worker that outlived its agent, holding the
    descriptor); a second agent of the same name, pool and server is refused; the lock is free once that
    process is gone, and another server or name never collides."""
    import os
    import subprocess

    from crossalign.agents.worker import LOCK_DIR_ENV, AgentAlreadyRunning, hold_worker_lock

    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path / "locks"))
    api = "http://127.0.0.1:4200/api"
    fd = hold_worker_lock("gpu", "box-gpu", api)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=(fd,))
    os.close(fd)  # only the stand-in holds it now
    try:
        with pytest.raises(AgentAlreadyRunning, match=r"'box-gpu' of pool gpu .* already running.*agent pid"):
            hold_worker_lock("gpu", "box-gpu", api)
        os.close(hold_worker_lock("gpu", "box-gpu", "http://other:4200/api"))
        os.close(hold_worker_lock("gpu", "box-gpu-2", api))
    finally:
        holder.kill()
        holder.wait()
    os.close(hold_worker_lock("gpu", "box-gpu", api))


def test_every_step_has_a_default_timeout_from_its_config_and_the_site_overrides_it(tmp_path):
    from crossalign.config import load_config
    from crossalign.flows.launch import step_timeout
    from crossalign.site import STEP_SETUP_S
    from crossalign.store import RunStore

    config = load_config("qwen35_dense_tiny")
    run = RunStore(tmp_path).create_run("r1", config, config_source="x", parameters={}, code_version={})
    site = SiteConfig.model_validate({"iteration_timeout_s": 10})
    training = config.training
    assert step_timeout(run, "megatron-train", site) == STEP_SETUP_S + 10 * training.train_iters
    assert step_timeout(run, "base-train", site) == STEP_SETUP_S + 10 * training.base_train_iters
    assert step_timeout(run, "convert", site) == STEP_SETUP_S
    assert step_timeout(run, "pynative-train", SiteConfig.model_validate({"step_timeout_s": 90})) == 90
    with pytest.raises(ValueError, match="step_timeout_s"):
        SiteConfig.model_validate({"step_timeout_s": 0})


def test_embedded_gpu_pool_holds_the_gpu_environment_check():
    """The embedded GPU side's probe reads this Python's versions into the known-bad table: nothing the pinned
    versions are refused for, and megatron-core 0.16 with fla 0.6 named as outside its tested range."""
    checks = probe_pool("gpu", SiteConfig.model_validate({"backends": {"gpu": "local"}}))
    environment = {c.name: c for c in checks if c.name.startswith("GPU environment")}
    assert not [c for c in environment.values() if c.required and not c.ok]
    fla_range = environment["GPU environment: megatron-core 0.16 with fla outside ~=0.4.0"]
    assert fla_range.ok and fla_range.detail.startswith("warning: megatron-core 0.16.1")


def test_a_combination_refused_only_without_deterministic_mode_is_reported_not_required():
    """The agent cannot know the runs' training.deterministic: fla 0.6.0 with Triton 3.6.0 on an H200 refuses
    only runs without it, and TransformerEngine missing on the real side refuses every run."""
    from crossalign.agents.probe import environment_checks
    from crossalign.preflight.gpu_env import GpuEnvironment

    h200 = GpuEnvironment(torch="2.11.0+cu130", cuda="13.0", triton="3.6.0", fla="0.6.0", megatron_core="0.16.1",
                          capability=(9, 0), device_name="NVIDIA H200", side="real")
    checks = {c.name: c for c in environment_checks(h200)}
    hopper = checks["GPU environment: fla GatedDeltaNet backward on Hopper with Triton [3.4.0, 3.7.1)"]
    assert not hopper.ok and not hopper.required
    assert hopper.detail.startswith("runs with training.deterministic: false are refused: fla 0.6.0 with Triton 3.6.0")
    assert [c.name for c in missing(list(checks.values()))] == ["GPU environment: TransformerEngine with this torch"]
