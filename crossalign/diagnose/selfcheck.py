"""The conversion self-check: every implementation of Qwen3.5 we have, each on its own checkpoint, must give the
same outputs for the same batch.

This is the source procedure's "strongly recommended" check (load the conversion, run one
forward, compare step-1 losses) done on CPU in fp32, so it needs no GPU and no NPU and is
exact enough to see any wrong rule. The implementations are a list (:data:`IMPLEMENTATIONS`):
the MindSpore model on the MindFormers checkpoint, and the PyTorch reference and
megatron-core's own ``GPTModel`` on the converted Megatron checkpoint. Every load is strict (a
missing, unexpected or misshaped key fails and is named, where Megatron would silently keep
a random weight); then logits, lm loss, every MTP loss and the aux loss are compared for each
pair. With three or more, the one that disagrees with all the others while they agree among
themselves is named: a wrong conversion shows as MindSpore against the rest, a bug in one
model as that model against the rest. Without a checkpoint it makes one: a realistic random
model of the config, saved as a MindFormers checkpoint and converted by the converter under
test, optionally with a named fault injected to show what that pitfall looks like.
"""

from __future__ import annotations

import itertools
import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

import numpy as np

from crossalign.checkpoint.convert import convert_checkpoint
from crossalign.checkpoint.faults import LAYOUT_FAULTS, inject_layout_fault
from crossalign.checkpoint.norms import norm_convention_problem
from crossalign.config import AlignmentConfig, load_config
from crossalign.diagnose.compare import compare_arrays
from crossalign.diagnose.hf_side import build_hf, first_departure, run_hf
from crossalign.diagnose.references import (Batch, Outputs, SideError, build_megatron, build_mindspore, make_batch,
                                            run_megatron, run_mindspore)
from crossalign.models.layout import random_mindformers_state
from crossalign.sides.megatron.checkpoint import iteration_dir_name, read_megatron_checkpoint
from crossalign.sides.mindformers.checkpoint import (default_common, read_mindformers_checkpoint,
                                                     write_mindformers_checkpoint)
from crossalign.tensorio.errors import CheckpointError

# stage name -> called when a stage starts (the CLI shows it; tests ignore it)
StageCallback = Callable[[str], None]


@dataclass(frozen=True)
class Checkpoints:
    """The checkpoints under test: the original and its conversions (MindFormers, Megatron, Hugging Face)."""

    mindformers: Path
    megatron: Path
    huggingface: Path | None  # None when the model has no Hugging Face form


@dataclass(frozen=True)
class Implementation:
    """One implementation of the model: its name, the checkpoint it reads, and one strict forward.

    ``run`` raises :class:`SideError` when its checkpoint does not load strictly. On the
    MindFormers checkpoint that is bad input (it is the source of the conversion); on the
    converted checkpoint it is a failed check, reported as that implementation's load error.
    """

    name: str
    reads: Literal["mindformers", "megatron", "huggingface"]
    run: Callable[[AlignmentConfig, Checkpoints, Batch], Outputs]


def _run_mindspore(config: AlignmentConfig, checkpoints: Checkpoints, batch: Batch) -> Outputs:
    net = build_mindspore(config.model, read_mindformers_checkpoint(checkpoints.mindformers).model_state())
    return run_mindspore(net, batch)


def _megatron_state(config: AlignmentConfig, checkpoints: Checkpoints) -> dict:
    """The converted checkpoint's ranks merged; ranks that do not fit together (a layout fault) fail its check."""

    try:
        state = read_megatron_checkpoint(checkpoints.megatron, config.model).state
    except CheckpointError as exc:
        raise SideError(str(exc)) from None
    problem = norm_convention_problem(state, config.model, f"Megatron checkpoint {checkpoints.megatron}")
    if problem:
        raise SideError(problem)
    return state


