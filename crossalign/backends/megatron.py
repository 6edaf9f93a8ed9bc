"""The real GPU side: Megatron-LM (TransformerEngine) trained from a converted checkpoint.

Everything Megatron is told comes from the model config through :func:`megatron_args` (SPEC
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
unpickle, so the log is read after the run (:func:`verify_megatron_log`); and it carries on with
random weights after a non-strict load, printing only ``load_return: None``, so the launcher
records what the model holds after loading and the step holds it against the checkpoint
(:func:`verify_load_digest`). ``crossalign rehearse`` runs this same launch on a CPU
(``crossalign/rehearsal/``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from packaging.specifiers import SpecifierSet

from crossalign.backends.base import TrainRequest, TrainResult
from crossalign.backends.launch import (
    BackendRunError,
    BackendSetupError,
    FrameworkBackend,
    RunScript,
    failure_summary,
    missing_steps,
    progress_callback,
    write_run_script,
)
from crossalign.config import AlignmentConfig, MegatronParallel
from crossalign.patching import PATCH_DIR, megatron_core_version, parse_version

if TYPE_CHECKING:
    import torch

LAUNCHER = PATCH_DIR / "megatron" / "pretrain_qwen35.py"
RUN_SCRIPT = "run_megatron.sh"
ARGS_FILE = "megatron_args.txt"
LOAD_DIGEST_DIR = "load_digest"  # the launcher's record of what each rank loaded (CROSSALIGN_LOAD_DIGEST_DIR)
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
NULL_TOKENIZER_EXACT_FROM = (0, 18, 0)


def null_tokenizer_vocab_size(vocab_size_arg: int, core_version: str | tuple[int, ...]) -> int:
    """The vocab size NullTokenizer reports for ``--vocab-size vocab_size_arg`` in this megatron-core."""
    version = parse_version(core_version) if isinstance(core_version, str) else tuple(core_version)
    return vocab_size_arg if version >= NULL_TOKENIZER_EXACT_FROM else vocab_size_arg + 1


def null_tokenizer_vocab_arg(rows: int, core_version: str | tuple[int, ...]) -> int:
    """The ``--vocab-size`` that makes NullTokenizer report exactly ``rows`` (the checkpoint's embedding rows)."""
    added = null_tokenizer_vocab_size(rows, core_version) - rows  # the eod row NullTokenizer adds: 1 or 0
    return rows - added


def _num(value: float) -> str:
    """A float as Megatron's argparse reads it back exactly."""
    return repr(float(value))


def tokenizer_size(tokenizer: Path) -> int:
    """Entries of a HuggingFace tokenizer.json (a file, or a folder holding one): vocab plus added tokens."""
    path = tokenizer / "tokenizer.json" if tokenizer.is_dir() else tokenizer
    if not path.exists():
        raise BackendSetupError(f"{path}: tokenizer not found")
    raw = json.loads(path.read_text())
    vocab = raw.get("model", {}).get("vocab", {})
    ids = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab)))
    ids.update(token["id"] for token in raw.get("added_tokens", []))
    return max(ids) + 1 if ids else 0


def parallel_args(layout: MegatronParallel, moe: bool) -> list[str]:
    """The layout's flags (core_v0.16.1 megatron/training/arguments.py, _add_distributed_args)."""
    args = ["--tensor-model-parallel-size", str(layout.tensor), "--pipeline-model-parallel-size", str(layout.pipeline)]
    if layout.virtual_pipeline_layers is not None:
        args += ["--num-layers-per-virtual-pipeline-stage", str(layout.virtual_pipeline_layers)]
    if moe:
        args += ["--expert-model-parallel-size", str(layout.expert),
                 "--expert-tensor-parallel-size", str(layout.expert_tensor_size)]
    if layout.context > 1:
        args += ["--context-parallel-size", str(layout.context)]
    if layout.sequence_parallel:
        args.append("--sequence-parallel")
    return args


