"""The GPU environment check: its table against this machine's installed versions, and the refusals it makes
for given versions (no GPU needed)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import sys

import pytest
import torch

from crossalign.preflight import gpu_env
from crossalign.preflight.gpu_env import GpuEnvironment, GpuEnvironmentError, check, require
from crossalign.sides.protocol import EnvironmentRefused
from crossalign.versions import version_tuple

# the environment the issue measured on one H200 (torch 2.11.0+cu130, Triton 3.6.0, fla-core 0.6.0, no TE)
H200 = dict(torch="2.11.0+cu130", cuda="13.0", triton="3.6.0", fla="0.6.0", megatron_core="0.16.1",
            capability=(9, 0), device_name="NVIDIA H200")


def _finding(findings, start: str):
    (found,) = [f for f in findings if f.name.startswith(start)]
    return found


def test_the_table_against_the_installed_versions():
    """Every version the check reads is the installed distribution's; without a CUDA device what needs the GPU
    is undecided, and says why."""
    env = gpu_env.read_environment(deterministic=False)
    assert env.torch == importlib.metadata.version("torch")
    assert env.fla == importlib.metadata.version("fla-core")
    assert env.megatron_core == importlib.metadata.version("megatron-core")
    assert env.triton == importlib.metadata.version("triton")
    assert env.cuda == torch.version.cuda
    assert env.import_errors == {}  # megatron-core's fla imports work with the pinned fla
    findings = check(env)
    assert [f.name for f in findings] == [issue.name for issue in gpu_env.KNOWN_ISSUES]
    assert all(f.source and f.fix for f in findings)
    hopper = _finding(findings, "fla GatedDeltaNet backward on Hopper")
    if torch.cuda.is_available():
        assert env.capability == torch.cuda.get_device_capability(0)
    else:
        assert env.capability is None
        if (3, 4, 0) <= version_tuple(env.triton) < (3, 7, 1):
            assert hopper.status == "undecided" and "without a CUDA device" in hopper.detail
        else:
            assert hopper.status == "ok" and f"Triton {env.triton} is outside" in hopper.detail
    assert _finding(findings, "megatron-core GatedDeltaNet needs fla").status == "ok"
    in_range = (0, 4, 0) <= version_tuple(env.fla) < (0, 5, 0)
    assert _finding(findings, "megatron-core 0.16 with fla").status == ("ok" if in_range else "warning")
    # the embedded side never needs TransformerEngine; the real side refuses without it
    assert _finding(findings, "TransformerEngine").status == "ok"
    real = check(dataclasses.replace(env, side="real"))
    te_installed = env.transformer_engine is not None
    assert (_finding(real, "TransformerEngine").status == "refused") is not te_installed


def test_another_interpreter_reads_the_same_environment():
    """The probe reads the framework's Python in a process of its own (gpu_env_read.py run as a script)."""
    here = gpu_env.read_environment(deterministic=True, side="real")
    assert gpu_env.read_environment(deterministic=True, side="real", python=sys.executable) == here


def test_undecided_without_a_device_when_triton_is_in_the_range():
    env = GpuEnvironment(**{**H200, "capability": None, "device_name": None}, deterministic=False)
    hopper = _finding(check(env), "fla GatedDeltaNet backward on Hopper")
    assert hopper.status == "undecided"
    assert "cannot be told without a CUDA device" in hopper.detail


def test_fla_triton_hopper_is_refused_with_the_fix_and_its_source():
    env = GpuEnvironment(**H200, deterministic=False)
    with pytest.raises(GpuEnvironmentError) as raised:
        require(env)
    message = str(raised.value)
    assert "fla 0.6.0 with Triton 3.6.0 on a Hopper GPU and training.deterministic false" in message
    assert "tilelang is not installed, so fla raises" in message
    assert "Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results" in message
    assert "Triton >= 3.7.1" in message and "tilelang" in message and "training.deterministic: true" in message
    assert "0.6.0 chunk_o.py lines 709 and 727-732" in message and "#640" in message
    assert "sm_90 (NVIDIA H200)" in message  # the environment it judged
    # a training step that meets it refuses its machine: the run is invalid with this reason (crossalign.stop)
    assert isinstance(raised.value, EnvironmentRefused)
    assert raised.value.reason.startswith("environment: the GPU environment check refuses fla GatedDeltaNet backward")
    (refused,) = gpu_env.refusals(check(env))
    assert refused.name.startswith("fla GatedDeltaNet backward on Hopper")


