"""The pieces of scripts/gpu_check.sh: a real Megatron step against our PyTorch reference.

On a machine with one NVIDIA GPU, TransformerEngine, flash-linear-attention and a Megatron-LM
checkout, ``python scripts/gpu_check.py --megatron PATH`` does, in about five minutes for the tiny
configs:

1. builds the tiny dataset, a random tiny MindFormers checkpoint, its bf16 cast and its
   Megatron conversion (exactly DAG steps 2 and 3);
2. trains two iterations with the real Megatron backend (run script, log checks);
3. computes the step-1 losses of the same global batch with our PyTorch model in fp32 on CPU
   from the converted weights, and compares them with Megatron's step-1 line;
4. runs the gated delta rule Megatron's GatedDeltaNet really runs for this config, on CUDA, in fp32
   and bf16, against fla's pure-torch recurrent form on CPU (:func:`megatron_delta_rule` says which),
   each held to its output bound in the kernel probe's table (``kernel_probe.KERNEL_TOLERANCES``).

``--no-te`` trains with megatron-core's local modules and fla instead, as the embedded side builds them
(``LocalMegatronBackend``), where TransformerEngine cannot be had: the GPU environment check, ``--iterations``
iterations in bf16 on ``--device`` (cuda, or cpu to run it anywhere), step 1 against the fp32 reference, the
same batches in fp32 on CPU, and both logs through ``crossalign compare``; it prints the kernels that trained
and the kernel probe each training ran first (every GatedDeltaNet kernel, forward and backward, against the fp32
reference: ``kernel_probe``).
Each training runs in its own process (``--train-embedded``), as the DAG's step runs it.

``--dry-run`` stops after step 1 and writing Megatron's argument file and run script (no GPU
needed). Every path is made absolute first: the run script changes into the Megatron-LM checkout.
Every function but :func:`train_megatron` runs on CPU, so the tests exercise them there. Exit
status 0 when every check passes, 1 otherwise; a summary is written to ``<work>/gpu_check.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from crossalign.data.files import DatasetFiles
from crossalign.sides.protocol import TrainRequest
from crossalign.config import AlignmentConfig, load_config

STEP1_TOLERANCE = 0.005  # SPEC 1: step-1 relative error < 0.5% (bf16 Megatron against fp32 reference)


class GpuCheckError(RuntimeError):
    """The check cannot go on: a refused GPU environment, a training process that failed (its output is above)."""


@dataclass
class Check:
    name: str
    expected: float
    actual: float
    tolerance: float
    difference: float | None = None  # tensors compared: expected/actual are their norms, this the norm of a - b
    reason: str = ""  # why this tolerance

    @property
    def relative_error(self) -> float:
        difference = abs(self.actual - self.expected) if self.difference is None else self.difference
        return difference / max(abs(self.expected), 1e-12)

    @property
    def ok(self) -> bool:
        return self.relative_error < self.tolerance

    def line(self) -> str:
        mark = "ok  " if self.ok else "FAIL"
        return (f"[{mark}] {self.name}: reference {self.expected:.6f}, checked {self.actual:.6f}, "
                f"relative error {self.relative_error:.3e} (tolerance {self.tolerance:g}"
                + (f": {self.reason})" if self.reason else ")"))


def check_config(name: str, iterations: int = 2, deterministic: bool | None = None) -> AlignmentConfig:
    """The model config with a run short enough for a smoke check (warmup 1: Megatron needs warmup < iterations)."""
    config = load_config(name)
    update = {"train_iters": iterations, "lr_warmup_iters": 1}
    if deterministic is not None:
        update["deterministic"] = deterministic
    training = config.training.model_copy(update=update)
    return config.model_copy(update={"training": training})


def prepare_inputs(config: AlignmentConfig, work: Path, seed: int = 1234) -> tuple[DatasetFiles, Path]:
    """Dataset, random MindFormers checkpoint, bf16 cast, Megatron conversion; returns (data, Megatron checkpoint)."""
    from crossalign.checkpoint.cast import cast_bf16
    from crossalign.checkpoint.convert import convert_checkpoint
    from crossalign.models.layout import random_mindformers_state
    from crossalign.sides.mindformers.checkpoint import write_mindformers_checkpoint
    from crossalign.data.prepare import prepare_dataset

    model, training = config.model, config.training
    data = prepare_dataset(work / "data", model.vocab_size)
    base = work / "mindformers_base"
    if not base.exists():
        common = {"epoch_num": 1, "step_num": 0, "global_step": 0, "loss_scale": 1.0,
                  "global_batch_size": training.global_batch_size, "consumed_samples": 0, "ckpt_status": None}
        write_mindformers_checkpoint(base, 0, random_mindformers_state(model, seed), None, common)
    bf16 = work / "mindformers_bf16"
    if not bf16.exists():
        cast_bf16(base, bf16)
    megatron = work / "megatron_checkpoint"
    if not megatron.exists():
        convert_checkpoint(model, "ms2mg", bf16, megatron, core_version=training.megatron_core_version)
    return data, megatron


def first_batch(config: AlignmentConfig, prefix: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global batch 1 as Megatron reads it: (input_ids, labels, loss_mask)."""
    from crossalign.sides.registry import batches_for

    tokens = torch.as_tensor(batches_for("megatron", config.training, prefix)[0], dtype=torch.long)
    return tokens[:, :-1], tokens[:, 1:], torch.ones(tokens.shape[0], tokens.shape[1] - 1)


