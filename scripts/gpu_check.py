"""The pieces of scripts/gpu_check.sh: a real Megatron step against our PyTorch reference.

On a machine with one NVIDIA GPU, TransformerEngine, flash-linear-attention and a Megatron-LM
checkout, ``python scripts/gpu_check.py --megatron PATH`` does, in about five minutes for the tiny
configs:

1. builds the tiny dataset, a random tiny MindFormers checkpoint, its bf16 cast and its
   Megatron conversion (exactly DAG steps 2 and 3);
2. trains two iterations with the real Megatron backend (run script, log checks);
3. computes the step-1 losses of the same global batch with our PyTorch model in fp32 on CPU
   from the converted weights, and compares them with Megatron's step-1 line;
4. runs the gated delta rule Megatron's GatedDeltaNet really runs for this config, on CUDA,
   against fla's pure-torch recurrent form on CPU (:func:`megatron_delta_rule` says which).

``--dry-run`` stops after step 1 and writing Megatron's argument file and run script (no GPU
needed). Every path is made absolute first: the run script changes into the Megatron-LM checkout.
Every function but :func:`train_megatron` runs on CPU, so the tests exercise them there. Exit
status 0 when every check passes, 1 otherwise; a summary is written to ``<work>/gpu_check.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from crossalign.data.files import DatasetFiles
from crossalign.sides.protocol import TrainRequest
from crossalign.config import AlignmentConfig, load_config

STEP1_TOLERANCE = 0.005  # SPEC 1: step-1 relative error < 0.5% (bf16 Megatron against fp32 reference)
KERNEL_TOLERANCE = 1e-4  # fp32 chunked delta rule against the recurrence (relative error of the output)


@dataclass
class Check:
    name: str
    expected: float
    actual: float
    tolerance: float
    difference: float | None = None  # tensors compared: expected/actual are their norms, this the norm of a - b

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
                f"relative error {self.relative_error:.3e} (tolerance {self.tolerance:g})")


def check_config(name: str, iterations: int = 2) -> AlignmentConfig:
    """The model config with a run short enough for a smoke check (warmup 1: Megatron needs warmup < iterations)."""
    config = load_config(name)
    training = config.training.model_copy(update={"train_iters": iterations, "lr_warmup_iters": 1})
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


def delta_rule_check(config: AlignmentConfig, device: str = "cuda", seed: int = 1234) -> Check:
    """Megatron's delta rule for this config on ``device`` against fla's recurrent form on CPU (fp32).

    Random inputs of the config's GatedDeltaNet sizes over one training sequence; the relative error
    is ||o - o_ref|| / ||o_ref||.
    """
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    m, seq = config.model, config.training.seq_length
    heads, dk, dv = m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(2, seq, heads, dk, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(2, seq, heads, dv, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(2, seq, heads, generator=gen))  # log decay, < 0
    beta = torch.sigmoid(torch.randn(2, seq, heads, generator=gen))
    reference, _ = naive_recurrent_gated_delta_rule(q, k, v, beta, g, scale=dk ** -0.5)
    name, kernel = megatron_delta_rule(config.training.deterministic)
    out = kernel(*(t.to(device) for t in (q, k, v, g, beta))).float().cpu()
    return Check(f"delta rule on {device}: {name} vs fla recurrent form on CPU (output norms)",
                 float(reference.norm()), float(out.norm()), KERNEL_TOLERANCE, float((out - reference).norm()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron", type=Path, help="Megatron-LM checkout (not needed with --skip-megatron)")
    parser.add_argument("--work", type=Path, default=Path("gpu_check_work"))
    parser.add_argument("--model", default="qwen35_moe_tiny")
    parser.add_argument("--skip-megatron", action="store_true", help="only the delta-rule kernel check")
    parser.add_argument("--dry-run", action="store_true", help="prepare the inputs and write Megatron's run "
                        "script, run nothing (no GPU needed)")
    options = parser.parse_args(argv)
    if options.megatron is None and not options.skip_megatron:
        parser.error("--megatron PATH (the Megatron-LM checkout) is required, unless --skip-megatron")
    # The run script changes into the Megatron-LM checkout: every path it names must be absolute.
    work = options.work.expanduser().absolute()
    megatron = options.megatron.expanduser().absolute() if options.megatron else None

    start = time.monotonic()
    config = check_config(options.model)
    work.mkdir(parents=True, exist_ok=True)
    print(f"[1/4] dataset and checkpoints under {work}", flush=True)
    data, checkpoint = prepare_inputs(config, work)
    if options.dry_run:
        if megatron is not None:
            backend, request = megatron_launch(config, data, checkpoint, work, megatron)
            print(f"dry run: Megatron would run {backend.write_launch(request)}", flush=True)
        print(f"dry run: the delta-rule check would run {DELTA_RULE_PATHS[config.training.deterministic]} on CUDA",
              flush=True)
        return 0
    checks: list[Check] = []
    if not options.skip_megatron:
        print("[2/4] Megatron: two iterations through the real backend", flush=True)
        log = train_megatron(config, data, checkpoint, work, megatron)  # type: ignore[arg-type]
        print("[3/4] fp32 reference on CPU, step-1 losses", flush=True)
        reference = reference_losses(config, checkpoint, data.prefix)
        checks += step1_checks(reference, megatron_step1(log, config.training.megatron_core_version))
    print("[4/4] the gated delta rule Megatron runs, on CUDA, against the CPU recurrence", flush=True)
    checks.append(delta_rule_check(config, "cuda"))
    for check in checks:
        print(check.line())
    summary = {"model": options.model, "seconds": round(time.monotonic() - start, 1),
               "ok": all(c.ok for c in checks),
               "checks": [dict(asdict(c), relative_error=c.relative_error, ok=c.ok) for c in checks]}
    (work / "gpu_check.json").write_text(json.dumps(summary, indent=2))
    print(f"{'PASS' if summary['ok'] else 'FAIL'} in {summary['seconds']} s", flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