@pytest.mark.parametrize("change, status", [
    ({"deterministic": True}, "ok"),  # Megatron's torch chunk rule: fla's backward never runs
    ({"triton": "3.7.1"}, "ok"),
    ({"triton": "3.3.1"}, "ok"),
    ({"capability": (8, 0), "device_name": "NVIDIA A100"}, "ok"),
    ({"capability": (10, 0), "device_name": "NVIDIA B200"}, "ok"),
    ({"tilelang": "0.1.6", "nvcc": True}, "ok"),  # fla 0.6.0 hands the backward to tilelang
    ({"tilelang": "0.1.6", "nvcc": False}, "refused"),  # ... only where it finds an nvcc
    ({"tilelang": "0.1.6"}, "undecided"),  # whether it finds one was not read
])
def test_each_way_out_of_the_hopper_entry(change, status):
    env = GpuEnvironment(**{**H200, **{k: v for k, v in change.items() if k != "deterministic"}},
                         deterministic=change.get("deterministic", False))
    assert _finding(check(env), "fla GatedDeltaNet backward on Hopper").status == status


def test_the_other_entries_for_given_versions():
    broken_conv = GpuEnvironment(**H200, causal_conv1d="1.5.2", deterministic=False,
                                 import_errors={"causal_conv1d": "import causal_conv1d: ImportError: undefined symbol"})
    conv = _finding(check(broken_conv), "causal-conv1d")
    assert conv.status == "warning" and "runs torch's conv1d instead" in conv.detail
    assert _finding(check(GpuEnvironment(**H200, causal_conv1d="1.5.2", deterministic=True,
                                         import_errors=broken_conv.import_errors)), "causal-conv1d").status == "ok"
    no_fla = GpuEnvironment(**{**H200, "fla": None}, deterministic=True)
    assert _finding(check(no_fla), "megatron-core GatedDeltaNet needs fla").status == "refused"
    te_env = dict(H200, transformer_engine="2.10.0")
    assert _finding(check(GpuEnvironment(**te_env, side="real")), "TransformerEngine").status == "ok"
    broken_te = GpuEnvironment(**te_env, side="real", import_errors={
        "transformer_engine": "import transformer_engine.pytorch: ImportError: undefined symbol"})
    assert _finding(check(broken_te), "TransformerEngine").status == "refused"
    old_te = GpuEnvironment(**dict(H200, transformer_engine="2.4.0"), side="real")
    assert _finding(check(old_te), "TransformerEngine").status == "warning"
    assert _finding(check(GpuEnvironment(**dict(H200, fla="0.4.1"))), "megatron-core 0.16 with fla").status == "ok"


def test_a_record_from_another_interpreter_round_trips():
    record = {**H200, "capability": [9, 0], "import_errors": {}}
    env = GpuEnvironment.from_record(record, deterministic=False, side="embedded")
    assert env == GpuEnvironment(**H200, deterministic=False)
    with pytest.raises(GpuEnvironmentError, match="reading the GPU environment with .* failed"):
        gpu_env.read_environment(deterministic=True, python=sys.executable + "-no-such")


def test_preflight_gpu_command():
    from typer.testing import CliRunner

    from crossalign.cli import app

    embedded = CliRunner().invoke(app, ["preflight", "gpu", "--model", "qwen35_moe_tiny",
                                        "--set", "training.deterministic=false"])
    assert embedded.exit_code == 0, embedded.output
    assert "fla GatedDeltaNet backward on Hopper" in embedded.output
    assert f"fla {importlib.metadata.version('fla-core')}" in embedded.output
    real = CliRunner().invoke(app, ["preflight", "gpu", "--model", "qwen35_moe_tiny", "--side", "real",
                                    "--python", sys.executable])
    te_installed = gpu_env.gpu_env_read.installed_version("transformer_engine") is not None
    assert real.exit_code == (0 if te_installed else 1), real.output
    if not te_installed:
        assert "1 refused: TransformerEngine with this torch" in real.output
        assert "'transformer_engine[pytorch]>=2.9,<2.12'" in real.output  # printed as written, not as markup
    bad = CliRunner().invoke(app, ["preflight", "gpu", "--model", "qwen35_moe_tiny", "--side", "gpu"])
    assert bad.exit_code == 2 and "--side 'gpu' is not one of embedded, real" in bad.output


