"""What a machine can run: the checks ``crossalign agent start`` makes before it starts a worker.

Each pool needs different things. With the embedded CPU backends (``backends: local``) a
pool needs only Python packages; with the real frameworks it needs them in the framework's own
interpreter (site ``python``), plus the devices, the checkout and its patches. Imports are
probed in a separate process of the interpreter that will run them, so a probe never loads
MindSpore or torch into the agent itself and checks the environment that matters.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from crossalign.agents.pools import FLOW_RUN_PYTHON, POOLS
from crossalign.preflight import gpu_env
from crossalign.patching import PatchError, apply_patch, check_patch, defined_classes, load_patches
from crossalign.sides.launch import BackendSetupError
from crossalign.sides.megatron.backend import dataset_helpers_problem, python_mismatch, python_requirement
from crossalign.site import FrameworkSite, MindFormersSite, SiteConfig

CANN_DEFAULT = Path("/usr/local/Ascend/ascend-toolkit/latest")
PROBE_TIMEOUT_S = 300

# Run by the probed interpreter: imports each module and reports its version or the error.
_IMPORT_PROBE = r"""
import importlib, json, sys
found = {}
for name in sys.argv[1:]:
    module, _, check = name.partition(":")
    try:
        mod = importlib.import_module(module)
        info = {"ok": True, "version": str(getattr(mod, "__version__", "") or "")}
        if check == "cuda":
            info["ok"] = bool(mod.cuda.is_available())
            info["version"] += f" (cuda {mod.version.cuda}, {mod.cuda.device_count()} devices)" if info["ok"] else " (no CUDA device)"
    except Exception as exc:
        info = {"ok": False, "version": f"{type(exc).__name__}: {exc}"}
    found[name] = info
print("@@probe@@" + json.dumps(found))
"""


@dataclass(frozen=True)
class Check:
    """One thing a pool needs (or would like), and what was found."""

    name: str
    ok: bool
    detail: str
    required: bool = True


class ProbeError(RuntimeError):
    """A hard requirement of the pool is missing on this machine."""


def probe_imports(modules: list[str], python: str | None = None) -> dict[str, dict]:
    """Import ``modules`` in ``python`` (default: this interpreter); ``torch:cuda`` also checks for a CUDA device."""
    interpreter = python or sys.executable
    try:
        done = subprocess.run([interpreter, "-c", _IMPORT_PROBE, *modules], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    except FileNotFoundError:
        return {m: {"ok": False, "version": f"interpreter {interpreter} not found"} for m in modules}
    except subprocess.TimeoutExpired:
        return {m: {"ok": False, "version": f"imports did not finish in {PROBE_TIMEOUT_S} s"} for m in modules}
    for line in done.stdout.splitlines():
        if line.startswith("@@probe@@"):
            return json.loads(line[len("@@probe@@"):])
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    return {m: {"ok": False, "version": f"{interpreter} failed: {tail[0]}"} for m in modules}


def _import_checks(wanted: list[tuple[str, str, bool]], python: str | None) -> list[Check]:
    """``wanted``: (module[:cuda], label, required) probed together in one process."""
    found = probe_imports([module for module, _, _ in wanted], python)
    where = f" in {python}" if python else ""
    checks = []
    for module, label, required in wanted:
        info = found.get(module, {"ok": False, "version": "not probed"})
        detail = info["version"] or "importable"
        checks.append(Check(label, info["ok"], detail + (where if info["ok"] else ""), required))
    return checks


def _cann() -> Check:
    home = os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME")
    path = Path(home) if home else CANN_DEFAULT
    if path.exists():
        return Check("CANN toolkit", True, str(path.resolve()))
    return Check("CANN toolkit", False, f"{path} not found (source CANN's set_env.sh, or set ASCEND_HOME_PATH)")


def _checkout(label: str, framework: FrameworkSite, marker: str) -> Check:
    if framework.path is None:
        return Check(label, False, "not set in the site config")
    path = Path(framework.path).expanduser()
    if not (path / marker).exists():
        return Check(label, False, f"{path}: no {marker} there")
    return Check(label, True, str(path))


def _qwen35_model(framework: MindFormersSite) -> Check:
    """The fork's Qwen3.5 classes (site ``qwen35_class``) exist in the checkout: public MindFormers has none."""
    label = "MindFormers Qwen3.5 model"
    if not framework.qwen35_classes:
        return Check(label, False, "mindformers.qwen35_class is not set in the site config: name the Qwen3.5 "
                     "pynative training class of your MindFormers fork (public MindFormers has no Qwen3.5 model)")
    root = Path(framework.path).expanduser()  # type: ignore[arg-type]
    found = defined_classes(root, "mindformers/**/*.py", framework.qwen35_classes)
    absent = [name for name, where in found.items() if not where]
    if absent:
        return Check(label, False, f"this MindFormers checkout has no Qwen3.5 model: no class {', '.join(absent)} "
                     f"under {root / 'mindformers'} (public MindFormers has none; mindformers.path must be the fork)")
    return Check(label, True, "; ".join(f"{name} in {', '.join(where)}" for name, where in found.items()))


