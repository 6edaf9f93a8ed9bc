"""Hold a MindFormers (MindSpore) msprobe dump against a Megatron (PyTorch) one and name where they first part.

Both sides are first merged into whole tensors by their own parallel layouts (``msprobe_shards``). Then, in this
order, so that a conversion fault shows at its own tensor before any activation does:

1. weights: every conversion rule (``checkpoint/rules.conversion_plan``) applied to the MindSpore side's dumped
   parameters must give the Megatron side's dumped parameters;
2. forward: each MindSpore cell call paired with its Megatron module (``diagnose/mapping.py``, derived from the same
   rules; same call index), outputs and first input compared; the first module whose input agrees and whose
   output differs is named, with crossalign's likely causes (``diagnose/causes.py``);
3. backward: the same in backward order, the incoming gradient (msprobe's backward ``input``) against the
   outgoing one (its ``output``);
4. weight gradients: the dumps' ``parameters_grad`` through the same rules as the weights.

Each compared tensor gets msprobe's metrics and pass rule (``msprobe_metrics``) in tensor mode; statistics dumps
are compared by their Max, Min, Mean and Norm (a weight re-laid-out by a permutation keeps its statistics, so a
permutation fault of a weight shows only in md5 or tensor dumps, and in the activations), md5 dumps by md5.
A tensor counts as differing when msprobe's rule fails it or crossalign's thresholds for the precision do
(``compare.Thresholds``: fp32 for both sides on CPU, bf16 for real runs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from crossalign.checkpoint.rules import ZeroCentre, conversion_plan
from crossalign.config import ModelConfig
from crossalign.diagnose.causes import BACKWARD, EVIDENCE, FORWARD, GRADIENT, WEIGHT, Evidence, KnownCause, explain
from crossalign.diagnose.compare import Thresholds
from crossalign.diagnose.mapping import ModuleMapping
from crossalign.diagnose.msprobe_dump import MsprobeDumpError
from crossalign.diagnose.msprobe_metrics import TensorMetrics, md5_result, statistics_warning, tensor_metrics
from crossalign.diagnose.msprobe_precision import PrecisionChoice
from crossalign.diagnose.msprobe_shards import WholeDump, WholeEntry, WholeRecord, combine_statistics
from crossalign.sides.megatron.te_local import local_to_te_names

SECTIONS = ("weights", "forward", "backward", "weight gradients")


@dataclass
class Row:
    """One compared tensor pair (or the worst of a module's outputs)."""

    section: str
    mindspore: str
    megatron: str
    shape: tuple[int, ...] | None
    basis: str  # tensor, statistics, md5, or - (not compared)
    metrics: dict[str, float | None]
    msprobe: str  # msprobe's verdict: Yes/No/N/A (tensor), pass/diff (md5), warning/'' (statistics)
    status: str  # ok, differs, shape differs, not compared
    input_status: str = "-"  # forward/backward: ok, differs, not comparable, -
    note: str = ""

    @property
    def differs(self) -> bool:
        return self.status in ("differs", "shape differs")


@dataclass
class MsprobeDiagnosis:
    """The whole comparison of two msprobe dumps."""

    rows: list[Row]
    first: dict[str, Row | None]  # per section
    causes: list[KnownCause]
    mapped: list[tuple[str, str]]
    unmapped_mindspore: list[str]
    unmapped_megatron: list[str]
    notes: list[str]
    mode: str
    step: int
    precision: PrecisionChoice
    evidence: Evidence | None = None  # what the first divergence shows (None: nothing diverges)
    ruled_out: str = ""  # why the conversion is ruled out, where the evidence rules it out

    @property
    def thresholds(self) -> Thresholds:
        return self.precision.thresholds

    @property
    def first_divergence(self) -> Row | None:
        return next((self.first[s] for s in SECTIONS if self.first.get(s) is not None), None)

    @property
    def diverged(self) -> bool:
        return self.first_divergence is not None

    def hint(self) -> str:
        row = self.first_divergence
        if row is None:
            return "no weight, activation or gradient differs"
        where = f"first divergence ({row.section}) at {row.megatron} (MindSpore {row.mindspore})"
        cosine, ratio = row.metrics.get("Cosine"), row.metrics.get("norm ratio")
        if cosine is not None:
            where += f", Cosine {cosine:.6f}"
        if ratio is not None:
            where += f", norm ratio {ratio:.6f} (Megatron / MindSpore)"
        if self.evidence is not None:
            where += f"; evidence: {EVIDENCE[self.evidence.kind]}"
        if self.ruled_out:
            where += f"; {self.ruled_out}"
        if not self.causes:
            return where + "; no known cause fits this evidence at this module"
        return "\n".join([where + "; likely:"] + [f"- {c.cause} (needs: {c.needs}; check: {c.check})"
                                                   for c in self.causes])


# ---- comparing one pair of records ---------------------------------------------------------------------------


def _crossalign_verdict(metrics: TensorMetrics, a: np.ndarray, thresholds: Thresholds) -> bool:
    """True where crossalign's own thresholds fail the pair: cosine, or max abs error over max |MindSpore|."""
    if metrics.cosine is not None and metrics.cosine < thresholds.cosine_min:
        return True
    scale = float(np.abs(a).max()) if a.size else 0.0
    if metrics.max_abs_err is None:
        return True
    return (metrics.max_abs_err / scale if scale > 0 else metrics.max_abs_err) > thresholds.max_rel


def _stat_difference(npu: dict, bench: dict) -> float:
    """Largest relative difference of Max, Min and Norm (Mean is near 0 for most activations)."""
    worst = 0.0
    for key in ("Max", "Min", "Norm"):
        x, y = npu.get(key), bench.get(key)
        if x is None or y is None:
            continue
        worst = max(worst, abs(x - y) / max(abs(x), abs(y), 1e-30))
    return worst


def compare_arrays(a: np.ndarray, b: np.ndarray, thresholds: Thresholds) -> tuple[str, dict, str, tuple]:
    """(status, metrics, msprobe verdict, shape) of two arrays (MindSpore first)."""
    if a.shape != b.shape:
        squeezed = np.squeeze(a), np.squeeze(b)
        if (min(a.ndim, b.ndim) == 2 and a.ndim != b.ndim and a.size == b.size and a.shape[-1] == b.shape[-1]):
            # rows of [tokens x heads, dim] against [b, s, heads, dim]: megatron-core's GDN out_norm runs on its
            # input flattened in order (core_v0.16.1 megatron/core/ssm/gated_delta_net.py:412-416,
            # _apply_gated_norm: x.reshape(-1, x.shape[-1]))
            squeezed = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
        if squeezed[0].shape != squeezed[1].shape:
            return "shape differs", {}, "N/A", a.shape
        a, b = squeezed
    metrics = tensor_metrics(a, b)
    verdict = metrics.accuracy_reached
    bad = verdict == "No" or _crossalign_verdict(metrics, a, thresholds)
    norm_a = float(np.linalg.norm(a))
    ratio = float(np.linalg.norm(b)) / norm_a if norm_a > 0 else None  # a constant scale keeps the cosine at 1
    return ("differs" if bad else "ok"), {**metrics.as_dict(), "norm ratio": ratio}, verdict, a.shape


def compare_records(ms: WholeRecord, mg: WholeRecord, mode: str, thresholds: Thresholds,
                    permutation: np.ndarray | None = None) -> tuple[str, str, dict, str, tuple]:
    """(basis, status, metrics, msprobe verdict, shape) of one tensor pair."""
    if mode == "tensor" and ms.has_tensor and mg.has_tensor:
        a, b = ms.load(), mg.load()
        if permutation is not None and a.shape and a.shape[-1] == len(permutation):
            a = a[..., permutation]
        status, metrics, verdict, shape = compare_arrays(a, b, thresholds)
        return "tensor", status, metrics, verdict, shape
    if math.prod(ms.shape) != math.prod(mg.shape):
        return "statistics", "shape differs", {}, "N/A", ms.shape
    if mode == "md5" and ms.md5 is not None and mg.md5 is not None:
        verdict = md5_result(ms.md5, mg.md5)
        return "md5", "ok" if verdict == "pass" else "differs", {}, verdict, ms.shape
    npu, bench = ms.stats, mg.stats
    warning = statistics_warning(npu, bench)
    difference = _stat_difference(npu, bench)
    metrics = {f"{k} diff": (None if npu.get(k) is None or bench.get(k) is None else npu[k] - bench[k])
               for k in ("Max", "Min", "Mean", "Norm")}
    metrics["relative difference"] = difference
    # msprobe's warning is reported, not decisive: a Mean near 0 trips it on rounding alone
    status = "differs" if difference > thresholds.stat_rel else "ok"
    return "statistics", status, metrics, "warning" if warning else "", ms.shape


# ---- weights and weight gradients through the conversion rules --------------------------------------------------


def _parameter_records(dump: WholeDump, direction: str, renames: dict[str, str] | None = None
                       ) -> dict[str, WholeRecord]:
    """Full parameter name -> record, from each module's first forward call (weights) or its parameters_grad;
    ``renames``: megatron-core's local-module names -> the TransformerEngine names the conversion rules write
    (``sides/megatron/te_local.py``: a CPU run's separate norms and ``local_experts``)."""
    found: dict[str, WholeRecord] = {}
    for entry in dump.entries.values():
        if not entry.is_module or entry.direction != direction:
            continue
        for pname, record in entry.parameters.items():
            full = f"{entry.name}.{pname}" if entry.name else pname
            found.setdefault((renames or {}).get(full, full), record)
    return found


def with_unfused_norms(mapping: ModuleMapping, gpu: WholeDump) -> ModuleMapping:
    """The mapping with each norm that the Megatron dump runs as a module of its own (megatron-core's local
    modules, no TransformerEngine: ``input_layernorm``/``pre_mlp_layernorm`` are RMSNorm, not fused) paired with it
    instead of fused into the linear after it."""
    modules = {e.name for e in gpu.entries.values() if e.is_module and "weight" in e.parameters}
    own = {}
    for norm in mapping.fused:
        parent, _, leaf = norm.rpartition(".")
        counterpart = f"{mapping.pairs.get(parent, parent)}.{leaf}" if parent else leaf
        if counterpart in modules:
            own[norm] = counterpart
    if not own:
        return mapping
    return ModuleMapping(pairs={**mapping.pairs, **own}, fused={k: v for k, v in mapping.fused.items() if k not in own},
                         unpaired=mapping.unpaired, output_permutations=mapping.output_permutations)


def _rule_rows(section: str, plan, ms_params: dict[str, WholeRecord], mg_params: dict[str, WholeRecord],
               mode: str, thresholds: Thresholds) -> tuple[list[Row], list[str]]:
    """Rows of every rule whose tensors both dumps hold; notes for rules only one side's dump holds."""
    rows: list[Row] = []
    notes: list[str] = []
    for placed in plan:
        ms_keys, mg_keys = placed.source_keys, placed.target_keys
        have_ms = [k in ms_params for k in ms_keys]
        have_mg = [k in mg_params for k in mg_keys]
        if not any(have_ms) and not any(have_mg):
            continue
        label_ms, label_mg = ", ".join(ms_keys), ", ".join(mg_keys)
        if not all(have_ms) or not all(have_mg):
            absent = [k for k, h in zip(ms_keys, have_ms) if not h] + [k for k, h in zip(mg_keys, have_mg) if not h]
            rows.append(Row(section, label_ms, label_mg, None, "-", {}, "", "not compared",
                            note="not in the dump: " + ", ".join(absent)))
            continue
        ms_records, mg_records = [ms_params[k] for k in ms_keys], [mg_params[k] for k in mg_keys]
        if mode == "tensor" and all(r.has_tensor for r in ms_records + mg_records):
            moved = placed.rule.forward([torch.from_numpy(r.load()) for r in ms_records])
            for key, ms_tensor, mg_record in zip(mg_keys, moved, mg_records):
                status, metrics, verdict, shape = compare_arrays(ms_tensor.double().numpy(), mg_record.load(),
                                                                 thresholds)
                rows.append(Row(section, label_ms, key, shape, "tensor", metrics, verdict, status))
            continue
        if isinstance(placed.rule, ZeroCentre):
            rows.append(Row(section, label_ms, label_mg, None, "-", {}, "", "not compared",
                            note="--apply-layernorm-1p shifts the values: statistics cannot be held side by side"))
            continue
        if mode == "md5" and len(ms_records) == 1 and len(mg_records) == 1 and type(placed.rule).__name__ == "Rename":
            verdict = md5_result(ms_records[0].md5, mg_records[0].md5)
            rows.append(Row(section, label_ms, label_mg, ms_records[0].shape, "md5", {}, verdict,
                            "ok" if verdict == "pass" else "differs"))
            continue
        # Every rule moves elements without changing them: the tensors' multisets agree, and so do their statistics.
        ms_whole, mg_whole = _concatenated(ms_records), _concatenated(mg_records)
        basis, status, metrics, verdict, shape = compare_records(ms_whole, mg_whole, "statistics", thresholds)
        rows.append(Row(section, label_ms, label_mg, shape, basis, metrics, verdict, status,
                        note="statistics: a permutation of the weight does not show here"))
    return rows, notes


def _concatenated(records: list[WholeRecord]) -> WholeRecord:
    """Several tensors as one flat tensor, for their combined statistics."""
    if len(records) == 1:
        return records[0]
    parts = [part for record in records for part in record.parts]
    return WholeRecord(records[0].dtype, (sum(math.prod(r.shape) for r in records),), parts, 0,
                       known_stats=combine_statistics(records))


# ---- activations -----------------------------------------------------------------------------------------------


def _module_index(dump: WholeDump) -> dict[tuple[str, str, int], WholeEntry]:
    return {(e.name, e.direction, e.index): e for e in dump.entries.values() if e.is_module}


def _input_norm(entry: WholeEntry) -> float | None:
    return entry.inputs[0].stats.get("Norm") if entry.inputs else None


def pair_calls(npu: WholeDump, gpu: WholeDump, mapping: ModuleMapping) -> dict[tuple[str, str, int], int]:
    """(MindSpore module, direction, call) -> the Megatron call of its counterpart that took the same input.

    A module called more than once (the embedding and output layer: once for the main model, once per MTP layer)
    is not called in the same order by both: megatron-core runs the MTP block before the main model's output layer.
    Each call is paired with the counterpart's call whose first input has the nearest norm."""
    calls: dict[tuple[str, str], list[WholeEntry]] = {}
    for entry in gpu.entries.values():
        if entry.is_module:
            calls.setdefault((entry.name, entry.direction), []).append(entry)
    mine: dict[tuple[str, str], list[WholeEntry]] = {}
    for entry in npu.entries.values():
        if entry.is_module and mapping.megatron_name(entry.name) is not None:
            mine.setdefault((entry.name, entry.direction), []).append(entry)
    pairs: dict[tuple[str, str, int], int] = {}
    for (name, direction), ours in mine.items():
        theirs = calls.get((mapping.megatron_name(name), direction), [])
        if len(ours) < 2 or len(theirs) != len(ours):
            continue
        free = list(theirs)
        for entry in ours:
            norm = _input_norm(entry)
            if norm is None or any(_input_norm(t) is None for t in free):
                break
            best = min(free, key=lambda t: abs(_input_norm(t) - norm))
            free.remove(best)
            pairs[(name, direction, entry.index)] = best.index
    return pairs


def pre_norm_modules(mapping: ModuleMapping) -> set[str]:
    """Megatron modules whose input is the hidden state before a norm that MindSpore runs as a cell of its own.

    TransformerEngine fuses the norm into the linear after it (``mapping.FUSED_NORM_PARAMETER``), so that linear and
    every module between it and the norm's parent (the GDN or attention block, the MLP) take the un-normed hidden
    state, while their MindSpore counterparts take the norm's output: their inputs, and the gradients of their
    inputs, are not the same tensors.
    """
    found: set[str] = set()
    for norm, linears in mapping.fused.items():
        parent = mapping.pairs.get(norm.rpartition(".")[0], norm.rpartition(".")[0])
        for linear in linears.split(", "):
            parts = linear.split(".")
            found |= {".".join(parts[:n]) for n in range(len(parent.split(".")) + 1, len(parts) + 1)}
    return found


def _activation_row(section: str, ms: WholeEntry, mg: WholeEntry, mode: str, thresholds: Thresholds,
                    permutation: np.ndarray | None, pre_norm: bool) -> Row:
    """Forward: outputs, and the first input as the check that the module got the same input. Backward: msprobe's
    backward record holds the gradient of the outputs as "input" (the incoming gradient) and that of the inputs as
    "output" (the outgoing one)."""
    # backward: only the gradient of the first input (the hidden state); the other inputs differ by framework
    count = min(len(ms.outputs), len(mg.outputs), 1 if section == "backward" else len(ms.outputs))
    worst: tuple | None = None
    for index in range(count):
        perm = permutation if (index == 0 and section == "forward") else None
        result = compare_records(ms.outputs[index], mg.outputs[index], mode, thresholds, perm)
        if index and result[1] == "shape differs":
            continue  # an extra output one framework returns (token ids, a bias): not the same tensor
        if worst is None or _severity(result) > _severity(worst):
            worst = (*result, index)
    input_status = "-"
    if ms.inputs and mg.inputs:
        if section == "forward" and pre_norm:
            input_status = "not comparable"
        else:
            perm = permutation if section == "backward" else None
            incoming = compare_records(ms.inputs[0], mg.inputs[0], mode, thresholds, perm)
            input_status = incoming[1]
            if section == "backward" and pre_norm:
                basis, status, metrics, verdict, shape = incoming
                return Row(section, ms.key, mg.key, tuple(shape), basis, metrics, verdict, status, "-",
                           "the incoming gradient: the outgoing one is taken before the norm Megatron fuses in")
    if worst is None:
        return Row(section, ms.key, mg.key, None, "-", {}, "", "not compared", input_status, "no output tensor")
    basis, status, metrics, verdict, shape, index = worst
    return Row(section, ms.key, mg.key, tuple(shape) if shape is not None else None, basis, metrics, verdict,
               status, input_status, f"output {index}" if index else "")


def _severity(result: tuple) -> int:
    return {"differs": 2, "shape differs": 2, "ok": 1}.get(result[1], 0)


def compare_msprobe_dumps(npu: WholeDump, gpu: WholeDump, mapping: ModuleMapping, model: ModelConfig,
                          core_version: str, precision: PrecisionChoice) -> MsprobeDiagnosis:
    """The full comparison (see the module text). ``npu``: MindSpore side, ``gpu``: Megatron side; the causes
    offered are those that fit the evidence (``causes.Evidence``) and the Megatron side's layout."""
    thresholds = precision.thresholds
    if npu.mode != gpu.mode:
        raise MsprobeDumpError(f"{npu.path} holds {npu.mode} and {gpu.path} {gpu.mode}: dump both sides with one "
                               f"task")
    mode = npu.mode
    rows: list[Row] = []
    notes = list(npu.notes) + list(gpu.notes)
    plan = conversion_plan(model, core_version, "per_expert")
    te_names = local_to_te_names(model, core_version)
    weight_rows, weight_notes = _rule_rows("weights", plan, _parameter_records(npu, "forward"),
                                           _parameter_records(gpu, "forward", te_names), mode, thresholds)
    rows += weight_rows
    notes += weight_notes
    mg_index = _module_index(gpu)
    mapping = with_unfused_norms(mapping, gpu)
    pre_norm = pre_norm_modules(mapping)
    call_pairs = pair_calls(npu, gpu, mapping)
    mapped: dict[tuple[str, str], None] = {}
    unmapped_ms: dict[str, None] = {}
    used_mg: set[str] = set()
    for section in ("forward", "backward"):
        for entry in npu.entries.values():
            if entry.direction != section:
                continue
            if not entry.is_module:
                unmapped_ms[f"{entry.key} (an API call at level mix: pair APIs with msprobe's own api_mapping)"] = None
                continue
            mg_name = mapping.megatron_name(entry.name)
            if mg_name is None:
                reason = ("its norm is fused into " + mapping.fused[entry.name] if entry.name in mapping.fused
                          else mapping.unpaired.get(f"mindspore:{entry.name}", "no Megatron module computes it"))
                unmapped_ms[f"{entry.name} ({reason})"] = None
                continue
            mg_entry = mg_index.get((mg_name, section, call_pairs.get((entry.name, section, entry.index),
                                                                     entry.index)))
            if mg_entry is None:
                unmapped_ms[f"{entry.key} (Megatron {mg_name} has no {section} call {entry.index} in the dump)"] = None
                continue
            mapped[(entry.name, mg_name)] = None
            used_mg.add(mg_name)
            rows.append(_activation_row(section, entry, mg_entry, mode, thresholds,
                                        mapping.output_permutations.get(entry.name), mg_name in pre_norm))
    grad_rows, _ = _rule_rows("weight gradients", plan, _parameter_records(npu, "parameters_grad"),
                              _parameter_records(gpu, "parameters_grad", te_names), mode, thresholds)
    rows += grad_rows
    unmapped_mg = sorted({(f"{e.name} ({'its norm is fused into the linear after it' if e.name.endswith('layernorm') else mapping.unpaired.get('megatron:' + e.name, 'no MindSpore cell computes it')})" if e.is_module else f"{e.key} (an API call at level mix)")
                          for e in gpu.entries.values()
                          if e.direction in ("forward", "backward") and (not e.is_module or e.name not in used_mg)})
    first: dict[str, Row | None] = {}
    for section in SECTIONS:
        candidates = [r for r in rows if r.section == section]
        first[section] = next((r for r in candidates if r.differs and r.input_status != "differs"), None) \
            or next((r for r in candidates if r.differs), None)
    causes: list[KnownCause] = []
    evidence, ruled_out = None, ""
    top = next((first[s] for s in SECTIONS if first.get(s) is not None), None)
    if top is not None:
        name = top.megatron.split(", ")[0]
        module = name.rpartition(".")[0] if top.section in ("weights", "weight gradients") else _module_of_key(name)
        evidence, ruled_out = _evidence(top, module, rows, plan, npu, gpu)
        causes = explain(name if evidence.kind == GRADIENT else module, model,
                         (gpu.layout.tensor, gpu.layout.pipeline, gpu.layout.expert), evidence)
    if mode == "md5":
        notes.append("md5 dumps tell bit-identical tensors from the rest: two frameworks rarely compute bit-identical "
                     "activations, so the first module that differs is the first one not bit-identical (a tensor "
                     "dump tells rounding from error)")
    if mode == "statistics":
        notes.append("statistics dumps: a weight re-laid-out in the wrong order keeps its Max/Min/Mean/Norm; such "
                     "faults show in the activations, or at their weight in md5 or tensor dumps")
    return MsprobeDiagnosis(rows, first, causes, list(mapped), sorted(unmapped_ms), unmapped_mg, notes, mode,
                            npu.step, precision, evidence, ruled_out)


EXACT = ("tensor", "md5")  # bases that see a weight's every element (statistics miss a permutation)


def _evidence(top: Row, module: str, rows: list[Row], plan, npu: WholeDump, gpu: WholeDump) -> tuple[Evidence, str]:
    """What the first divergence ``top`` (at ``module``) shows, and why the conversion is ruled out where it is."""
    kind = {"weights": WEIGHT, "forward": FORWARD, "backward": BACKWARD, "weight gradients": GRADIENT}[top.section]
    parallel = any(side.layout.tensor > 1 or side.layout.expert > 1 for side in (npu, gpu))
    weights = [r for r in rows if r.section == "weights" and r.status != "not compared"]
    if kind in (BACKWARD, GRADIENT):
        forward = sum(r.status == "ok" for r in rows if r.section == "forward")
        backward = sum(r.status == "ok" for r in rows if r.section == "backward")
        computed = f"{forward} forward outputs" + (f" and {backward} backward gradients" if kind == GRADIENT else "")
        why = (f"the conversion is ruled out: the {len(weights)} weights compared agree, and so do the {computed} "
               f"computed with them" if weights else
               f"the conversion is ruled out: the {computed} computed with the converted weights agree")
        return Evidence(kind, weights_agree=True, parallel=parallel), why
    # every weight the conversion writes into the module, each held side by side exactly and agreeing
    own = [key for placed in plan for key in placed.target_keys if key.startswith(module + ".")]
    exact = {label for r in rows if r.section == "weights" and r.status == "ok" and r.basis in EXACT
             for label in r.megatron.split(", ")}
    if kind == FORWARD and own and all(key in exact for key in own):
        return Evidence(kind, weights_agree=True, parallel=parallel), (
            f"the conversion is ruled out at {module}: its {len(own)} weights agree, compared element by element")
    return Evidence(kind, parallel=parallel), ""


def _module_of_key(key: str) -> str:
    """``Module.decoder.layers.0.mlp.MLP.forward.0`` -> ``decoder.layers.0.mlp``."""
    parts = key.split(".")
    return ".".join(parts[1:-3])
