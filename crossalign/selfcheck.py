"""The conversion self-check: the MindSpore model on the MindFormers checkpoint and the PyTorch model on the
converted Megatron checkpoint must give the same outputs for the same batch.

This is the source procedure's "strongly recommended" check (load the conversion, run one
forward, compare step-1 losses) done on CPU in fp32 with our two reference models, so it
needs no GPU and no NPU and is exact enough to see any wrong rule: both loads are strict
(a missing, unexpected or misshaped key fails and is named, where Megatron would silently
keep a random weight), then logits, lm loss, every MTP loss and the aux loss are compared.
Without a checkpoint it makes one: a realistic random model of the config, saved as a
MindFormers checkpoint and converted by the converter under test, optionally with a named
fault injected to show what that pitfall looks like.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from crossalign.config import AlignmentConfig, load_config
from crossalign.diagnose.compare import compare_arrays
from crossalign.diagnose.sides import (Outputs, SideError, build_megatron, build_mindspore, make_batch, run_megatron,
                                       run_mindspore)

# stage name -> called when a stage starts (the CLI shows it; tests ignore it)
StageCallback = Callable[[str], None]


@dataclass(frozen=True)
class Tolerances:
    """fp32 on both sides. Losses: relative error |mg - ms| / |ms|. Logits: max abs error over max |logit|,
    and cosine similarity. A loss that is exactly 0 on the MindSpore side (aux loss of a dense model) must
    be below ``zero_abs`` on the other."""

    loss_rel: float = 1e-5
    logits_rel: float = 1e-4
    logits_cosine: float = 1 - 1e-6
    zero_abs: float = 1e-9


@dataclass
class OutputCheck:
    """One output compared: the MindSpore value (reference) and the Megatron one."""

    name: str
    mindspore: float | None  # scalars only
    megatron: float | None
    max_abs: float
    max_rel: float
    cosine: float | None  # logits only
    passed: bool
    limit: str


@dataclass
class SelfcheckReport:
    config: str
    batch_shape: tuple[int, int]
    batch_source: str
    mindspore_checkpoint: str
    megatron_checkpoint: str
    fault: str | None
    outputs: list[OutputCheck] = field(default_factory=list)
    load_error: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.load_error is None and bool(self.outputs) and all(o.passed for o in self.outputs)

    def failures(self) -> list[str]:
        """One line per problem: the load error naming its keys, or each output outside tolerance."""
        if self.load_error is not None:
            return [self.load_error]
        return [f"{o.name}: max rel {o.max_rel:.3e}" + ("" if o.cosine is None else f", cosine {o.cosine:.8f}")
                + f" ({o.limit})" for o in self.outputs if not o.passed]


def _scalar_check(name: str, reference: float, other: float, tol: Tolerances) -> OutputCheck:
    max_abs = abs(other - reference)
    if reference == 0.0:
        passed = max_abs <= tol.zero_abs
        max_rel = 0.0 if max_abs == 0 else math.inf
        limit = f"abs<={tol.zero_abs:g}"
    else:
        max_rel = max_abs / abs(reference)
        passed = max_rel <= tol.loss_rel
        limit = f"rel<={tol.loss_rel:g}"
    if not (math.isfinite(reference) and math.isfinite(other)):
        passed, max_rel = False, math.nan
    return OutputCheck(name, reference, other, max_abs, max_rel, None, passed, limit)


def compare_outputs(mindspore: Outputs, megatron: Outputs, tolerances: Tolerances | None = None) -> list[OutputCheck]:
    """Every forward output compared (logits, lm loss, mtp losses, aux loss)."""
    tol = tolerances or Tolerances()
    checks = []
    if mindspore.logits.shape != megatron.logits.shape:
        checks.append(OutputCheck("logits", None, None, math.nan, math.nan, math.nan, False,
                                  f"shapes {mindspore.logits.shape} vs {megatron.logits.shape}"))
    else:
        cosine, max_abs, max_rel = compare_arrays(mindspore.logits, megatron.logits)
        passed = max_rel <= tol.logits_rel and cosine >= tol.logits_cosine
        checks.append(OutputCheck("logits", None, None, max_abs, max_rel, cosine, passed,
                                  f"rel<={tol.logits_rel:g} cos>=1-{1 - tol.logits_cosine:.0e}"))
    checks.append(_scalar_check("lm loss", mindspore.lm_loss, megatron.lm_loss, tol))
    if mindspore.mtp_losses.shape != megatron.mtp_losses.shape:
        checks.append(OutputCheck("mtp loss", None, None, math.nan, math.nan, None, False,
                                  f"{mindspore.mtp_losses.size} vs {megatron.mtp_losses.size} MTP layers"))
    else:
        for k, (a, b) in enumerate(zip(mindspore.mtp_losses, megatron.mtp_losses), start=1):
            checks.append(_scalar_check(f"mtp_{k} loss", float(a), float(b), tol))
    checks.append(_scalar_check("aux loss", mindspore.aux_loss, megatron.aux_loss, tol))
    return checks


def _make_checkpoints(config: AlignmentConfig, workdir: Path, ms_ckpt: Path | None, fault: str | None,
                      seed: int) -> tuple[Path, Path]:
    """Write a random MindFormers checkpoint (unless given) and convert it with the converter under test."""
    from crossalign.checkpoint.convert import convert_checkpoint

    if ms_ckpt is None:
        from crossalign.checkpoint.layout import random_mindformers_state
        from crossalign.checkpoint.mindformers import default_common, write_mindformers_checkpoint

        ms_ckpt = workdir / "mindformers"
        write_mindformers_checkpoint(ms_ckpt, 1, random_mindformers_state(config.model, seed), None,
                                     default_common(1, config.training.global_batch_size))
    mg_ckpt = workdir / "megatron"
    convert_checkpoint(config.model, "ms2mg", ms_ckpt, mg_ckpt, core_version=config.training.megatron_core_version,
                       dtype="fp32", fault=fault)
    return ms_ckpt, mg_ckpt


def selfcheck(config: AlignmentConfig | str | Path, ms_ckpt: Path | None = None, mg_ckpt: Path | None = None,
              fault: str | None = None, seq: int | None = None, batch: int | None = None, *,
              data: Path | None = None, seed: int = 1234, tolerances: Tolerances | None = None,
              on_stage: StageCallback | None = None) -> SelfcheckReport:
    """Run both reference models on one batch and compare their outputs.

    ms_ckpt and mg_ckpt: a MindFormers checkpoint and its conversion. With ms_ckpt alone the
    converter converts it; with neither, a random model of the config (seeded) is written and
    converted. ``fault`` injects a named conversion fault (only when this function converts).
    A Megatron checkpoint that does not load strictly is a failed check (``load_error``); a
    MindFormers checkpoint that does not fit the config raises :class:`SideError`.
    """
    from crossalign.checkpoint.megatron import read_megatron_checkpoint
    from crossalign.checkpoint.mindformers import read_mindformers_checkpoint

    stage = on_stage or (lambda name: None)
    if not isinstance(config, AlignmentConfig):
        config = load_config(config)
    if mg_ckpt is not None and ms_ckpt is None:
        raise SideError("a converted checkpoint needs the MindFormers checkpoint it came from (--input)")
    if fault is not None and mg_ckpt is not None:
        raise SideError("--fault applies to a conversion made here; it cannot be combined with --converted")
    model = config.model
    seconds: dict[str, float] = {}
    the_batch = make_batch(config, seq, batch, data, seed)
    report = SelfcheckReport(
        config=model.name, batch_shape=the_batch.shape, batch_source=the_batch.source,
        mindspore_checkpoint=str(ms_ckpt) if ms_ckpt is not None else f"random {model.name} (seed {seed})",
        megatron_checkpoint=str(mg_ckpt) if mg_ckpt is not None else
        "converted here" + (f" with fault {fault}" if fault else ""),
        fault=fault, seconds=seconds)
    # One side at a time: a real config's weights, model and logits must not all be in memory twice.
    with tempfile.TemporaryDirectory(prefix="crossalign-selfcheck-") as tmp:
        if mg_ckpt is None:
            start = time.perf_counter()
            stage("writing and converting a checkpoint" if ms_ckpt is None else "converting the checkpoint")
            ms_ckpt, mg_ckpt = _make_checkpoints(config, Path(tmp), ms_ckpt, fault, seed)
            seconds["convert"] = time.perf_counter() - start

        start = time.perf_counter()
        stage("MindSpore forward")
        ms_net = build_mindspore(model, read_mindformers_checkpoint(Path(ms_ckpt)).model_state())
        ms_out = run_mindspore(ms_net, the_batch)
        del ms_net
        seconds["mindspore"] = time.perf_counter() - start

        start = time.perf_counter()
        stage("PyTorch forward")
        try:
            net, _ = build_megatron(model, read_megatron_checkpoint(Path(mg_ckpt), model).state,
                                    config.training.megatron_core_version, strict=True)
        except SideError as exc:
            report.load_error = str(exc)
            return report
        mg_out = run_megatron(net, the_batch)
        del net
        seconds["megatron"] = time.perf_counter() - start
    report.outputs = compare_outputs(ms_out, mg_out, tolerances)
    return report