def reference_losses(config: AlignmentConfig, checkpoint: Path, prefix: Path, device: str = "cpu",
                     delta_rule_form: str = "chunk") -> dict[str, float]:
    """Step-1 losses of our PyTorch model (fp32) from the converted Megatron checkpoint on global batch 1."""
    from crossalign.models.torch_model import GatedDeltaNet, Qwen35Model, load_megatron_state
    from crossalign.sides.megatron.checkpoint import read_megatron_checkpoint

    net = Qwen35Model(config.model, config.training.megatron_core_version)
    load_megatron_state(net, read_megatron_checkpoint(checkpoint, config.model).state)
    for module in net.modules():
        if isinstance(module, GatedDeltaNet):
            module.delta_rule_form = delta_rule_form
    net = net.to(device).float().eval()
    input_ids, labels, loss_mask = (t.to(device) for t in first_batch(config, prefix))
    with torch.no_grad():
        _, lm_loss, mtp_losses, aux_loss = net(input_ids, labels, loss_mask)
    losses = {"lm_loss": float(lm_loss)}
    losses.update({f"mtp_{i + 1}_loss": float(v) for i, v in enumerate(mtp_losses)})
    return losses


def megatron_step1(log_path: Path, core_version: str) -> dict[str, float]:
    """Megatron's logged step-1 losses (the first line is iteration 1 alone in every core version)."""
    from crossalign.sides.megatron.log_parser import parse_megatron_log

    frame = parse_megatron_log(log_path, core_version)
    row = frame[frame["step"] == 1].iloc[0]
    return {name: float(row[name]) for name in frame.columns
            if name == "lm_loss" or (name.startswith("mtp_") and name.endswith("_loss"))}


def step1_checks(reference: dict[str, float], megatron: dict[str, float],
                 tolerance: float = STEP1_TOLERANCE) -> list[Check]:
    missing = sorted(set(reference) - set(megatron))
    if missing:
        raise ValueError(f"Megatron's step-1 line lacks {', '.join(missing)}")
    return [Check(f"step-1 {name} (Megatron vs fp32 reference)", reference[name], megatron[name], tolerance)
            for name in sorted(reference)]


def megatron_launch(config: AlignmentConfig, data: DatasetFiles, checkpoint: Path, work: Path, megatron: Path):
    """The real Megatron backend for this machine (this Python, one GPU) and the request of the check's run."""
    from crossalign.sides.megatron.backend import MegatronBackend
    from crossalign.site import FrameworkSite, SiteConfig

    site = SiteConfig(megatron=FrameworkSite(path=megatron, python=sys.executable, nproc_per_node=1))
    request = TrainRequest(config=config, side="megatron", mode="align", data=data, output_dir=work / "megatron_run",
                           init_checkpoint=checkpoint,
                           on_step=lambda step, total, m: print(f"  megatron iteration {step}/{total}: {m}", flush=True))
    return MegatronBackend(site=site), request


def train_megatron(config: AlignmentConfig, data: DatasetFiles, checkpoint: Path, work: Path, megatron: Path) -> Path:
    """Two iterations through the real backend; returns its log."""
    backend, request = megatron_launch(config, data, checkpoint, work, megatron)
    return backend.train(request).log_path


DELTA_RULE_PATHS = {True: "Megatron torch_chunk_gated_delta_rule after torch's conv1d (--deterministic-mode)",
                    False: "fla chunk_gated_delta_rule after a causal-conv1d kernel (no --deterministic-mode)"}


