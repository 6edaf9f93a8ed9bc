"""The mapping files msprobe's own compare takes for a MindSpore dump against a PyTorch one, from crossalign's pairs.

``msprobe -f mindspore compare -tp NPU/dump.json -gp BENCH/dump.json -o OUT -dm data_mapping.yaml`` (or ``-lm
layer_mapping.yaml``) pairs the two dumps' tensors by name. msprobe names a tensor (msprobe/core/compare/utils.py:
112-127 ``read_op`` and 130-189 ``op_item_parse``, the suffixes of const.py:850-856 ``IO_NAME_MAPPING``) as
``<entry key>.input.<i>``, ``<entry key>.output.<i>``, ``<entry key>.parameters.<name>``, and a weight gradient as
``<parameters_grad key>.<name>``. ``data_mapping.yaml`` maps the NPU side's names to the bench side's
(acc_compare.py:738-740 and 854-855, ``process_data_mapping``). ``layer_mapping.yaml`` maps, under the class of a
MindSpore cell (``TopLayer`` for the root), each child cell's name to the PyTorch child's name where they differ
(layer_mapping/layer_mapping.py:89-118 ``convert_scope``, 151-183 ``preprocess_layer_mapping``).

Only tensors msprobe can hold side by side are mapped: same meaning and same element order. Left out: the inputs of
a linear whose norm Megatron fuses into it (before vs after the norm), the outputs of a linear whose rule reorders
its rows (SwiGLU fc1 de-interleave), and weights that a rule re-lays out (only renamed ones are mapped). The names
are those of the rank folders, so the files serve dumps of the same layout on both sides.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from crossalign.checkpoint.rules import Rename
from crossalign.diagnose.mapping import ModuleMapping
from crossalign.diagnose.msprobe_match import pre_norm_modules
from crossalign.diagnose.msprobe_shards import WholeDump, WholeEntry


def _pairs(npu: WholeDump, gpu: WholeDump, mapping: ModuleMapping):
    """(MindSpore entry, Megatron entry) of every paired module call, forward, backward and parameters_grad."""
    index = {(e.name, e.direction, e.index): e for e in gpu.entries.values() if e.is_module}
    for entry in npu.entries.values():
        if not entry.is_module:
            continue
        mg_name = mapping.megatron_name(entry.name)
        other = index.get((mg_name, entry.direction, entry.index)) if mg_name is not None else None
        if other is not None:
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


def data_mapping(npu: WholeDump, gpu: WholeDump, mapping: ModuleMapping, plan) -> dict[str, str]:
    """NPU tensor name -> bench tensor name for msprobe's ``-dm``; ``plan``: the conversion rules."""
    renamed = renamed_parameters(plan)
    pre_norm = pre_norm_modules(mapping)
    result: dict[str, str] = {}
    for ms, mg in _pairs(npu, gpu, mapping):
        reordered = ms.name in mapping.output_permutations
        before_norm = mg.name in pre_norm
        if ms.direction == "parameters_grad":
            for pname, qname in _parameter_pairs(ms, mg, renamed).items():
                result[f"{ms.raw_key}.{pname}"] = f"{mg.raw_key}.{qname}"
            continue
        if ms.direction == "forward":
            if not reordered:
                for i in range(min(len(ms.outputs), len(mg.outputs))):
                    result[f"{ms.raw_key}.output.{i}"] = f"{mg.raw_key}.output.{i}"
            if ms.inputs and mg.inputs and not before_norm:
                result[f"{ms.raw_key}.input.0"] = f"{mg.raw_key}.input.0"
            for pname, qname in _parameter_pairs(ms, mg, renamed).items():
                result[f"{ms.raw_key}.parameters.{pname}"] = f"{mg.raw_key}.parameters.{qname}"
        else:  # backward: input holds the gradient of the outputs, output that of the inputs
            if ms.inputs and mg.inputs and not reordered:
                result[f"{ms.raw_key}.input.0"] = f"{mg.raw_key}.input.0"
            if not before_norm:
                for i in range(min(len(ms.outputs), len(mg.outputs))):
                    result[f"{ms.raw_key}.output.{i}"] = f"{mg.raw_key}.output.{i}"
    return result


def layer_mapping(npu: WholeDump, gpu: WholeDump, mapping: ModuleMapping) -> dict[str, dict[str, str]]:
    """``{MindSpore class: {child cell: PyTorch child}}`` for msprobe's ``-lm``, where the names differ."""
    classes = {e.name: e.cls for e in npu.entries.values() if e.is_module}
    result: dict[str, dict[str, str]] = {}
    wrapper = _wrapper_prefix(gpu)  # Megatron's "module.module." (DDP, Float16Module) above the model's own names
    if wrapper:
        tops = {ms.split(".")[0]: mg.split(".")[0] for ms, mg in mapping.pairs.items()}
        result["TopLayer"] = {mine: wrapper + theirs for mine, theirs in sorted(tops.items())}
    for ms_name, mg_name in mapping.pairs.items():
        ms_parts, mg_parts = ms_name.split("."), mg_name.split(".")
        if len(ms_parts) != len(mg_parts) or ms_name not in classes:
            continue
        for level, (mine, theirs) in enumerate(zip(ms_parts, mg_parts)):
            if mine == theirs:
                continue
            parent = ".".join(ms_parts[:level])
            owner = classes.get(parent, "TopLayer") if parent else "TopLayer"
            result.setdefault(owner, {})[mine] = theirs
    return result


def _wrapper_prefix(dump: WholeDump) -> str:
    """What msprobe's names hold above the model's own module names (the wrappers and the model-chunk index)."""
    for entry in dump.entries.values():
        if entry.is_module and entry.name and entry.raw_key:
            raw = ".".join(entry.raw_key.split(".")[1:-3])
            if raw.endswith(entry.name):
                return raw[: len(raw) - len(entry.name)]
    return ""


def write_yaml(path: Path, content: dict) -> Path:
    path.write_text(yaml.safe_dump(content, sort_keys=False, allow_unicode=True))
    return path