def _patches(framework_name: str, framework: FrameworkSite, apply: bool) -> list[Check]:
    """Check (and, with ``apply``, apply) the framework's non-optional patches; a conflict is a failed check."""
    classes = framework.qwen35_classes if isinstance(framework, MindFormersSite) else ()
    checks = []
    for patch in load_patches(framework_name):
        if patch.optional:
            continue
        try:
            report = check_patch(patch, Path(framework.path).expanduser(), classes)
            if report.status == "applicable" and apply:
                report = apply_patch(patch, Path(framework.path).expanduser(), classes)
        except PatchError as exc:
            checks.append(Check(f"patch {patch.name}", False, str(exc)))
            continue
        checks.append(Check(f"patch {patch.name}", report.status in ("applied", "not-needed"),
                            f"{report.status}: {report.detail}"))
    return checks


def _remote(framework: FrameworkSite) -> Check:
    return Check("framework host", True, f"runs over SSH on {framework.ssh_host}; probed there when a step starts",
                 required=False)


def _flow_run_python() -> Check:
    """Flow runs start as ``python3 -m prefect.engine`` with this interpreter's folder first on PATH."""
    here = Path(sys.executable)
    candidate = here.with_name(FLOW_RUN_PYTHON)
    if candidate.exists() and os.access(candidate, os.X_OK):
        return Check("flow-run interpreter", True, f"{FLOW_RUN_PYTHON} -> {candidate}")
    return Check("flow-run interpreter", False,
                 f"no {FLOW_RUN_PYTHON} next to {here}: flow runs start as `{FLOW_RUN_PYTHON} -m prefect.engine` "
                 "(prefect.yaml); install crossalign in a virtual environment")


def probe_pool(pool: str, site: SiteConfig, *, apply_patches: bool = True) -> list[Check]:
    """Everything ``pool`` needs on this machine under ``site``, as checks (required ones must pass)."""
    if pool not in POOLS:
        raise ValueError(f"pool {pool!r} is not one of {', '.join(POOLS)}")
    return [_flow_run_python(), *_pool_checks(pool, site, apply_patches)]