def megatron_delta_rule(deterministic: bool):
    """(name, fn(q, k, v, g, beta) -> o) of the gated delta rule Megatron's GatedDeltaNet runs.

    With --deterministic-mode (our configs' default) Megatron runs torch's own conv1d and its
    torch-native ``torch_chunk_gated_delta_rule``, never fla's Triton kernel:
    megatron/core/ssm/gated_delta_net.py core_v0.16.1 lines 326-327 and 370-380, core_v0.18.0
    lines 211-214 and 424; core_v0.19.0 megatron/core/ssm/gated_delta_net/gdn.py lines 59-62 and
    199 (the package re-exports the function at the same import path). Without it, fla's
    ``chunk_gated_delta_rule`` (and a causal-conv1d kernel). Both take q, k, v as [B, T, H, d],
    already L2-normalised, and scale by 1/sqrt(dk).
    """
    if deterministic:
        from crossalign.data.mcore import quiet_megatron_import

        with quiet_megatron_import():
            from megatron.core.ssm.gated_delta_net import torch_chunk_gated_delta_rule

        def megatron_torch(q, k, v, g, beta):
            return torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=None,
                                                output_final_state=False, use_qk_l2norm_in_kernel=False)[0]

        return DELTA_RULE_PATHS[True], megatron_torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    def fla_chunk(q, k, v, g, beta):
        return chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=False)[0]

    return DELTA_RULE_PATHS[False], fla_chunk


def kernel_tolerance(deterministic: bool, precision: str) -> tuple[float, str]:
    """(output bound, reason) of the delta rule Megatron runs (``deterministic``) in ``precision``."""
    from crossalign.sides.megatron.kernel_probe import FLA_CHUNK, KERNEL_TOLERANCES, MEGATRON_TORCH

    tolerance = KERNEL_TOLERANCES[(MEGATRON_TORCH if deterministic else FLA_CHUNK, precision)]
    return tolerance.bounds["output"], tolerance.reason