def megatron_args(
    config: AlignmentConfig,
    *,
    data_prefix: Path | str,
    tokenizer: Path | str | None,
    load_dir: Path | str | None,
    save_dir: Path | str | None = None,
    nproc: int | None = None,
    train_iters: int | None = None,
    data_cache_dir: Path | str | None = None,
) -> list[str]:
    """The ``pretrain_gpt.py`` arguments for this config (SPEC section 8), dense or MoE.

    The dataset is already tokenised, so Megatron gets a NullTokenizer sized to the padded vocab
    (its pad id is -1, like the MindFormers loader's ``pad: -1``: no token is masked on either
    side); ``tokenizer`` is checked to fit in that vocab. The parallel layout is the config's
    ``parallel.megatron`` (``nproc`` GPUs per node in place of its cards_per_node when given); the
    GPUs it leaves run data parallel.
    Without ``data_cache_dir`` Megatron writes its index cache next to the data
    (``<data_prefix_dir>/cache/GPTDataset_indices``, megatron_dataset.py), i.e. into the shared store.
    """
    m, t, layout = config.model, config.training, config.parallel.megatron
    iters = train_iters or t.train_iters
    world = (nproc or layout.cards_per_node) * layout.nodes
    if world % layout.model_parallel:
        raise BackendSetupError(f"parallel.megatron: TP {layout.tensor} x PP {layout.pipeline} x CP {layout.context} "
                                f"does not fit {world} GPUs")
    data_parallel = world // layout.model_parallel
    if t.global_batch_size % (t.micro_batch_size * data_parallel):
        raise BackendSetupError(f"training.global_batch_size {t.global_batch_size} is not a multiple of "
                                f"micro_batch_size {t.micro_batch_size} x {data_parallel} GPUs")
    if tokenizer is not None and tokenizer_size(Path(tokenizer)) > m.padded_vocab_size:
        raise BackendSetupError(f"{tokenizer}: {tokenizer_size(Path(tokenizer))} tokens do not fit "
                                f"model.padded_vocab_size {m.padded_vocab_size}")
    args = [
        "--transformer-impl", "transformer_engine",
        "--num-layers", str(m.num_layers),
        "--hidden-size", str(m.hidden_size),
        "--ffn-hidden-size", str(m.ffn_hidden_size),
        "--num-attention-heads", str(m.num_attention_heads),
        "--group-query-attention",
        "--num-query-groups", str(m.num_query_groups),
        "--kv-channels", str(m.kv_channels),
        "--seq-length", str(t.seq_length),
        "--max-position-embeddings", str(m.max_position_embeddings),
        "--normalization", "RMSNorm",
        "--norm-epsilon", _num(m.norm_epsilon),
        *(["--apply-layernorm-1p"] if m.norm_convention == "zero_centred" else []),  # gammas stored as g - 1
        "--swiglu",
        "--untie-embeddings-and-output-weights",
        "--disable-bias-linear",
        "--position-embedding-type", "rope",
        "--rotary-base", str(int(m.rotary_base)) if float(m.rotary_base).is_integer() else _num(m.rotary_base),
        "--rotary-percent", _num(m.rotary_percent),
        "--qk-layernorm",
        "--attention-output-gate",
        "--experimental-attention-variant", "gated_delta_net",
        "--linear-attention-freq", str(m.linear_attention_freq),
        "--linear-conv-kernel-dim", str(m.linear_conv_kernel_dim),
        "--linear-key-head-dim", str(m.linear_key_head_dim),
        "--linear-value-head-dim", str(m.linear_value_head_dim),
        "--linear-num-key-heads", str(m.linear_num_key_heads),
        "--linear-num-value-heads", str(m.linear_num_value_heads),
        "--init-method-std", _num(m.init_method_std),
        "--attention-dropout", _num(t.attention_dropout),
        "--hidden-dropout", _num(t.hidden_dropout),
    ]
    if m.mtp_num_layers:
        args += ["--mtp-num-layers", str(m.mtp_num_layers),
                 "--mtp-loss-scaling-factor", _num(m.mtp_loss_scaling_factor)]
    if m.is_moe:
        args += [
            "--num-experts", str(m.num_experts),
            "--moe-layer-freq", "1",
            "--moe-router-topk", str(m.moe_router_topk),
            "--moe-ffn-hidden-size", str(m.moe_ffn_hidden_size),
            "--moe-shared-expert-intermediate-size", str(m.moe_shared_expert_intermediate_size),
            "--moe-grouped-gemm",
            "--moe-token-dispatcher-type", "alltoall",
            "--moe-router-score-function", m.moe_router_score_function,
            "--moe-router-topk-scaling-factor", _num(m.moe_router_topk_scaling_factor),
            "--moe-router-dtype", m.moe_router_dtype,
            "--moe-router-load-balancing-type", "aux_loss",
            "--moe-aux-loss-coeff", _num(m.moe_aux_loss_coeff),
        ]
        if m.moe_shared_expert_gate:
            args.append("--moe-shared-expert-gate")
        if not m.norm_topk_prob:
            # Megatron renormalises the top-k probabilities unless the softmax runs over all experts first.
            args.append("--moe-router-pre-softmax")
    args += [
        "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(null_tokenizer_vocab_arg(m.padded_vocab_size, t.megatron_core_version)),
        "--make-vocab-size-divisible-by", "1",
        "--data-path", str(data_prefix),
        *(["--data-cache-path", str(data_cache_dir)] if data_cache_dir is not None else []),
        "--split", t.split,
        "--seed", str(t.seed),
        "--dataloader-type", t.dataloader_type,
        "--micro-batch-size", str(t.micro_batch_size),
        "--global-batch-size", str(t.global_batch_size),
        "--train-iters", str(iters),
        "--eval-iters", "0",
        "--eval-interval", str(iters),
        "--optimizer", "adam",
        "--lr", _num(t.lr),
        "--min-lr", _num(t.min_lr),
        "--lr-decay-style", t.lr_decay_style,
        "--lr-warmup-iters", str(t.lr_warmup_iters),
        "--lr-warmup-init", _num(t.lr_warmup_init),
        "--weight-decay", _num(t.weight_decay),
        "--adam-beta1", _num(t.adam_beta1),
        "--adam-beta2", _num(t.adam_beta2),
        "--adam-eps", _num(t.adam_eps),
        "--clip-grad", _num(t.clip_grad),
        *parallel_args(layout, m.is_moe),
        "--no-gradient-accumulation-fusion",
        "--log-interval", "1",
        "--ckpt-format", "torch",
    ]
    if t.bf16:
        args.append("--bf16")
    if t.deterministic:
        args.append("--deterministic-mode")
    if load_dir is not None:
        args += ["--load", str(load_dir), "--finetune", "--no-load-optim", "--no-load-rng",
                 "--exit-on-missing-checkpoint"]
    if save_dir is not None:
        args += ["--save", str(save_dir), "--save-interval", str(iters), "--no-save-optim", "--no-save-rng"]
    return args


