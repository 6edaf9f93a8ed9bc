"""Compare two dumps module by module in forward order and name the first module whose output diverges.

The MindSpore side is the reference (it ran the original weights). Each MindSpore module
call is paired with the Megatron module the conversion rules map it to (same call index:
the embedding and output layer run once for the main model and once per MTP layer), and
their outputs are compared: cosine similarity, max abs error, and max rel error defined as
``max|megatron - mindspore| / max|mindspore|`` (stable where single elements are near zero;
for a scalar it is the usual relative error). Dumps without tensors are compared by their
statistics (norm, std, abs max). Children finish before their parents, so the first
diverging entry in forward order is the innermost module that first went wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from crossalign.config import ModelConfig
from crossalign.diagnose.causes import KnownCause, explain
from crossalign.diagnose.dump import Dump, DumpEntry, entry_key
from crossalign.diagnose.mapping import ModuleMapping

Status = Literal["ok", "diverged", "shape differs", "no output"]


@dataclass(frozen=True)
class Thresholds:
    """When a module's output counts as diverged: cosine below ``cosine_min`` or max rel error above ``max_rel``
    (tensors), or a relative difference of norm/std/abs max above ``stat_rel`` (statistics only)."""

    cosine_min: float
    max_rel: float
    stat_rel: float

    @classmethod
    def for_precision(cls, precision: str) -> "Thresholds":
        """fp32: both sides on CPU in fp32 (rounding only, ~1e-6); bf16: real runs on NPU and GPU."""
        if precision == "fp32":
            return cls(cosine_min=1 - 1e-5, max_rel=1e-3, stat_rel=1e-4)
        if precision == "bf16":
            return cls(cosine_min=0.999, max_rel=0.05, stat_rel=0.01)
        raise ValueError(f"precision {precision!r}: expected 'fp32' or 'bf16'")


@dataclass
class ModuleRow:
    """One compared module call."""

    order: int
    mindspore: str
    megatron: str
    shape: tuple[int, ...] | None
    cosine: float | None
    max_abs: float | None
    max_rel: float | None
    status: Status
    basis: Literal["tensor", "stats", "-"]
    note: str = ""

    @property
    def diverged(self) -> bool:
        return self.status == "diverged"


@dataclass
class Diagnosis:
    """The comparison: rows in forward order, the first divergence and its known causes."""

    rows: list[ModuleRow]
    first_divergence: ModuleRow | None
    causes: list[KnownCause]
    thresholds: Thresholds
    not_compared: list[str] = field(default_factory=list)
    load_problems: list[str] = field(default_factory=list)
    layout: tuple[int, int, int] | None = None  # (tp, pp, ep) of the Megatron checkpoint; None: not known

    @property
    def diverged(self) -> bool:
        return self.first_divergence is not None

    def hint(self) -> str:
        if self.first_divergence is None:
            return "no module diverges"
        row = self.first_divergence
        where = f"first divergence at {row.megatron} (MindSpore {row.mindspore})"
        if row.cosine is not None:
            where += f", cosine {row.cosine:.4f}"
        if not self.causes:
            return where + "; no known cause matches this module"
        lines = [where + "; likely:"]
        lines += [f"- {c.cause} (check: {c.check})" for c in self.causes]
        return "\n".join(lines)


def compare_arrays(reference: np.ndarray, other: np.ndarray) -> tuple[float, float, float]:
    """(cosine, max abs error, max abs error / max |reference|) of two same-shaped arrays, in float64."""
    a = np.asarray(reference, dtype=np.float64).reshape(-1)
    b = np.asarray(other, dtype=np.float64).reshape(-1)
    diff = np.abs(a - b)
    max_abs = float(diff.max()) if diff.size else 0.0
    scale = float(np.abs(a).max()) if a.size else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0 and nb == 0:
        cosine = 1.0
    elif na == 0 or nb == 0:
        cosine = 0.0
    else:
        cosine = float(np.dot(a, b) / (na * nb))
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        cosine, max_abs, max_rel = math.nan, math.nan, math.nan
    return cosine, max_abs, max_rel


def _aligned(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The two arrays in one shape: equal shapes, or equal after dropping size-1 dims; else None."""
    if a.shape == b.shape:
        return a, b
    sa, sb = np.squeeze(a), np.squeeze(b)
    if sa.shape == sb.shape:
        return sa, sb
    return None


def _stat_difference(a: dict, b: dict) -> float:
    worst = 0.0
    for key in ("norm", "std", "abs_max"):
        x, y = a.get(key), b.get(key)
        if x is None or y is None:
            return math.inf
        worst = max(worst, abs(x - y) / max(abs(x), 1e-30))
    return worst