def _run_pytorch(config: AlignmentConfig, checkpoints: Checkpoints, batch: Batch) -> Outputs:
    state = _megatron_state(config, checkpoints)
    net, _ = build_megatron(config.model, state, config.training.megatron_core_version, strict=True)
    return run_megatron(net, batch)


def _run_megatron_core(config: AlignmentConfig, checkpoints: Checkpoints, batch: Batch) -> Outputs:
    """megatron-core's own GPTModel on CPU, built by the GPU launcher's layer-spec builder (local modules)."""
    # megatron-core is imported only by the implementation that runs it
    from crossalign.sides.megatron.embedded.mcore_model import McoreLoadError, run_selfcheck_forward

    state = _megatron_state(config, checkpoints)
    try:
        out = run_selfcheck_forward(config.model, config.training, state, config.training.megatron_core_version,
                                    batch.input_ids, batch.labels, batch.loss_mask)
    except McoreLoadError as exc:
        raise SideError(str(exc)) from None
    return Outputs(logits=out["logits"], lm_loss=out["lm_loss"], mtp_losses=np.asarray(out["mtp_losses"]),
                   aux_loss=out["aux_loss"])


def _run_transformers(config: AlignmentConfig, checkpoints: Checkpoints, batch: Batch) -> Outputs:
    """transformers' own Qwen3_5(Moe)ForCausalLM, the public reference implementation, plus the released MTP layout."""
    return run_hf(build_hf(config.model, checkpoints.huggingface), batch)


# The first is the reference of every comparison it is part of (relative errors are taken against it).
IMPLEMENTATIONS: list[Implementation] = [
    Implementation("MindSpore", "mindformers", _run_mindspore),
    Implementation("PyTorch", "megatron", _run_pytorch),
    Implementation("megatron-core", "megatron", _run_megatron_core),
    Implementation("transformers", "huggingface", _run_transformers),
]


@dataclass(frozen=True)
class Tolerances:
    """fp32 everywhere. Losses: relative error |b - a| / |a|. Logits: max abs error over max |logit|,
    and cosine similarity. A loss that is exactly 0 on the reference side (aux loss of a dense model) must
    be below ``zero_abs`` on the other."""

    loss_rel: float = 1e-5
    logits_rel: float = 1e-4
    logits_cosine: float = 1 - 1e-6
    zero_abs: float = 1e-9


@dataclass
class OutputCheck:
    """One output compared between two implementations: the reference value and the other one."""

    name: str
    reference: float | None  # scalars only
    other: float | None
    max_abs: float
    max_rel: float
    cosine: float | None  # logits only
    passed: bool
    limit: str


@dataclass
class ImplementationResult:
    """What one implementation gave: its outputs, or why its checkpoint did not load."""

    name: str
    checkpoint: str
    outputs: Outputs | None = None
    load_error: str | None = None
    seconds: float = 0.0


@dataclass
class PairCheck:
    """Every output of ``other`` compared with ``reference``."""

    reference: str
    other: str
    checks: list[OutputCheck]

    @property
    def name(self) -> str:
        return f"{self.reference} vs {self.other}"

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)