def delta_rule_check(config: AlignmentConfig, device: str = "cuda", seed: int = 1234, precision: str = "fp32",
                     deterministic: bool | None = None) -> Check:
    """Megatron's delta rule for this config on ``device`` in ``precision`` against fla's recurrent form on CPU.

    Random inputs of the config's GatedDeltaNet sizes over one training sequence; the relative error
    is ||o - o_ref|| / ||o_ref||. ``deterministic`` (default: the config's) picks the kernel.
    """
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    m, seq = config.model, config.training.seq_length
    heads, dk, dv = m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(2, seq, heads, dk, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(2, seq, heads, dv, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(2, seq, heads, generator=gen))  # log decay, < 0
    beta = torch.sigmoid(torch.randn(2, seq, heads, generator=gen))
    if precision == "bf16":  # GatedDeltaNet under --bf16: q, k, v, beta in bf16; g computed in fp32
        q, k, v, beta = (t.to(torch.bfloat16) for t in (q, k, v, beta))
    reference, _ = naive_recurrent_gated_delta_rule(q.float(), k.float(), v.float(), beta.float(), g,
                                                    scale=dk ** -0.5)
    deterministic = config.training.deterministic if deterministic is None else deterministic
    name, kernel = megatron_delta_rule(deterministic)
    tolerance, reason = kernel_tolerance(deterministic, precision)
    out = kernel(*(t.to(device) for t in (q, k, v, g, beta))).float().cpu()
    return Check(f"delta rule on {device} in {precision}: {name} vs fla recurrent form on CPU (output norms)",
                 float(reference.norm()), float(out.norm()), tolerance, float((out - reference).norm()), reason)


def fla_ieee_figure(options, config: AlignmentConfig) -> float | None:
    """fla's fp32 chunk rule on CUDA with ``TRITON_F32_DEFAULT=ieee`` and an empty Triton cache, in a process of
    its own: what is left with TF32 only where fla asks for it explicitly (benchmarks/fla_tf32.py predicts 1.1e-5
    for the tiny configs; an H200 read 1.46e-3 with the variable set in a warm cache). A figure, not a check."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gpu_check_triton_") as cache:
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--fla-ieee", "--model", options.model,
                               "--work", str(options.work)], capture_output=True, text=True,
                              env={**os.environ, "TRITON_F32_DEFAULT": "ieee", "TRITON_CACHE_DIR": cache})
    figures = [line.split()[-1] for line in done.stdout.splitlines() if line.startswith(RESULT_MARKER)]
    return float(figures[0]) if done.returncode == 0 and figures else None


def environment_lines(config: AlignmentConfig, side: str) -> tuple[list[str], bool]:
    """The GPU environment check of this Python (``crossalign preflight gpu``): its lines, and whether nothing
    was refused."""
    from crossalign.preflight.gpu_env import check, read_environment

    env = read_environment(deterministic=config.training.deterministic, side=side)  # type: ignore[arg-type]
    findings = check(env)
    return [f"  {env.describe()}"] + [f"  {f.line()}" for f in findings], not any(
        f.status == "refused" for f in findings)


def embedded_config(config: AlignmentConfig, device: str, precision: str) -> AlignmentConfig:
    training = config.training.model_copy(update={"embedded_device": device, "embedded_precision": precision})
    return config.model_copy(update={"training": training})


def train_embedded(config: AlignmentConfig, data: DatasetFiles, checkpoint: Path, work: Path, device: str,
                   precision: str) -> dict:
    """megatron-core's GPTModel with local modules and fla (the embedded side, ``LocalMegatronBackend``) on
    ``device`` in ``precision`` from the converted checkpoint; returns its log, seconds and details."""
    from crossalign.sides.megatron.embedded.trainer import LocalMegatronBackend

    run_config = embedded_config(config, device, precision)
    backend = LocalMegatronBackend()
    request = TrainRequest(config=run_config, side="megatron", mode="align", data=data,
                           output_dir=work / f"embedded_{device}_{precision}", init_checkpoint=checkpoint,
                           on_step=lambda step, total, m: print(f"  {device} {precision} iteration {step}/{total}: "
                                                                f"{m}", flush=True))
    result = backend.train(request)
    return {"log": str(result.log_path), "seconds": result.seconds, "details": result.details,
            "implementation": backend.implementation(run_config)}


def train_embedded_process(options, device: str, precision: str) -> dict:
    """:func:`train_embedded` in a process of its own (a fresh torch.distributed and megatron-core state)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--train-embedded", f"{device}:{precision}",
               "--work", str(options.work), "--model", options.model, "--iterations", str(options.iterations)]
    if options.deterministic is not None:
        command.append("--deterministic" if options.deterministic else "--no-deterministic")
    # the CPU run sees no GPU, as on a CPU machine: megatron-core's CPU workarounds are made for that
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {})}
    done = subprocess.run(command, text=True, stdout=subprocess.PIPE, stderr=None, env=env)
    lines = done.stdout.splitlines()
    for line in lines:
        if not line.startswith(RESULT_MARKER):
            print(line, flush=True)
    results = [json.loads(line[len(RESULT_MARKER):]) for line in lines if line.startswith(RESULT_MARKER)]
    if done.returncode != 0 or not results:
        raise GpuCheckError(f"the embedded training on {device} in {precision} failed (exit {done.returncode}; a "
                            "kernel probe that refused the machine says KernelDisagrees above)")
    return results[0]


RESULT_MARKER = "@@embedded@@"


def median_iteration_ms(log: Path, core_version: str) -> float:
    """The median of Megatron's 'elapsed time per iteration' after the first (which holds the start-up)."""
    from crossalign.sides.megatron.log_parser import parse_megatron_log

    times = parse_megatron_log(log, core_version)["step_time_ms"].dropna().tolist()
    return statistics.median(times[1:] or times)


def compare_through_cli(device_log: Path, cpu_log: Path, out: Path, config: AlignmentConfig) -> dict:
    """``crossalign compare`` of the device run (as the 'npu' side) against the CPU fp32 run (the reference), both
    megatron-core logs (``--allow-any-format``); returns its summary.json with the exit status."""
    command = [sys.executable, "-c", "from crossalign.cli import app; app()", "compare",
               "--npu-log", str(device_log), "--gpu-log", str(cpu_log), "--out", str(out),
               "--megatron-core-version", config.training.megatron_core_version,
               "--expect-steps", str(config.training.train_iters), "--allow-any-format", "--no-plot"]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "COLUMNS": "160"})
    print(done.stdout, end="", flush=True)
    if not (out / "summary.json").exists():
        raise GpuCheckError(f"crossalign compare wrote no summary (exit {done.returncode}): {done.stderr.strip()}")
    return {**json.loads((out / "summary.json").read_text()), "exit_status": done.returncode}