def _pool_checks(pool: str, site: SiteConfig, apply_patches: bool) -> list[Check]:
    if pool == "orchestrator":
        return _import_checks([("prefect", "prefect", True), ("tokenizers", "tokenizers (dataset)", True),
                               ("megatron.core", "megatron-core (dataset, sample order)", True)], None)
    if pool == "cpu":
        return _import_checks([("torch", "torch", True), ("safetensors", "safetensors", True),
                               ("matplotlib", "matplotlib (report plots)", True)], None)
    if pool == "npu":
        if site.backends.get("npu", "local") == "local":
            return _import_checks([("mindspore", "MindSpore (CPU backend)", True)], None) + [
                Check("backend", True, "local: the embedded MindSpore trainer on CPU", required=False)]
        framework = site.mindformers
        if framework.ssh_host is not None:
            return [_remote(framework)]
        checkout = _checkout("MindFormers checkout", framework, "run_mindformer.py")
        model = _qwen35_model(framework) if checkout.ok else None
        return (_import_checks([("mindspore", "MindSpore", True)], framework.python) + [_cann(), checkout]
                + ([model] if model else [])
                + (_patches("mindformers", framework, apply_patches) if model and model.ok else []))
    if site.backends.get("gpu", "local") == "local":
        return _import_checks([("torch", "torch (CPU backend)", True), ("fla", "flash-linear-attention", True),
                               ("megatron.core", "megatron-core", True)], None) + [
            Check("backend", True, "local: the embedded megatron-core trainer (training.embedded_device)",
                  required=False), *gpu_environment_checks(None, "embedded")]
    framework = site.megatron
    if framework.ssh_host is not None:
        return [_remote(framework)]
    checkout = _checkout("Megatron-LM checkout", framework, "pretrain_gpt.py")
    return (_import_checks([("torch:cuda", "torch with CUDA", True), ("transformer_engine", "TransformerEngine", True),
                            ("fla", "flash-linear-attention", True)], framework.python) + [checkout]
            + gpu_environment_checks(framework.python, "real")
            + ([_megatron_python(framework), _dataset_helpers(framework)]
               + _patches("megatron", framework, apply_patches) if checkout.ok else []))


def gpu_environment_checks(python: str | None, side: gpu_env.Side) -> list[Check]:
    """The GPU environment check (``crossalign preflight gpu``) in the interpreter that will train. The agent does
    not know the runs' training.deterministic: a combination refused either way is a missing requirement; one
    refused only without it (the fla/Triton/Hopper trap) is reported, not required, naming the setting."""
    try:
        env = gpu_env.read_environment(deterministic=True, side=side, python=python)
    except gpu_env.GpuEnvironmentError as exc:
        return [Check("GPU environment", False, exc.problem)]
    return environment_checks(env)


def environment_checks(env: gpu_env.GpuEnvironment) -> list[Check]:
    """:func:`gpu_environment_checks` of an environment already read: the table with and without
    training.deterministic."""
    either = {deterministic: gpu_env.check(dataclasses.replace(env, deterministic=deterministic))
              for deterministic in (True, False)}
    checks = []
    for always, without in zip(either[True], either[False]):
        if always.status == "refused":
            checks.append(Check(f"GPU environment: {always.name}", False, f"{always.detail} Fix: {always.fix}"))
        elif without.status == "refused":
            checks.append(Check(f"GPU environment: {without.name}", False,
                                f"runs with training.deterministic: false are refused: {without.detail} "
                                f"Fix: {without.fix}", required=False))
        elif {"undecided", "warning"} & {always.status, without.status}:
            shown = without if without.status in ("undecided", "warning") else always
            checks.append(Check(f"GPU environment: {shown.name}", True, f"{shown.status}: {shown.detail}",
                                required=False))
    return checks or [Check("GPU environment", True, "no known-bad combination", required=False)]


def _dataset_helpers(framework: FrameworkSite) -> Check:
    """Megatron compiles its dataset helpers at start-up with whatever python3 is on PATH: built, or buildable."""
    problem = dataset_helpers_problem(Path(framework.path).expanduser(), framework.python)  # type: ignore[arg-type]
    return Check("Megatron dataset helpers", problem is None, problem or f"built for {framework.python}")


def _megatron_python(framework: FrameworkSite) -> Check:
    """The framework's interpreter against the checkout's requires-python (3.12 from core 0.17)."""
    checkout = Path(framework.path).expanduser()  # type: ignore[arg-type]
    try:
        mismatch = python_mismatch(checkout, framework.python)
        requirement = python_requirement(checkout)
    except BackendSetupError as exc:
        return Check("Megatron-LM Python", False, str(exc))
    if mismatch:
        return Check("Megatron-LM Python", False, mismatch)
    return Check("Megatron-LM Python", True, f"{framework.python} satisfies requires-python {requirement or '(none)'}")


def missing(checks: list[Check]) -> list[Check]:
    return [c for c in checks if c.required and not c.ok]