def test_the_step_checks_the_gpu_environment_only_before_an_in_process_gpu_run():
    from crossalign.config import load_config
    from crossalign.sides.megatron.embedded.trainer import LocalMegatronBackend
    from crossalign.tasks.training import checked_gpu_environment

    config = load_config("qwen35_moe_tiny", ["training.embedded_device=cpu"])
    assert checked_gpu_environment(LocalMegatronBackend(), config) == []
    assert checked_gpu_environment(object(), config) == []  # a backend that trains elsewhere: its agent's probe
    if not torch.cuda.is_available():
        from crossalign.sides.megatron.embedded.device import EmbeddedDeviceError

        with pytest.raises(EmbeddedDeviceError, match="cuda, but torch sees no GPU"):
            checked_gpu_environment(LocalMegatronBackend(), load_config("qwen35_moe_tiny",
                                                                        ["training.embedded_device=cuda"]))


# fla's own code decides: each fla-core release's chunk_bwd_dqkwg is run under the versions of a case
# (tests/helpers/fla_guard_driver.py), and the table must answer as the release behaves


def _our_environment(version: str, case, sandbox, monkeypatch) -> GpuEnvironment:
    """The environment the table is given for ``case``: nvcc read by our reader under the case's process settings."""
    from crossalign.preflight.gpu_env_read import usable_nvcc

    with monkeypatch.context() as patched:
        for name in ("CUDA_HOME", "CUDA_PATH"):
            patched.delenv(name, raising=False)
        for name, value in sandbox.environ(case).items():
            patched.setenv(name, value)
        for path in sandbox.extra_paths(case):
            patched.syspath_prepend(path)
        nvcc = usable_nvcc(cuda_default=sandbox.cuda_default(case))
    name, capability = case.device
    return GpuEnvironment(torch="2.12.0", cuda="13.0", triton=case.triton, fla=version, megatron_core="0.16.1",
                          tilelang="0.1.6" if case.tilelang else None, capability=capability, device_name=name,
                          nvcc=nvcc, fla_settings=dict(case.fla_settings), deterministic=False)


def _as_the_release_behaves(route: str, newest_without_tilelang: str, nvcc: bool) -> str:
    """What a run would meet: fla's guard raises (refused); the TileLang route compiles only where fla finds an
    nvcc (the newest release's has_usable_nvcc); the Triton kernel trains wrong where the newest release's guard
    would refuse this Triton on this GPU."""
    if route == "guard":
        return "refused"
    if route == "tilelang":
        return "ok" if nvcc else "refused"
    assert route == "triton", route
    return "refused" if newest_without_tilelang == "guard" else "ok"


def _hold_the_table(cases_by_release: dict, tmp_path, monkeypatch, processes: int = 1) -> dict:
    """Each release's own outcome of each case ({(release, case): outcome}), the table held to every one."""
    from helpers.fla_wheels import NEWEST, Sandbox, run_cases_split

    sandbox = Sandbox(tmp_path)
    every = {case for cases in cases_by_release.values() for case in cases}
    asked = [(version, case) for version, cases in cases_by_release.items() for case in cases]
    asked += [(NEWEST, case) for case in every | {case.without_tilelang() for case in every}
              if (NEWEST, case) not in asked]
    outcomes = dict(zip(asked, run_cases_split(asked, sandbox, processes)))
    for version, case in asked[:sum(map(len, cases_by_release.values()))]:
        outcome, newest = outcomes[(version, case)], outcomes[(NEWEST, case)]
        expected = _as_the_release_behaves(outcome["route"], outcomes[(NEWEST, case.without_tilelang())]["route"],
                                           newest["has_usable_nvcc"])
        env = _our_environment(version, case, sandbox, monkeypatch)
        if outcome["has_usable_nvcc"] is not None:  # the release's own nvcc search, from 0.5.2
            assert env.nvcc is outcome["has_usable_nvcc"], (version, case)
        finding = _finding(check(env), "fla GatedDeltaNet backward on Hopper")
        assert finding.status == expected, (version, case, outcome, finding.line())
    return outcomes