def run_no_te(options, config: AlignmentConfig, data: DatasetFiles, checkpoint: Path) -> tuple[list[Check], dict]:
    """The --no-te check: the embedded side's training on the device against the fp32 reference and a CPU fp32
    run of the same batches. Returns the checks and what the summary adds."""
    device, n = options.device, config.training.train_iters
    print(f"[2/6] GPU environment check (embedded side, training.deterministic "
          f"{str(config.training.deterministic).lower()})", flush=True)
    lines, clear = environment_lines(config, "embedded")
    print("\n".join(lines), flush=True)
    if not clear:
        raise GpuCheckError("the GPU environment check refused this machine (above)")
    print(f"[3/6] megatron-core (local modules, fla) on {device} in bf16: {n} iterations", flush=True)
    trained = train_embedded_process(options, device, "bf16")
    kernels = trained["details"].get("kernels", {})
    print(f"  trained by {trained['implementation']}", flush=True)
    print("  kernels that ran: " + ", ".join(f"{k} {v}" for k, v in kernels.items()), flush=True)
    print(f"[4/6] the same batches in fp32 on CPU: {n} iterations", flush=True)
    cpu = train_embedded_process(options, "cpu", "fp32")
    probed = {f"{device} bf16": trained["details"].get("kernel_probe", []),
              "cpu fp32": cpu["details"].get("kernel_probe", [])}
    for where, lines in probed.items():
        print(f"  kernel probe before the {where} training, against the fp32 reference:", flush=True)
        print("\n".join(f"    {line}" for line in lines), flush=True)
    print("[5/6] step 1 against the fp32 reference; both logs through crossalign compare", flush=True)
    version = config.training.megatron_core_version
    reference = reference_losses(config, checkpoint, data.prefix)
    checks = [Check(c.name.replace("Megatron", f"megatron-core on {device}"), c.expected, c.actual, c.tolerance)
              for c in step1_checks(reference, megatron_step1(Path(trained["log"]), version))]
    summary = compare_through_cli(Path(trained["log"]), Path(cpu["log"]), options.work / "compare", config)
    lm = summary["series"].get("lm_loss", {})
    print(f"  crossalign compare, {n} iterations on {device} (bf16) vs CPU (fp32): verdict {summary['verdict']}, "
          f"lm loss relative error mean {lm.get('mean_rel_err', float('nan')):.2e}, max "
          f"{lm.get('max_rel_err', float('nan')):.2e}", flush=True)
    device_ms = median_iteration_ms(Path(trained["log"]), version)
    cpu_ms = median_iteration_ms(Path(cpu["log"]), version)
    print(f"  median iteration: {device_ms:.0f} ms on {device} (bf16), {cpu_ms:.0f} ms on CPU (fp32)", flush=True)
    print(f"[6/6] the gated delta rule the embedded side runs on {device}, fp32 and bf16, against the CPU "
          "recurrence", flush=True)
    deterministic = config.training.deterministic or device == "cpu"  # on CPU it always runs Megatron's torch rule
    checks += [delta_rule_check(config, device, precision=p, deterministic=deterministic) for p in ("fp32", "bf16")]
    added_ieee = fla_ieee_figure(options, config) if device == "cuda" else None
    if device == "cuda":
        print(f"  fla chunk rule in fp32 with TRITON_F32_DEFAULT=ieee, empty Triton cache: relative error "
              f"{added_ieee if added_ieee is None else format(added_ieee, '.3e')} (a figure, not a check)", flush=True)
    added = {"device": device, "kernels": kernels, "implementation": trained["implementation"],
             "compare": {"verdict": summary["verdict"], "exit_status": summary["exit_status"],
                         "lm_mean_rel_err": lm.get("mean_rel_err"), "lm_max_rel_err": lm.get("max_rel_err"),
                         "reasons": summary.get("reasons", [])},
             "median_iteration_ms": {device: device_ms, "cpu_fp32": cpu_ms}, "kernel_probe": probed,
             "fla_fp32_ieee_rel_err": added_ieee}
    return checks, added