def _compare_entry(ms_dump: Dump, ms: DumpEntry, mg_dump: Dump, mg: DumpEntry, mg_name: str,
                   permutation: np.ndarray | None, thresholds: Thresholds) -> ModuleRow:
    count = min(len(ms.outputs), len(mg.outputs))
    base = dict(order=ms.order, mindspore=ms.key, megatron=entry_key(mg_name, mg.call))
    if count == 0:
        return ModuleRow(**base, shape=None, cosine=None, max_abs=None, max_rel=None, status="no output", basis="-")
    worst: ModuleRow | None = None
    for index in range(count):
        row = _compare_output(ms_dump, ms, mg_dump, mg, index, permutation if index == 0 else None, thresholds, base)
        if worst is None or _severity(row) > _severity(worst):
            worst = row
    assert worst is not None
    return worst


def _severity(row: ModuleRow) -> tuple[int, float]:
    rank = {"diverged": 3, "shape differs": 2, "ok": 1, "no output": 0}[row.status]
    return rank, (1.0 - row.cosine) if row.cosine is not None and not math.isnan(row.cosine) else 0.0


def _compare_output(ms_dump: Dump, ms: DumpEntry, mg_dump: Dump, mg: DumpEntry, index: int,
                    permutation: np.ndarray | None, thresholds: Thresholds, base: dict) -> ModuleRow:
    ms_stats, mg_stats = ms.outputs[index], mg.outputs[index]
    shape = tuple(ms_stats["shape"])
    a, b = ms_dump.tensor(ms, index), mg_dump.tensor(mg, index)
    if a is not None and b is not None:
        if permutation is not None and a.shape and a.shape[-1] == len(permutation):
            a = a[..., permutation]
        pair = _aligned(a, b)
        if pair is None:
            return ModuleRow(**base, shape=shape, cosine=None, max_abs=None, max_rel=None, status="shape differs",
                             basis="tensor", note=f"output {index}: {list(a.shape)} vs {list(b.shape)}")
        cosine, max_abs, max_rel = compare_arrays(*pair)
        bad = math.isnan(cosine) or cosine < thresholds.cosine_min or max_rel > thresholds.max_rel
        return ModuleRow(**base, shape=shape, cosine=cosine, max_abs=max_abs, max_rel=max_rel,
                         status="diverged" if bad else "ok", basis="tensor",
                         note=f"output {index}" if index else "")
    if int(np.prod(ms_stats["shape"])) != int(np.prod(mg_stats["shape"])):
        return ModuleRow(**base, shape=shape, cosine=None, max_abs=None, max_rel=None, status="shape differs",
                         basis="stats", note=f"output {index}: {ms_stats['shape']} vs {mg_stats['shape']}")
    difference = _stat_difference(ms_stats, mg_stats)
    return ModuleRow(**base, shape=shape, cosine=None, max_abs=None, max_rel=difference,
                     status="diverged" if difference > thresholds.stat_rel else "ok", basis="stats",
                     note=f"output {index}" if index else "")


def compare_dumps(mindspore: Dump, megatron: Dump, mapping: ModuleMapping, model: ModelConfig,
                  thresholds: Thresholds | None = None, load_problems: list[str] | None = None,
                  layout: tuple[int, int, int] | None = None) -> Diagnosis:
    """Pair every MindSpore module call with its Megatron counterpart, compare in forward order, explain the first
    divergence (with the causes a Megatron checkpoint in ``layout``, (tp, pp, ep), can have; None: any)."""
    thresholds = thresholds or Thresholds.for_precision("fp32")
    rows: list[ModuleRow] = []
    not_compared: list[str] = []
    for entry in mindspore.entries:
        mg_name = mapping.megatron_name(entry.name)
        if mg_name is None:
            reason = "fused into " + mapping.fused[entry.name] if entry.name in mapping.fused else "no counterpart"
            not_compared.append(f"{entry.key} ({reason})")
            continue
        mg_entry = megatron.by_key.get(entry_key(mg_name, entry.call))
        if mg_entry is None:
            not_compared.append(f"{entry.key} (Megatron {entry_key(mg_name, entry.call)} has no output in its dump)")
            continue
        rows.append(_compare_entry(mindspore, entry, megatron, mg_entry, mg_name,
                                   mapping.output_permutations.get(entry.name), thresholds))
    first = next((row for row in rows if row.diverged), None)
    causes = explain(first.megatron.partition("#")[0], model, layout) if first else []
    return Diagnosis(rows=rows, first_divergence=first, causes=causes, thresholds=thresholds,
                     not_compared=not_compared, load_problems=list(load_problems or []), layout=layout)
