"""Which divergence thresholds two msprobe dumps are held to, from the dtypes msprobe recorded on each side.

msprobe records each tensor's ``dtype`` as its framework names it (``torch.float32``, ``torch.bfloat16`` on the
PyTorch side; ``Float32``, ``BFloat16`` on the MindSpore side: ``msprobe/core/dump/data_dump/data_processor``). A side
whose floating tensors are all 32-bit (or wider) ran in fp32; one with a 16-bit float anywhere ran in bf16 or fp16.
``--precision auto`` takes fp32 thresholds only where both sides ran in fp32, and otherwise the looser side's: bf16's
(``compare.Thresholds``; fp16 keeps more mantissa bits than bf16, and crossalign has no tighter fp16 set, so a side in
fp16 is held to bf16's too). The choice and its reason go into the report.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from crossalign.diagnose.compare import Thresholds
from crossalign.diagnose.msprobe_dump import SIDE_NAMES, StepDump

SIXTEEN_BITS = ("bfloat16", "float16")  # lower-cased, torch. dropped
WIDE = ("float32", "float64")


@dataclass(frozen=True)
class PrecisionChoice:
    """The thresholds a comparison uses, and why."""

    precision: str  # fp32 or bf16
    reason: str

    @property
    def thresholds(self) -> Thresholds:
        return Thresholds.for_precision(self.precision)

    def as_dict(self) -> dict:
        thresholds = self.thresholds
        return {"precision": self.precision, "why": self.reason, "cosine_min": thresholds.cosine_min,
                "max_rel": thresholds.max_rel, "stat_rel": thresholds.stat_rel}


def _dtype(name: str) -> str:
    return name.lower().removeprefix("torch.").removeprefix("mindspore.")


def float_dtypes(step: StepDump) -> Counter:
    """How many floating tensors of each dtype the module records of every rank hold (inputs, outputs, weights)."""
    counts: Counter = Counter()
    for rank in step.ranks.values():
        for entry in rank.entries.values():
            for record in (*entry.inputs, *entry.outputs, *entry.parameters.values()):
                dtype = _dtype(record.dtype)
                if "float" in dtype:
                    counts[dtype] += 1
    return counts


def _side(counts: Counter) -> tuple[str, str]:
    """(fp32 or the 16-bit dtype a side ran in, how its dump shows it)."""
    total = sum(counts.values())
    narrow = {dtype: n for dtype, n in counts.items() if dtype in SIXTEEN_BITS}
    if not narrow:
        return "fp32", f"{' and '.join(sorted(counts)) or 'no floating tensor'} only ({total} tensors)"
    dtype, held = max(narrow.items(), key=lambda item: item[1])
    return dtype, f"{dtype} ({held} of {total} floating tensors)"


def choose_precision(npu: StepDump, gpu: StepDump, asked: str) -> PrecisionChoice:
    """The thresholds for ``--precision asked`` (auto, fp32 or bf16) and the reason."""
    sides = {step.framework: _side(float_dtypes(step)) for step in (npu, gpu)}
    said = "; ".join(f"the {SIDE_NAMES[framework]} dump records {text}" for framework, (_, text) in sides.items())
    if asked in ("fp32", "bf16"):
        return PrecisionChoice(asked, f"--precision {asked} (asked; {said})")
    if asked != "auto":
        raise ValueError(f"--precision {asked!r}: expected auto, fp32 or bf16")
    narrow = [SIDE_NAMES[framework] for framework, (kind, _) in sides.items() if kind != "fp32"]
    if not narrow:
        return PrecisionChoice("fp32", f"--precision auto: both sides ran in fp32 ({said}): fp32 thresholds")
    if len(narrow) == len(sides):
        return PrecisionChoice("bf16", f"--precision auto: both sides ran in 16-bit floats ({said}): bf16 "
                                       f"thresholds")
    return PrecisionChoice("bf16", f"--precision auto: mixed precision ({said}): the looser side's thresholds, "
                                   f"bf16's ({narrow[0]})")