def run_checks(options, config: AlignmentConfig, data: DatasetFiles, checkpoint: Path,
               megatron: Path | None) -> tuple[list[Check], dict]:
    """Steps 2 on: --no-te's, or Megatron-LM's with TransformerEngine and the kernels on CUDA."""
    if options.no_te:
        return run_no_te(options, config, data, checkpoint)
    checks: list[Check] = []
    if not options.skip_megatron:
        lines, clear = environment_lines(config, "real")
        print("\n".join(lines), flush=True)
        if not clear:
            raise GpuCheckError("the GPU environment check refused this machine (above)")
        print("[2/4] Megatron: two iterations through the real backend", flush=True)
        log = train_megatron(config, data, checkpoint, options.work, megatron)  # type: ignore[arg-type]
        print("[3/4] fp32 reference on CPU, step-1 losses", flush=True)
        reference = reference_losses(config, checkpoint, data.prefix)
        checks += step1_checks(reference, megatron_step1(log, config.training.megatron_core_version))
    print("[4/4] the gated delta rule Megatron runs, on CUDA, against the CPU recurrence", flush=True)
    checks += [delta_rule_check(config, "cuda", precision=p) for p in ("fp32", "bf16")]
    return checks, {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron", type=Path, help="Megatron-LM checkout (not needed with --skip-megatron, --no-te)")
    parser.add_argument("--work", type=Path, default=Path("gpu_check_work"))
    parser.add_argument("--model", default="qwen35_moe_tiny")
    parser.add_argument("--skip-megatron", action="store_true", help="only the delta-rule kernel check")
    parser.add_argument("--no-te", action="store_true", help="megatron-core with local modules and fla, as the "
                        "embedded side builds them, instead of Megatron-LM with TransformerEngine")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where --no-te trains and the "
                        "kernels run (cpu: the check without a GPU)")
    parser.add_argument("--iterations", type=int, default=None, help="iterations of the runs (default 2; 30 with "
                        "--no-te)")
    parser.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                        help="override training.deterministic (Megatron's --deterministic-mode)")
    parser.add_argument("--train-embedded", metavar="DEVICE:PRECISION", help=argparse.SUPPRESS)
    parser.add_argument("--fla-ieee", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dry-run", action="store_true", help="prepare the inputs and write Megatron's run "
                        "script, run nothing (no GPU needed)")
    options = parser.parse_args(argv)
    if options.megatron is None and not (options.skip_megatron or options.no_te or options.train_embedded):
        parser.error("--megatron PATH (the Megatron-LM checkout) is required, unless --skip-megatron or --no-te")
    if options.iterations is None:
        options.iterations = 30 if options.no_te else 2
    if options.iterations < 2:
        parser.error("--iterations must be at least 2 (Megatron needs warmup 1 < iterations)")
    # The run script changes into the Megatron-LM checkout: every path it names must be absolute.
    work = options.work = options.work.expanduser().absolute()
    megatron = options.megatron.expanduser().absolute() if options.megatron else None

    start = time.monotonic()
    config = check_config(options.model, options.iterations, options.deterministic)
    work.mkdir(parents=True, exist_ok=True)
    if options.fla_ieee:  # fla_ieee_figure's process
        check = delta_rule_check(config, "cuda", deterministic=False)
        print(f"{RESULT_MARKER} {check.relative_error!r}", flush=True)
        return 0
    if options.train_embedded:  # one training of --no-te, in its own process
        device, _, precision = options.train_embedded.partition(":")
        data, checkpoint = prepare_inputs(config, work)
        print(RESULT_MARKER + json.dumps(train_embedded(config, data, checkpoint, work, device, precision)),
              flush=True)
        return 0
    steps = 6 if options.no_te else 4
    print(f"[1/{steps}] dataset and checkpoints under {work}", flush=True)
    data, checkpoint = prepare_inputs(config, work)
    if options.dry_run:
        if megatron is not None and not options.no_te:
            backend, request = megatron_launch(config, data, checkpoint, work, megatron)
            print(f"dry run: Megatron would run {backend.write_launch(request)}", flush=True)
        print(f"dry run: the delta-rule check would run {DELTA_RULE_PATHS[config.training.deterministic]} on "
              f"{options.device.upper() if options.device == 'cpu' else 'CUDA'}", flush=True)
        return 0
    try:
        checks, added = run_checks(options, config, data, checkpoint, megatron)
    except GpuCheckError as exc:  # a refused environment, a failed embedded training: one line, no traceback
        print(f"FAIL: {exc}", flush=True)
        return 1
    for check in checks:
        print(check.line())
    ok = all(c.ok for c in checks) and added.get("compare", {}).get("verdict", "pass") == "pass"
    summary = {"model": options.model, "seconds": round(time.monotonic() - start, 1), "ok": ok, **added,
               "checks": [dict(asdict(c), relative_error=c.relative_error, ok=c.ok) for c in checks]}
    (work / "gpu_check.json").write_text(json.dumps(summary, indent=2))
    print(f"{'PASS' if summary['ok'] else 'FAIL'} in {summary['seconds']} s", flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
