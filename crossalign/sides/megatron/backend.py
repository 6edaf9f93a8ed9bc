"""The real GPU side: Megatron-LM (TransformerEngine) trained from a converted checkpoint.

Everything Megatron is told comes from the model config through ``args.megatron_args`` (SPEC
section 8), so it cannot drift from the MindFormers YAML built from the same file; ``crossalign
preflight config`` reads both back and compares them.

How MTP meets GatedDeltaNet depends on the megatron-core version of the checkout (the data is
in ``patches/megatron/mtp_gdn.yaml``):

- before 0.16.0 there is no GatedDeltaNet: refused;
- 0.16.0 .. 0.18.x: ``pretrain_gpt.py`` would build the MTP layer from the standard layer specs,
  so crossalign runs ``patches/megatron/pretrain_qwen35.py`` instead, which calls Megatron's own
  ``pretrain()`` with the MTP layer taken from the hybrid block (no file edited). People who run
  ``pretrain_gpt.py`` by hand apply the ``megatron-mtp-gdn`` patch instead;
- 0.19.0 and later: upstream builds it that way; the launcher still runs, for the load digest.

The run's exit status is never trusted alone: Megatron exits 0 after a checkpoint it could not
unpickle, so the log is read after the run (``log_checks.py``); and it carries on with
random weights after a non-strict load, printing only ``load_return: None``, so the launcher
records what the model holds after loading and the step holds it against the checkpoint
(``load_digest.py``). ``crossalign rehearse`` runs this same launch on a CPU (``rehearsal.py``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import tomllib
from pathlib import Path
from typing import Sequence

from packaging.specifiers import SpecifierSet

from crossalign.sides.protocol import TrainRequest, TrainResult
from crossalign.sides.launch import (
    BackendRunError,
    BackendSetupError,
    FrameworkBackend,
    RunScript,
    progress_callback,
    write_run_script,
)
from crossalign.config import AlignmentConfig
from crossalign.dump_settings import CONFIG_FILE, RECORD_ENV, RECORD_TEMPLATE, msprobe_import_check
from crossalign.patching import PATCH_DIR, megatron_core_version
from crossalign.versions import version_tuple
from crossalign.sides.megatron.args import megatron_args, swiglu_fusion_under
from crossalign.sides.megatron.log_checks import parse_iteration_line, verify_megatron_log
from crossalign.sides.megatron.load_digest import LOAD_DIGEST_DIR, verify_load_digest
from crossalign.tensorio.errors import LoadDigestError


LAUNCHER = PATCH_DIR / "megatron" / "pretrain_qwen35.py"
RUN_SCRIPT = "run_megatron.sh"
ARGS_FILE = "megatron_args.txt"
DATA_CACHE_DIR = "data_cache"  # Megatron's dataset index cache, kept in the step (never in the shared dataset)
GDN_FIRST_VERSION = (0, 16, 0)

# Deterministic kernels and collectives (Megatron's --deterministic-mode asserts NCCL_ALGO).
DETERMINISTIC_ENV = {
    "NCCL_ALGO": "Ring",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
}


# NullTokenizer's vocab size: core 0.16.x and 0.17.x report --vocab-size + 1 (the extra id is its
# eod: core_v0.16.1 megatron/training/tokenizer/tokenizer.py:813-835 (_NullTokenizer), core_v0.17.0
# megatron/core/tokenizers/text/libraries/null_tokenizer.py:16-17,52); from core 0.18.0 exactly
# --vocab-size, eod = vocab_size - 1 (core_v0.18.0 and core_v0.19.0 null_tokenizer.py:16-19,60-62).
# _build_tokenizer then pads that size up to a multiple of --make-vocab-size-divisible-by x TP
# (core_v0.18.0 megatron/core/tokenizers/utils/build_tokenizer.py:124-143), and the embedding of
# the checkpoint must have exactly that many rows.

# ---- the log ---------------------------------------------------------------------------------


# ---- the load digest -------------------------------------------------------------------------



# ---- launching -------------------------------------------------------------------------------


def python_requirement(checkout: Path) -> str | None:
    """The checkout's ``requires-python`` (pyproject.toml), None where it states none.

    Megatron-LM needs ">=3.10" up to core 0.16 and ">=3.12" from core 0.17.0 (pyproject.toml of
    each tag); from core 0.18.0 its training code also imports ``typing.override``, new in 3.12
    (megatron/training/models/hybrid.py:5), so an older interpreter fails at import.
    """
    path = checkout / "pyproject.toml"
    if not path.exists():
        return None
    try:
        return tomllib.loads(path.read_text()).get("project", {}).get("requires-python")
    except tomllib.TOMLDecodeError as exc:
        raise BackendSetupError(f"{path}: not valid TOML ({exc})") from None


def python_mismatch(checkout: Path, python: str) -> str | None:
    """Why ``python`` cannot run the checkout's training code, None when it can (or the checkout says nothing)."""
    requirement = python_requirement(checkout)
    if requirement is None:
        return None
    try:
        done = subprocess.run([python, "-c", "import platform; print(platform.python_version())"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"megatron.python {python} cannot be run ({exc})"
    if done.returncode != 0:
        return f"megatron.python {python} cannot be run: {(done.stderr or done.stdout).strip()[-300:]}"
    version = done.stdout.strip()
    if version not in SpecifierSet(requirement):
        return (f"megatron.python {python} is Python {version}, but the Megatron-LM checkout {checkout} requires "
                f"Python {requirement} (requires-python in its pyproject.toml): point megatron.python at an "
                "interpreter that satisfies it")
    return None


# Run by the framework's interpreter in the checkout, on the host that trains (a remote host's checkout
# and interpreter cannot be checked from here): Megatron-LM states ">=X.Y" (pyproject.toml of every tag).
REQUIRES_PYTHON_CHECK = """
import re, sys
found = re.search(r'requires-python\\s*=\\s*"\\s*>=\\s*(\\d+)\\.(\\d+)', open("pyproject.toml").read())
if found and sys.version_info[:2] < (int(found[1]), int(found[2])):
    sys.exit(f"{sys.executable} is Python {sys.version.split()[0]}, but this Megatron-LM checkout requires "
             f"Python >={found[1]}.{found[2]} (requires-python in its pyproject.toml)")
"""


# Run by the framework's interpreter in the checkout, with the run script's PATH and PYTHONPATH, before
# training: Megatron compiles its dataset helpers at start-up with `make` (core_v0.16.1
# megatron/training/initialize.py:186-195, megatron/core/datasets/Makefile: g++, `python3 -m pybind11
# --includes` and `python3-config --extension-suffix` of whatever python3 is on PATH) and exits 1 when
# make fails. A python3-config of another Python (a venv has none of its own) names the library for
# that Python, which this interpreter never imports: so the helpers are built here with this
# interpreter's own include flags and suffix (make then finds them built), and imported to prove it.
DATASET_HELPERS_CHECK = """
import importlib.machinery, importlib.util, os, subprocess, sys, sysconfig
folder = os.path.join("megatron", "core", "datasets")
library = os.path.join(folder, "helpers_cpp" + sysconfig.get_config_var("EXT_SUFFIX"))

def loads():
    if not os.path.exists(library):
        return "not built"
    loader = importlib.machinery.ExtensionFileLoader("megatron.core.datasets.helpers_cpp", os.path.abspath(library))
    try:
        loader.exec_module(importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader)))
    except ImportError as exc:
        return str(exc)

if os.path.exists(os.path.join(folder, "helpers.cpp")) and loads() is not None:
    try:
        import pybind11
    except ImportError:
        sys.exit(f"{sys.executable} has no pybind11: Megatron compiles its dataset helpers with it at start-up")
    flags = f"-I{sysconfig.get_paths()['include']} -I{pybind11.get_include()}"
    done = subprocess.run(["make", "-C", folder, f"CPPFLAGS={flags}",
                           f"LIBEXT={sysconfig.get_config_var('EXT_SUFFIX')}"], capture_output=True, text=True)
    why = loads()
    if why is not None:
        sys.exit(f"Megatron's dataset helpers do not build for {sys.executable} (make -C {folder}, needs make "
                 f"and g++): {why}; make said: {(done.stderr or done.stdout).strip()[-800:]}")
"""


def dataset_helpers_problem(checkout: Path, python: str) -> str | None:
    """Why Megatron's dataset helpers neither are nor can be built for ``python`` in ``checkout``; None when fine.

    Runs :data:`DATASET_HELPERS_CHECK` as the run script runs it (the checkout first on PYTHONPATH,
    the interpreter's folder first on PATH), so a probe finds before a run what the run would hit.
    """
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    if "/" in python:
        env["PATH"] = f"{Path(python).parent}{os.pathsep}{env.get('PATH', '')}"
    try:
        done = subprocess.run([python, "-c", DATASET_HELPERS_CHECK], cwd=checkout, env=env, capture_output=True,
                              text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"megatron.python {python} cannot build the dataset helpers ({exc})"
    return None if done.returncode == 0 else (done.stderr or done.stdout).strip()[-1500:]


def entry_point(checkout: Path, version: tuple[int, ...]) -> Path:
    """Our launcher, for every megatron-core with GatedDeltaNet.

    It records the load digest (:func:`verify_load_digest`) on every version, and where this
    megatron-core builds MTP from the wrong specs (0.16 .. 0.18, the ``megatron-mtp-gdn`` patch's
    range) its builder is what fixes it; from 0.19 its builder builds what upstream builds.
    """
    if version < GDN_FIRST_VERSION:
        raise BackendSetupError(f"{checkout}: megatron-core {'.'.join(map(str, version))} has no GatedDeltaNet "
                                f"(it arrives in {'.'.join(map(str, GDN_FIRST_VERSION))})")
    return LAUNCHER


class MegatronBackend(FrameworkBackend):
    """DAG step 4 on a GPU machine: ``torchrun`` Megatron-LM from the converted checkpoint."""

    name = "megatron"

    def checkout(self, config: AlignmentConfig) -> tuple[Path, tuple[int, ...]]:
        """The Megatron-LM checkout of the site config and its megatron-core version, checked against the config.

        On a remote host (``megatron.ssh_host``) the checkout cannot be read from here: the config's
        version is used and the run script itself checks that the checkout is there.
        """
        path = self.site.megatron.path
        if path is None:
            raise BackendSetupError("site config: megatron.path (the Megatron-LM checkout) is not set")
        path = Path(path).expanduser()
        wanted = version_tuple(config.training.megatron_core_version)
        if self.site.megatron.ssh_host is not None:
            if not path.is_absolute():
                raise BackendSetupError(f"megatron.path {path}: must be an absolute path on the remote host "
                                        f"{self.site.megatron.ssh_host}")
            return path, wanted
        path = path.absolute()  # the run script cds into the checkout: a relative path would no longer hold
        if not (path / "pretrain_gpt.py").exists():
            raise BackendSetupError(f"megatron.path {path}: no pretrain_gpt.py there (not a Megatron-LM checkout)")
        mismatch = python_mismatch(path, self.site.megatron.python)
        if mismatch:
            raise BackendSetupError(mismatch)
        version = megatron_core_version(path)
        if version is None:
            raise BackendSetupError(f"{path}: megatron/core/package_info.py gives no version")
        if version[:2] != wanted[:2]:
            raise BackendSetupError(
                f"{path} is megatron-core {'.'.join(map(str, version))} but training.megatron_core_version is "
                f"{config.training.megatron_core_version}: the checkpoint's MTP key prefix and the log semantics "
                "follow the config; make them agree")
        return path, version

    def run_script(self, request: TrainRequest, args: Sequence[str]) -> RunScript:
        """The run script; our launcher, where needed, is copied into the step folder (shared with remote hosts)."""
        checkout, version = self.checkout(request.config)
        site = self.site.megatron
        entry = entry_point(checkout, version)
        request.output_dir.mkdir(parents=True, exist_ok=True)
        entry = Path(shutil.copy(entry, request.output_dir.absolute() / LAUNCHER.name))
        # PYTHONPATH: the checkout's own megatron/core (with the Makefile and helpers.cpp the wheel lacks)
        env = {**DETERMINISTIC_ENV, "PYTHONPATH": str(checkout), "MEGATRON_LM_PATH": str(checkout),
               "CROSSALIGN_LOAD_DIGEST_DIR": str(request.output_dir.absolute() / LOAD_DIGEST_DIR), **site.env}
        if request.dump is not None:  # the launcher runs each iteration under msprobe (dump_each_iteration)
            env["CROSSALIGN_MSPROBE_CONFIG"] = str(request.output_dir.absolute() / CONFIG_FILE)
            env[RECORD_ENV] = str(request.output_dir.absolute() / RECORD_TEMPLATE)  # each rank's record of the run
        layout = request.config.parallel.megatron
        if site.nproc_per_node < layout.cards_per_node:
            raise BackendSetupError(f"parallel.megatron.cards_per_node is {layout.cards_per_node}, but the site's "
                                    f"megatron.nproc_per_node is {site.nproc_per_node}")
        rendezvous = ["--standalone"] if layout.nodes == 1 else []  # several nodes: the site's env gives the master
        command = [site.python, "-m", "torch.distributed.run", *rendezvous, "--nnodes", str(layout.nodes),
                   "--nproc_per_node", str(layout.cards_per_node), str(entry), *args]
        checks = [(site.python, "-c", REQUIRES_PYTHON_CHECK)] if site.ssh_host is not None else []
        checks.append((site.python, "-c", DATASET_HELPERS_CHECK))
        if request.dump is not None:
            checks.append((site.python, "-c", msprobe_import_check("msprobe.pytorch")))  # the launcher imports it
        # the dataset helpers are built by whatever python3 is first on PATH: make it the framework's own
        python_dir = Path(site.python).parent if "/" in site.python else None
        return RunScript(command=command, cwd=checkout, env=env, required_files=("pretrain_gpt.py",), checks=checks,
                         path_prepend=(str(python_dir),) if python_dir is not None else (),
                         staged_in=request.output_dir, published_as=request.published_dir,
                         title=f"Megatron-LM {'.'.join(map(str, version))}: {request.config.model.name}, "
                               f"{request.iterations} iterations")

    def write_launch(self, request: TrainRequest) -> Path:
        """The argument file and run script of this request in its step folder; returns the script.

        Every path in them is absolute: the script changes into the checkout before it runs.
        """
        if request.side != "megatron" or request.mode != "align":
            raise BackendSetupError(f"the megatron backend trains side 'megatron' in mode 'align', "
                                    f"not side {request.side!r} mode {request.mode!r}")
        if request.init_checkpoint is None:
            raise BackendSetupError("the megatron backend needs request.init_checkpoint (the converted checkpoint)")
        args = megatron_args(
            request.config, data_prefix=request.data.prefix.absolute(), tokenizer=request.data.tokenizer,
            load_dir=request.init_checkpoint.absolute(),
            save_dir=request.checkpoint_dir.absolute() if request.save else None,
            train_iters=request.iterations,
            data_cache_dir=request.output_dir.absolute() / DATA_CACHE_DIR,
            swiglu_fusion=swiglu_fusion_under(request.dump))
        request.output_dir.mkdir(parents=True, exist_ok=True)
        (request.output_dir / ARGS_FILE).write_text("\n".join(args) + "\n")
        if request.dump is not None:
            request.write_dump_config()
        return write_run_script(request.output_dir / RUN_SCRIPT, self.run_script(request, args))

    def train(self, request: TrainRequest) -> TrainResult:
        iterations = request.iterations
        script = self.write_launch(request)
        on_line = progress_callback(request.on_step, iterations, parse_iteration_line)
        start = time.monotonic()
        status = self._runner(script, request.log_path, on_line)
        non_strict = verify_megatron_log(request.log_path, iterations=iterations, loaded=True, exit_status=status)
        try:
            verified = verify_load_digest(request.output_dir / LOAD_DIGEST_DIR, request.init_checkpoint,
                                          request.config)
        except LoadDigestError as exc:
            retried = f" (Megatron loaded non-strictly and said nothing more: {non_strict})" if non_strict else ""
            raise BackendRunError(f"{exc}{retried}") from None
        return TrainResult(log_path=request.log_path, checkpoint_dir=request.checkpoint_dir if request.save else None,
                           iterations=iterations, seconds=time.monotonic() - start, loaded_tensors_verified=verified)

