"""The mapping files msprobe's own compare takes for a MindSpore dump against a PyTorch one, from crossalign's pairs,
for every pair of rank folders that compare takes.

``msprobe -f mindspore compare -tp NPU/dump.json -gp BENCH/dump.json -o OUT -dm data_mapping.yaml`` (or ``-lm
layer_mapping.yaml``) pairs the two dumps' tensors by name. msprobe names a tensor (msprobe/core/compare/utils.py:
112-127 ``read_op`` and 130-189 ``op_item_parse``, the suffixes of const.py:850-856 ``IO_NAME_MAPPING``) as
``<entry key>.input.<i>``, ``<entry key>.output.<i>``, ``<entry key>.parameters.<name>``, and a weight gradient as
``<parameters_grad key>.<name>``. ``data_mapping.yaml`` maps the NPU side's names to the bench side's
(acc_compare.py:738-740 and 854-855, ``process_data_mapping``). ``layer_mapping.yaml`` maps, under the class of a
MindSpore cell (``TopLayer`` for the root), each child cell's name to the PyTorch child's name where they differ
(layer_mapping/layer_mapping.py:89-118 ``convert_scope``, 151-183 ``preprocess_layer_mapping``).

Which rank folders msprobe compares: given two step folders, its distributed compare sorts each side's
``rank{R}`` folders by rank and pairs them in that order, and refuses two sides with different numbers of rank
folders (msprobe/core/compare/utils.py:912-930 ``get_sorted_ranks``, 1003-1023 ``compare_distributed_inner``), one
``-dm``/``-lm`` file serving every pair. Sides with different numbers of ranks are compared one dump.json against
another; every such pair of ranks that holds a tensor in common is written. Each pair's files lie in
``msprobe_compare/npu_<folder>-gpu_<folder>/``; the top-level ``data_mapping.yaml`` and ``layer_mapping.yaml`` are the
pairs' files merged, the one file msprobe's distributed compare takes (a name two pairs would map differently is
left out of it, and said).

Only tensors msprobe can hold side by side are mapped: on that pair of ranks the same tensor (each rank holds the
whole of it, or both hold the same shard of a tensor split the same way), same meaning and same element order. Left
out: the inputs of a linear whose norm Megatron fuses into it (before vs after the norm), the outputs of a linear
whose rule reorders its rows (SwiGLU fc1 de-interleave), weights that a rule re-lays out (only renamed ones are
mapped), activations that are not merged over the ranks (the routed experts' at EP > 1), and tensors msprobe
cannot hold side by side for their shapes (megatron-core's GDN ``out_norm`` runs on ``[tokens x heads, dim]``, the
MindSpore cell on ``[b, s, heads, dim]``; crossalign's own comparison flattens both)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from crossalign.checkpoint.rules import Rename
from crossalign.diagnose.mapping import ModuleMapping
from crossalign.diagnose.msprobe_dump import RankDump, StepDump
from crossalign.diagnose.msprobe_match import pair_calls, pre_norm_modules
from crossalign.diagnose.msprobe_shards import WholeDump, WholeEntry, WholeRecord

LAYER_MAPPING = "layer_mapping.yaml"
DATA_MAPPING = "data_mapping.yaml"
PAIRS_DIR = "msprobe_compare"


def _pairs(npu: WholeDump, gpu: WholeDump, mapping: ModuleMapping, ranks: tuple[int, int]):
    """(MindSpore entry, Megatron entry) of every paired module call held by the rank pair ``ranks`` (npu rank, gpu
    rank), forward, backward and parameters_grad, each call of a module called several times paired as the
    comparison pairs it (``msprobe_match.pair_calls``)."""
    index = {(e.name, e.direction, e.index): e for e in gpu.entries.values() if e.is_module}
    calls = pair_calls(npu, gpu, mapping)
    for entry in npu.entries.values():
        if not entry.is_module or ranks[0] not in entry.raw_keys:
            continue
        mg_name = mapping.megatron_name(entry.name)
        call = calls.get((entry.name, entry.direction, entry.index), entry.index)
        other = index.get((mg_name, entry.direction, call)) if mg_name is not None else None
        if other is not None and ranks[1] in other.raw_keys:
            yield entry, other


def renamed_parameters(plan) -> dict[str, str]:
    """MindSpore parameter -> Megatron parameter (full names) of every rule that only renames (``Rename``)."""
    return {placed.source_keys[0]: placed.target_keys[0] for placed in plan if type(placed.rule) is Rename}


def _parameter_pairs(ms: WholeEntry, mg: WholeEntry, renamed: dict[str, str]) -> dict[str, str]:
    pairs = {}
    for pname in ms.parameters:
        target = renamed.get(f"{ms.name}.{pname}" if ms.name else pname)
        if target is not None and target.rpartition(".")[0] == mg.name and target.rpartition(".")[2] in mg.parameters:
            pairs[pname] = target.rpartition(".")[2]
    return pairs


def _held_alike(ms: WholeEntry, ms_record: WholeRecord, npu_rank: int, mg: WholeEntry, mg_record: WholeRecord,
                 gpu_rank: int) -> bool:
    """Whether rank ``npu_rank``'s record and rank ``gpu_rank``'s are the same tensor: each the whole of it, or the
    same shard of a tensor both sides split alike."""
    if ms_record.summed or mg_record.summed:
        return False  # partial sums of a gradient
    if len(ms_record.parts) == 1 and len(mg_record.parts) == 1:
        shapes = ms_record.parts[0].shape, mg_record.parts[0].shape
    elif (len(ms_record.parts) == len(mg_record.parts) and ms_record.dim == mg_record.dim
          and ms_record.segments == mg_record.segments == (1,) and ms.shards[npu_rank] == mg.shards[gpu_rank]):
        shapes = ms_record.parts[ms.shards[npu_rank]].shape, mg_record.parts[mg.shards[gpu_rank]].shape
    else:
        return False
    # msprobe compares equal shapes, size-1 axes aside ([1, s, h] against [s, 1, h]); not a flattened one
    return [n for n in shapes[0] if n != 1] == [n for n in shapes[1] if n != 1]


def compare_names(dump: RankDump) -> dict[str, str]:
    """The name msprobe's compare matches each of a rank's module entries by: a backward call renumbered by its
    order among that module's backward calls in dump.json (msprobe/core/compare/acc_compare.py:413-418 counts
    ``backward_call_order``, 597-636 ``update_backward_call`` renames the call), any other entry as written."""
    seen: dict[str, int] = {}
    names = {}
    for key, entry in dump.entries.items():
        if entry.is_module and entry.direction == "backward":
            head = key.rsplit(".", 2)[0]
            names[key] = f"{head}.backward.{seen.get(head, 0)}"
            seen[head] = seen.get(head, 0) + 1
    return names


def data_mapping(npu: WholeDump, gpu: WholeDump, mapping: ModuleMapping, plan, ranks: tuple[int, int],
                 bench_names: dict[str, str]) -> dict[str, str]:
    """NPU tensor name -> bench tensor name for msprobe's ``-dm``, on the rank pair ``ranks`` (npu rank, gpu rank);
    ``plan``: the conversion rules; ``bench_names``: the bench rank's :func:`compare_names`."""
    renamed = renamed_parameters(plan)
    pre_norm = pre_norm_modules(mapping)
    n, b = ranks
    result: dict[str, str] = {}
    for ms, mg in _pairs(npu, gpu, mapping, ranks):
        ms_key = ms.raw_keys[n]
        mg_key = bench_names.get(mg.raw_keys[b], mg.raw_keys[b])

        def alike(ms_record: WholeRecord, mg_record: WholeRecord) -> bool:
            return _held_alike(ms, ms_record, n, mg, mg_record, b)

        reordered = ms.name in mapping.output_permutations
        before_norm = mg.name in pre_norm
        parameters = {pname: qname for pname, qname in _parameter_pairs(ms, mg, renamed).items()
                      if alike(ms.parameters[pname], mg.parameters[qname])}
        if ms.direction == "parameters_grad":
            result.update({f"{ms_key}.{pname}": f"{mg_key}.{qname}" for pname, qname in parameters.items()})
            continue
        outputs = [i for i in range(min(len(ms.outputs), len(mg.outputs))) if alike(ms.outputs[i], mg.outputs[i])]
        first_input = bool(ms.inputs and mg.inputs) and alike(ms.inputs[0], mg.inputs[0])
        if ms.direction == "forward":
            if not reordered:
                result.update({f"{ms_key}.output.{i}": f"{mg_key}.output.{i}" for i in outputs})
            if first_input and not before_norm:
                result[f"{ms_key}.input.0"] = f"{mg_key}.input.0"
            result.update({f"{ms_key}.parameters.{pname}": f"{mg_key}.parameters.{qname}"
                           for pname, qname in parameters.items()})
        else:  # backward: input holds the gradient of the outputs, output that of the inputs
            if first_input and not reordered:
                result[f"{ms_key}.input.0"] = f"{mg_key}.input.0"
            if not before_norm:
                result.update({f"{ms_key}.output.{i}": f"{mg_key}.output.{i}" for i in outputs})
    return result