@dataclass
class SelfcheckReport:
    config: str
    batch_shape: tuple[int, int]
    batch_source: str
    mindspore_checkpoint: str
    megatron_checkpoint: str
    fault: str | None
    huggingface_checkpoint: str = "converted here"
    departure: str | None = None  # where transformers and the PyTorch model part, when they do
    implementations: list[ImplementationResult] = field(default_factory=list)
    pairs: list[PairCheck] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    def result(self, name: str) -> ImplementationResult:
        return next(r for r in self.implementations if r.name == name)

    def pair(self, reference: str, other: str) -> PairCheck:
        return next(p for p in self.pairs if (p.reference, p.other) == (reference, other))

    @property
    def load_errors(self) -> list[str]:
        return [f"{r.name}: {r.load_error}" for r in self.implementations if r.load_error is not None]

    @property
    def passed(self) -> bool:
        return not self.load_errors and bool(self.pairs) and all(p.passed for p in self.pairs)

    def odd_one_out(self) -> str | None:
        """The implementation that alone fails: the only one whose checkpoint did not load, or the one that
        disagrees with every other while all the others agree among themselves (needs three or more)."""
        failed_loads = [r.name for r in self.implementations if r.load_error is not None]
        if failed_loads:
            return failed_loads[0] if len(failed_loads) == 1 and len(self.implementations) > 2 else None
        for result in self.implementations:
            with_it = [p for p in self.pairs if result.name in (p.reference, p.other)]
            without = [p for p in self.pairs if result.name not in (p.reference, p.other)]
            if without and all(p.passed for p in without) and not any(p.passed for p in with_it):
                return result.name
        return None

    def failures(self) -> list[str]:
        """One line per problem: each load error naming its keys, or each output outside tolerance per pair."""
        if self.load_errors:
            return self.load_errors
        return [f"{p.name}: {o.name}: max rel {o.max_rel:.3e}"
                + ("" if o.cosine is None else f", cosine {o.cosine:.8f}")
                + f" ({o.limit})" for p in self.pairs for o in p.checks if not o.passed]


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


def scalar_outputs(outputs: Outputs) -> dict[str, float]:
    """The scalar outputs by the names the checks use: lm loss, mtp_k loss, aux loss."""
    values = {"lm loss": outputs.lm_loss}
    values.update({f"mtp_{k} loss": float(v) for k, v in enumerate(outputs.mtp_losses, start=1)})
    values["aux loss"] = outputs.aux_loss
    return values


def compare_outputs(reference: Outputs, other: Outputs, tolerances: Tolerances | None = None) -> list[OutputCheck]:
    """Every forward output compared (logits, lm loss, mtp losses, aux loss)."""
    tol = tolerances or Tolerances()
    checks = []
    if reference.logits.shape != other.logits.shape:
        checks.append(OutputCheck("logits", None, None, math.nan, math.nan, math.nan, False,
                                  f"shapes {reference.logits.shape} vs {other.logits.shape}"))
    else:
        cosine, max_abs, max_rel = compare_arrays(reference.logits, other.logits)
        passed = max_rel <= tol.logits_rel and cosine >= tol.logits_cosine
        checks.append(OutputCheck("logits", None, None, max_abs, max_rel, cosine, passed,
                                  f"rel<={tol.logits_rel:g} cos>=1-{1 - tol.logits_cosine:.0e}"))
    checks.append(_scalar_check("lm loss", reference.lm_loss, other.lm_loss, tol))
    if reference.mtp_losses.shape != other.mtp_losses.shape:
        checks.append(OutputCheck("mtp loss", None, None, math.nan, math.nan, None, False,
                                  f"{reference.mtp_losses.size} vs {other.mtp_losses.size} MTP layers"))
    else:
        for k, (a, b) in enumerate(zip(reference.mtp_losses, other.mtp_losses), start=1):
            checks.append(_scalar_check(f"mtp_{k} loss", float(a), float(b), tol))
    checks.append(_scalar_check("aux loss", reference.aux_loss, other.aux_loss, tol))
    return checks


def check_sources(ms_ckpt: Path | None, mg_ckpt: Path | None, fault: str | None) -> None:
    """A converted checkpoint comes with its source; a fault needs a conversion made here (selfcheck, diagnose)."""
    if mg_ckpt is not None and ms_ckpt is None:
        raise SideError("a converted checkpoint needs the MindFormers checkpoint it came from (--input)")
    if fault is not None and mg_ckpt is not None:
        raise SideError("--fault applies to a conversion made here; it cannot be combined with --converted")


def converted_here(layout: tuple[int, int, int], fault: str | None) -> str:
    """How a report names the Megatron checkpoint that ``make_checkpoints`` converted."""
    return ("converted here" + (" at (tp, pp, ep) = ({}, {}, {})".format(*layout) if layout != (1, 1, 1) else "")
            + (f" with fault {fault}" if fault else ""))