# ---- the log ---------------------------------------------------------------------------------

ITERATION_LINE = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|")
_FIELD = re.compile(r"\|\s*([A-Za-z_0-9 ()/]+?):\s*([-+0-9.eEnaNinf]+)\s*(?=\|)")
# What Megatron prints when its strict load raised and it loaded again non-strictly: always
# "load_return: None", since the DDP and Float16Module wrappers drop load_state_dict's result
# (core_v0.16.1 megatron/training/checkpointing.py:1759-1767, data_parallel_base.py:90-96,
# module.py:511-514; seen in the rehearsal's run of pretrain()). It names no key: the load digest does.
NON_STRICT_LOAD = re.compile(r"^load_return: (.*)$")
METRIC_NAMES = {"lm loss": "lm_loss", "learning rate": "lr", "grad norm": "grad_norm",
                "load_balancing_loss": "aux_loss", "elapsed time per iteration (ms)": "step_time_ms"}


def parse_iteration_line(line: str) -> tuple[int, int, dict[str, float]] | None:
    """(iteration, total, metrics) of a Megatron ``training_log`` line, for progress; None for other lines."""
    match = ITERATION_LINE.search(line)
    if not match:
        return None
    metrics: dict[str, float] = {}
    for name, value in _FIELD.findall(line + "|"):
        name = name.strip()
        key = METRIC_NAMES.get(name) or (name.replace(" loss", "_loss") if name.startswith("mtp_") else None)
        if key:
            try:
                metrics[key] = float(value)
            except ValueError:
                continue
    return int(match.group(1)), int(match.group(2)), metrics


def verify_megatron_log(log_path: Path, *, iterations: int, loaded: bool, exit_status: int) -> str | None:
    """Raise BackendRunError unless the log shows a load (when asked) and every iteration 1..N.

    Returns where Megatron fell back to a non-strict load ("FILE:LINE: load_return: None"), None if
    it did not: that line cannot say what did not load, so the step's load digest decides
    (:func:`verify_load_digest`).
    """
    if not log_path.exists():
        raise BackendRunError(f"{log_path}: Megatron wrote no log (exit status {exit_status})")
    seen: set[int] = set()
    load_ok = False
    non_strict = None
    with open(log_path, encoding="utf-8", errors="replace") as log:
        for number, line in enumerate(log, start=1):
            where = f"{log_path}:{number}: {line.strip()[:300]}"
            if "could not load the checkpoint" in line:
                raise BackendRunError(f"Megatron could not unpickle the checkpoint (it exits 0 anyway): {where}. "
                                      "Write the checkpoint with plain tensors, or apply the megatron-weights-only patch.")
            if "could not find the metadata file" in line and loaded:
                raise BackendRunError(f"Megatron found no checkpoint to load and would start from random weights: {where}")
            if non_strict is None and NON_STRICT_LOAD.match(line.strip()):
                non_strict = where
            if "successfully loaded checkpoint" in line:
                load_ok = True
            parsed = parse_iteration_line(line)
            if parsed:
                seen.add(parsed[0])
    if exit_status != 0:
        raise BackendRunError(f"Megatron exited with status {exit_status}; end of {log_path}:\n"
                              f"{failure_summary(log_path)}")
    if loaded and not load_ok:
        raise BackendRunError(f"{log_path}: no 'successfully loaded checkpoint' line: the checkpoint was not loaded")
    absent = missing_steps(seen, iterations)
    if absent:
        last = max(seen) if seen else 0
        raise BackendRunError(f"{log_path}: iterations {absent[0]}..{absent[-1]} of {iterations} were never logged "
                              f"(last logged: {last}); end of the log:\n{failure_summary(log_path)}")
    return non_strict