def _case(triton: str, **kwargs):
    from helpers.fla_wheels import GpuCase

    return GpuCase(triton, **kwargs)


def test_the_four_fla_cases_as_their_releases_behave(tmp_path, monkeypatch):
    """fla-core 0.4.x with tilelang in the bad range: no guard, no route, wrong gradients (refused); 0.5.1 with
    Triton 3.7.1 and no tilelang: its guard raises for every Triton >= 3.4.0 (refused); tilelang without an nvcc:
    no route (refused), with one: the route (ok); torch 2.12.0's Triton 3.7.0 (torch 2.12.0's METADATA:
    Requires-Dist triton==3.7.0; platform_system == "Linux") with fla 0.6.0: in the bad range (refused). And
    every place fla-core 0.5.2 looks for an nvcc (has_usable_nvcc), and none: our reader finds what the release's
    own function finds in the same process settings, and the TileLang route follows it (0.6.0's search, the same,
    is held on the slow test's grid). One process runs every release's cases."""
    from helpers.fla_wheels import NVCC_PLACES

    nvcc_cases = [_case("3.6.0", tilelang=True, nvcc=place) for place in NVCC_PLACES]
    outcomes = _hold_the_table({"0.4.2": [_case("3.6.0", tilelang=True, nvcc="PATH")], "0.5.1": [_case("3.7.1")],
                                "0.5.2": nvcc_cases,
                                "0.6.0": [_case("3.7.0"), _case("3.6.0", tilelang=True), _case("3.7.1rc1")]},
                               tmp_path, monkeypatch)  # 3.7.1rc1 is below 3.7.1, as fla compares versions
    for case in nvcc_cases:
        outcome = outcomes[("0.5.2", case)]
        assert outcome["has_usable_nvcc"] is (case.nvcc is not None), case
        assert outcome["route"] == ("tilelang" if case.nvcc else "guard"), case
    refused = {(env.fla, env.triton, env.tilelang) for env in (
        GpuEnvironment(**{**H200, "fla": "0.4.2", "triton": "3.6.0", "tilelang": "0.1.6", "nvcc": True}),
        GpuEnvironment(**{**H200, "fla": "0.5.1", "triton": "3.7.1", "nvcc": True}),
        GpuEnvironment(**{**H200, "fla": "0.6.0", "triton": "3.6.0", "tilelang": "0.1.6", "nvcc": False}),
        GpuEnvironment(**{**H200, "torch": "2.12.0", "triton": "3.7.0", "nvcc": True}))
        if _finding(check(dataclasses.replace(env, deterministic=False)), "fla GatedDeltaNet").status == "refused"}
    assert len(refused) == 4


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_table_against_every_release_on_a_grid(tmp_path, monkeypatch):
    """Every downloaded fla-core release on Triton versions around each guard's bounds, a Hopper and an Ampere
    GPU, tilelang absent, with an nvcc and without one, fla's settings that turn the route off or on, and every
    place an nvcc can be."""
    from helpers.fla_wheels import AMPERE, HOPPER, NVCC_PLACES, RELEASES

    grid = [_case(triton, device=device, tilelang=tilelang, nvcc=nvcc)
            for triton in ("3.3.1", "3.4.0", "3.7.0", "3.7.1", "3.8.0") for device in (HOPPER, AMPERE)
            for tilelang, nvcc in ((False, None), (True, "PATH"), (True, None))]
    grid += [_case("3.6.0", tilelang=True, nvcc="PATH", fla_settings=(("FLA_TILELANG", "0"),)),
             _case("3.6.0", tilelang=True, nvcc="PATH", fla_settings=(("FLA_DISABLE_BACKEND_DISPATCH", "1"),)),
             _case("3.6.0", device=AMPERE, tilelang=True, nvcc="PATH", fla_settings=(("FLA_TILELANG", "1"),))]
    grid += [_case("3.6.0", tilelang=True, nvcc=place) for place in NVCC_PLACES]
    grid += [_case(triton, tilelang=tilelang) for triton in ("3.4.0rc1", "3.7.1rc1") for tilelang in (False, True)]
    _hold_the_table({version: grid for version in RELEASES}, tmp_path, monkeypatch, processes=2)