def _local_name(raw_key: str) -> str:
    """A module's name as msprobe wrote it, less the kind, class, direction and call index."""
    return ".".join(raw_key.split(".")[1:-3])


def layer_mapping(npu: WholeDump, gpu: WholeDump, mapping: ModuleMapping,
                  ranks: tuple[int, int]) -> dict[str, dict[str, str]]:
    """``{MindSpore class: {child cell: PyTorch child}}`` for msprobe's ``-lm``, where the names differ, on the rank
    pair ``ranks`` (npu rank, gpu rank), under the names the ranks use (their stage's layers numbered from 0). A
    child that would map to two names is left out."""
    classes: dict[str, str] = {}
    pairs: dict[str, str] = {}
    for ms, mg in _pairs(npu, gpu, mapping, ranks):
        ms_local = _local_name(ms.raw_keys[ranks[0]])
        classes[ms_local] = ms.cls
        pairs[ms_local] = _local_name(mg.raw_keys[ranks[1]])
    result: dict[str, dict[str, str]] = {}
    clashes: set[tuple[str, str]] = set()
    for ms_name, mg_name in pairs.items():
        ms_parts, mg_parts = ms_name.split("."), mg_name.split(".")
        if len(mg_parts) < len(ms_parts):
            continue
        wrapper = mg_parts[: len(mg_parts) - len(ms_parts)]  # Megatron's "module.module." above the model's names
        if wrapper:
            owner = result.setdefault("TopLayer", {})
            top = ".".join(wrapper + [mg_parts[len(wrapper)]])
            if owner.setdefault(ms_parts[0], top) != top:
                clashes.add(("TopLayer", ms_parts[0]))
        for level, (mine, theirs) in enumerate(zip(ms_parts, mg_parts[len(wrapper):])):
            if mine == theirs or (level == 0 and wrapper):
                continue
            parent = ".".join(ms_parts[:level])
            owner_class = classes.get(parent) if parent else "TopLayer"
            if owner_class is None:
                continue  # a container msprobe recorded no call of (a cell list): its class is not known here
            if result.setdefault(owner_class, {}).setdefault(mine, theirs) != theirs:
                clashes.add((owner_class, mine))
    for owner_class, child in clashes:
        result[owner_class].pop(child, None)
    return {owner: children for owner, children in result.items() if children}