def make_checkpoints(config: AlignmentConfig, workdir: Path, ms_ckpt: Path | None, fault: str | None,
                     seed: int, layout: tuple[int, int, int] = (1, 1, 1)) -> tuple[Path, Path]:
    """Write a random MindFormers checkpoint (unless given) and convert it with the converter under test into the
    (tp, pp, ep) ``layout``; a layout fault breaks the converted rank files the way a converter would."""
    if ms_ckpt is None:
        ms_ckpt = workdir / "mindformers"
        write_mindformers_checkpoint(ms_ckpt, 1, random_mindformers_state(config.model, seed), None,
                                     default_common(1, config.training.global_batch_size))
    mg_ckpt = workdir / "megatron"
    tp, pp, ep = layout
    in_layout = fault in LAYOUT_FAULTS
    report = convert_checkpoint(config.model, "ms2mg", ms_ckpt, mg_ckpt,
                                core_version=config.training.megatron_core_version, dtype="fp32", tp=tp, pp=pp, ep=ep,
                                fault=None if in_layout else fault)
    if in_layout:
        inject_layout_fault(mg_ckpt / iteration_dir_name(report.iteration), fault, config.model, tp, pp, ep)
    return ms_ckpt, mg_ckpt


def _from_huggingface(config: AlignmentConfig, workdir: Path, hf_ckpt: Path) -> tuple[Path, Path]:
    """Convert a Hugging Face checkpoint to MindFormers and to Megatron with the converter under test."""
    ms_ckpt, mg_ckpt = workdir / "mindformers", workdir / "megatron"
    convert_checkpoint(config.model, "hf2ms", hf_ckpt, ms_ckpt, dtype="fp32")
    convert_checkpoint(config.model, "hf2mg", hf_ckpt, mg_ckpt, core_version=config.training.megatron_core_version,
                       dtype="fp32")
    return ms_ckpt, mg_ckpt


def _departure(config: AlignmentConfig, checkpoints: Checkpoints, batch: Batch) -> str:
    """The first module where transformers' model and the PyTorch model part, both run again with hooks."""
    version = config.training.megatron_core_version
    net, _ = build_megatron(config.model, read_megatron_checkpoint(checkpoints.megatron, config.model).state, version)
    found = first_departure(build_hf(config.model, checkpoints.huggingface), net, batch, version)
    if found is None:
        return "every compared module output agrees; they part in the losses"
    hf_module, torch_module, error = found
    return (f"first at transformers {hf_module} / PyTorch {torch_module} (max abs error {error:.3e} of the "
            "largest output)")


def _to_huggingface(config: AlignmentConfig, workdir: Path, ms_ckpt: Path) -> tuple[Path | None, str]:
    """The MindFormers checkpoint in the Hugging Face layout, or None and why the model has no such form."""
    hf_ckpt = workdir / "huggingface"
    try:
        convert_checkpoint(config.model, "ms2hf", ms_ckpt, hf_ckpt, dtype="fp32")
    except CheckpointError as exc:
        return None, f"not run: {exc}"
    return hf_ckpt, "converted here"