# ---- the load digest -------------------------------------------------------------------------


def _rank_state(directory: Path, rank: str) -> dict[str, torch.Tensor]:
    """One ``mp_rank_*`` folder's model tensors, as its file holds them (``_extra_state`` left out)."""
    import torch

    from crossalign.checkpoint.megatron import MODEL_FILE

    model = torch.load(directory / rank / MODEL_FILE, map_location="cpu", weights_only=True)["model"]
    return {k: v for k, v in model.items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}


def verify_load_digest(digest_dir: Path, checkpoint: Path, config: AlignmentConfig) -> int:
    """Hold the launcher's load digest (one file per checkpoint folder a rank loads) against the checkpoint.

    The folders held are those the config's Megatron layout loads (``loaded_rank_folders``): a
    folder no rank reads is not asked for. The model's names may be megatron-core's local-module
    ones (a CPU rehearsal): they are mapped to the TE names (``te_local.py``); stacked routed experts
    are split per expert, as TE's load hook splits them. Raises :class:`LoadDigestError` naming every
    missing, extra, renamed or different tensor; returns how many tensors were verified.
    """
    from crossalign.checkpoint.digest import LoadDigestError, compare_loaded, read_digest, split_stacked_experts
    from crossalign.checkpoint.megatron import MODEL_FILE, find_iteration_dir, loaded_rank_folders
    from crossalign.checkpoint.te_local import local_to_te_names

    names = local_to_te_names(config.model, config.training.megatron_core_version)
    layout = config.parallel.megatron
    directory, _ = find_iteration_dir(checkpoint)
    verified = 0
    for rank in loaded_rank_folders(layout.tensor, layout.pipeline, layout.expert, layout.expert_tensor_size,
                                    layout.world_size):
        if not (directory / rank / MODEL_FILE).exists():
            raise LoadDigestError(f"{directory / rank / MODEL_FILE}: the checkpoint {checkpoint} has no file for "
                                  f"rank {rank}, which the layout {layout.ranks} loads")
        path = digest_dir / f"{rank}.json"
        if not path.exists():
            raise LoadDigestError(f"{path}: Megatron wrote no load digest for rank {rank} of {checkpoint} "
                                  f"(patches/megatron/pretrain_qwen35.py writes it after loading)")
        state = split_stacked_experts(_rank_state(directory, rank), config.model.num_experts)
        loaded = read_digest(path)
        compare_loaded(loaded, state, what=f"Megatron rank {rank} ({path}) vs the checkpoint {checkpoint}",
                       rename=lambda name: names.get(name, name))
        verified += len(loaded)
    return verified


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
        wanted = parse_version(config.training.megatron_core_version)
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
        layout = request.config.parallel.megatron
        if site.nproc_per_node < layout.cards_per_node:
            raise BackendSetupError(f"parallel.megatron.cards_per_node is {layout.cards_per_node}, but the site's "
                                    f"megatron.nproc_per_node is {site.nproc_per_node}")
        rendezvous = ["--standalone"] if layout.nodes == 1 else []  # several nodes: the site's env gives the master
        command = [site.python, "-m", "torch.distributed.run", *rendezvous, "--nnodes", str(layout.nodes),
                   "--nproc_per_node", str(layout.cards_per_node), str(entry), *args]
        checks = [(site.python, "-c", REQUIRES_PYTHON_CHECK)] if site.ssh_host is not None else []
        checks.append((site.python, "-c", DATASET_HELPERS_CHECK))
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
            data_cache_dir=request.output_dir.absolute() / DATA_CACHE_DIR)
        request.output_dir.mkdir(parents=True, exist_ok=True)
        (request.output_dir / ARGS_FILE).write_text("\n".join(args) + "\n")
        return write_run_script(request.output_dir / RUN_SCRIPT, self.run_script(request, args))

    def train(self, request: TrainRequest) -> TrainResult:
        iterations = request.iterations
        script = self.write_launch(request)
        on_line = progress_callback(request.on_step, iterations, parse_iteration_line)
        start = time.monotonic()
        from crossalign.checkpoint.digest import LoadDigestError

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