def write_yaml(path: Path, content: dict) -> Path:
    path.write_text(yaml.safe_dump(content, sort_keys=False, allow_unicode=True))
    return path


def rank_pairs(npu_step: StepDump, gpu_step: StepDump, npu: WholeDump, gpu: WholeDump,
               mapping: ModuleMapping) -> list[tuple[int, int]]:
    """The (npu rank, gpu rank) pairs msprobe's compare takes: the sorted rank folders zipped where both sides have
    as many; otherwise every pair of ranks that hold a paired module call in common."""
    npu_ranks, gpu_ranks = sorted(npu_step.ranks), sorted(gpu_step.ranks)
    if len(npu_ranks) == len(gpu_ranks):
        return list(zip(npu_ranks, gpu_ranks))
    return [(n, b) for n in npu_ranks for b in gpu_ranks if next(_pairs(npu, gpu, mapping, (n, b)), None)]


@dataclass
class Mappings:
    """What was written for msprobe's compare: the files (relative to the report folder) and the rank pairs."""

    pairs: list[tuple[str, str, str]]  # (npu folder, gpu folder, the pair's folder)
    distributed: bool  # msprobe's distributed compare takes the two step folders with the top-level files
    files: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)  # names two pairs map differently

    def as_dict(self) -> dict:
        return {"rank_pairs": [{"npu": n, "gpu": g, "files": folder} for n, g, folder in self.pairs],
                "distributed": self.distributed, "left_out_of_the_merged_files": self.left_out}


def _merged(parts: list[dict], left_out: list[str], nested: bool = False) -> dict:
    merged: dict = {}
    clashes: set = set()
    for part in parts:
        for key, value in part.items():
            if nested:
                inner = merged.setdefault(key, {})
                for child, name in value.items():
                    if inner.setdefault(child, name) != name:
                        clashes.add((key, child))
            elif merged.setdefault(key, value) != value:
                clashes.add(key)
    for clash in sorted(clashes):
        if nested:
            merged[clash[0]].pop(clash[1], None)
            left_out.append(f"{clash[0]}: {clash[1]}")
        else:
            merged.pop(clash)
            left_out.append(clash)
    return merged


def write_mappings(folder: Path, npu_step: StepDump, gpu_step: StepDump, npu: WholeDump, gpu: WholeDump,
                   mapping: ModuleMapping, plan) -> Mappings:
    """Each rank pair's ``data_mapping.yaml`` and ``layer_mapping.yaml`` and the merged top-level ones, in ``folder``."""
    pairs = rank_pairs(npu_step, gpu_step, npu, gpu, mapping)
    written = Mappings([], len(npu_step.ranks) == len(gpu_step.ranks))
    data_parts, layer_parts = [], []
    for n, b in pairs:
        name = f"{PAIRS_DIR}/npu_{npu_step.ranks[n].path.name}-gpu_{gpu_step.ranks[b].path.name}"
        (folder / name).mkdir(parents=True)
        data_parts.append(data_mapping(npu, gpu, mapping, plan, (n, b), compare_names(gpu_step.ranks[b])))
        layer_parts.append(layer_mapping(npu, gpu, mapping, (n, b)))
        write_yaml(folder / name / DATA_MAPPING, data_parts[-1])
        write_yaml(folder / name / LAYER_MAPPING, layer_parts[-1])
        written.pairs.append((npu_step.ranks[n].path.name, gpu_step.ranks[b].path.name, name))
    write_yaml(folder / DATA_MAPPING, _merged(data_parts, written.left_out))
    write_yaml(folder / LAYER_MAPPING, _merged(layer_parts, written.left_out, nested=True))
    written.files = [LAYER_MAPPING, DATA_MAPPING, PAIRS_DIR]
    return written