def selfcheck(config: AlignmentConfig | str | Path, ms_ckpt: Path | None = None, mg_ckpt: Path | None = None,
              fault: str | None = None, seq: int | None = None, batch: int | None = None, *,
              data: Path | None = None, seed: int = 1234, tolerances: Tolerances | None = None,
              implementations: list[Implementation] | None = None,
              on_stage: StageCallback | None = None, hf_ckpt: Path | None = None,
              layout: tuple[int, int, int] = (1, 1, 1)) -> SelfcheckReport:
    """Run every implementation on one batch and compare each pair's outputs.

    ms_ckpt and mg_ckpt: a MindFormers checkpoint and its conversion. With ms_ckpt alone the
    converter converts it; with neither, a random model of the config (seeded) is written and
    converted. ``fault`` injects a named conversion fault (only when this function converts).
    ``hf_ckpt``: a Hugging Face checkpoint as the source instead; it is converted to both layouts
    here and transformers runs it as it is. Otherwise transformers runs the ms2hf conversion.
    A converted checkpoint that does not load strictly is a failed check (that implementation's
    ``load_error``); a MindFormers checkpoint that does not fit the config raises :class:`SideError`.
    ``layout`` (tp, pp, ep): the conversion made here writes Megatron's ranks of that layout, which the
    Megatron-side implementations read back (a fault of the layout, ``faults.LAYOUT_FAULTS``, shows only so).
    """
    stage = on_stage or (lambda name: None)
    if not isinstance(config, AlignmentConfig):
        config = load_config(config)
    check_sources(ms_ckpt, mg_ckpt, fault)
    if hf_ckpt is not None and (ms_ckpt is not None or mg_ckpt is not None or fault is not None):
        raise SideError("--hf is the source checkpoint: it cannot be combined with --input, --converted or --fault")
    source = "huggingface" if hf_ckpt is not None else "mindformers"
    model = config.model
    seconds: dict[str, float] = {}
    the_batch = make_batch(config, seq, batch, data, seed)
    report = SelfcheckReport(
        config=model.name, batch_shape=the_batch.shape, batch_source=the_batch.source,
        mindspore_checkpoint=str(ms_ckpt) if ms_ckpt is not None else
        "converted here" if hf_ckpt is not None else f"random {model.name} (seed {seed})",
        megatron_checkpoint=str(mg_ckpt) if mg_ckpt is not None else converted_here(layout, fault),
        fault=fault, seconds=seconds)
    # One implementation at a time: a real config's weights, model and logits must not all be in memory twice.
    with tempfile.TemporaryDirectory(prefix="crossalign-selfcheck-") as tmp:
        start = time.perf_counter()
        if hf_ckpt is not None:
            stage("converting the Hugging Face checkpoint")
            ms_ckpt, mg_ckpt = _from_huggingface(config, Path(tmp), Path(hf_ckpt))
            report.huggingface_checkpoint = str(hf_ckpt)
        elif mg_ckpt is None:
            stage("writing and converting a checkpoint" if ms_ckpt is None else "converting the checkpoint")
            ms_ckpt, mg_ckpt = make_checkpoints(config, Path(tmp), ms_ckpt, fault, seed, layout)
        if hf_ckpt is None:
            hf_ckpt, report.huggingface_checkpoint = _to_huggingface(config, Path(tmp), Path(ms_ckpt))
        seconds["convert"] = time.perf_counter() - start
        checkpoints = Checkpoints(mindformers=Path(ms_ckpt), megatron=Path(mg_ckpt), huggingface=hf_ckpt)
        for implementation in implementations or IMPLEMENTATIONS:
            if implementation.reads == "huggingface" and hf_ckpt is None:
                continue
            result = ImplementationResult(implementation.name, implementation.reads)
            start = time.perf_counter()
            stage(f"{implementation.name} forward")
            try:
                result.outputs = implementation.run(config, checkpoints, the_batch)
            except SideError as exc:
                if implementation.reads == source:
                    raise
                result.load_error = str(exc)
            result.seconds = seconds[implementation.name] = time.perf_counter() - start
            report.implementations.append(result)
        ran = {r.name: r.outputs for r in report.implementations if r.outputs is not None}
        if "transformers" in ran and "PyTorch" in ran and not all(
                check.passed for check in compare_outputs(ran["PyTorch"], ran["transformers"], tolerances)):
            stage("finding where transformers and PyTorch part")
            report.departure = _departure(config, checkpoints, the_batch)
    loaded = [r for r in report.implementations if r.outputs is not None]
    for reference, other in itertools.combinations(loaded, 2):
        report.pairs.append(PairCheck(reference.name, other.name,
                                      compare_outputs(reference.outputs, other.outputs, tolerances)))
    return report
