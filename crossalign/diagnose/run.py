"""The layer-by-layer diagnosis: dump both reference models for one batch, compare module by module, report.

The MindSpore model runs the MindFormers checkpoint (strict load: it is the reference), the
PyTorch model runs the converted Megatron checkpoint loaded the way Megatron loads it:
strictly if it can, otherwise what fits is loaded and the rest keeps its initial values,
exactly what a training run would then use. The load problems head the report, and the
numbers still show where the model first goes wrong.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from crossalign.config import AlignmentConfig, ModelConfig
from crossalign.diagnose.compare import Diagnosis, Thresholds, compare_dumps
from crossalign.diagnose.dump import DEFAULT_MAX_TENSOR_BYTES, read_dump
from crossalign.diagnose.hooks import install_mindspore_dump_hooks, install_torch_dump_hooks
from crossalign.diagnose.mapping import module_mapping
from crossalign.diagnose.report import write_csv, write_html
from crossalign.diagnose.sides import Batch, build_megatron, build_mindspore, make_batch, run_megatron, run_mindspore

MINDSPORE_DUMP = "mindspore"
MEGATRON_DUMP = "megatron"
CSV_NAME = "diagnosis.csv"
HTML_NAME = "diagnosis.html"
SUMMARY_NAME = "summary.json"


@dataclass
class DiagnoseResult:
    diagnosis: Diagnosis
    out_dir: Path
    csv: Path
    html: Path
    summary: Path


def _json_number(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else value


def write_reports(diagnosis: Diagnosis, out_dir: Path, title: str) -> DiagnoseResult:
    """CSV, HTML and summary.json (first divergence, hint, load problems) into ``out_dir``."""
    out_dir = Path(out_dir)
    first = diagnosis.first_divergence
    summary = {
        "diverged": diagnosis.diverged,
        "first_divergence": None if first is None else {
            "mindspore": first.mindspore, "megatron": first.megatron, "cosine": _json_number(first.cosine),
            "max_abs": _json_number(first.max_abs), "max_rel": _json_number(first.max_rel)},
        "causes": [{"cause": c.cause, "check": c.check, "faults": list(c.faults)} for c in diagnosis.causes],
        "hint": diagnosis.hint(),
        "load_problems": diagnosis.load_problems,
        "compared": len(diagnosis.rows),
        "not_compared": diagnosis.not_compared,
    }
    csv_path = write_csv(diagnosis, out_dir / CSV_NAME)
    html_path = write_html(diagnosis, out_dir / HTML_NAME, title)
    summary_path = out_dir / SUMMARY_NAME
    tmp = summary_path.with_name(f".{SUMMARY_NAME}.tmp")
    tmp.write_text(json.dumps(summary, indent=1))
    tmp.replace(summary_path)
    return DiagnoseResult(diagnosis, out_dir, csv_path, html_path, summary_path)


def compare_dump_folders(mindspore_dir: Path, megatron_dir: Path, model: ModelConfig, core_version: str,
                         precision: str = "fp32", load_problems: list[str] | None = None) -> Diagnosis:
    """Compare two dump folders (ours or written by hooks in the real frameworks) for ``model``."""
    return compare_dumps(read_dump(mindspore_dir), read_dump(megatron_dir), module_mapping(model, core_version),
                         model, Thresholds.for_precision(precision), load_problems)


def dump_mindspore(model: ModelConfig, state: Mapping[str, Any], batch: Batch, folder: Path, *,
                   save_tensors: bool = True, max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
                   meta: dict[str, Any] | None = None) -> Path:
    """Run the MindSpore model on ``state`` (strict load) for ``batch`` with dump hooks; returns the dump folder."""
    net = build_mindspore(model, state)
    session = install_mindspore_dump_hooks(net, folder, save_tensors=save_tensors, max_tensor_bytes=max_tensor_bytes,
                                           meta=meta)
    run_mindspore(net, batch)
    return session.close()


def dump_megatron(model: ModelConfig, state: Mapping[str, Any], batch: Batch, folder: Path, core_version: str, *,
                  save_tensors: bool = True, max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
                  meta: dict[str, Any] | None = None) -> tuple[Path, list[str]]:
    """Run the PyTorch model on ``state`` loaded as Megatron would (lenient) with dump hooks.

    Returns the dump folder and the load problems (empty when the state loads strictly).
    """
    net, load_problems = build_megatron(model, state, core_version, strict=False)
    session = install_torch_dump_hooks(net, folder, save_tensors=save_tensors, max_tensor_bytes=max_tensor_bytes,
                                       meta={**(meta or {}), "load_problems": load_problems})
    run_megatron(net, batch)
    return session.close(), load_problems


def diagnose(config: AlignmentConfig, ms_ckpt: Path, mg_ckpt: Path, out_dir: Path, *, seq: int | None = None,
             batch: int | None = None, data: Path | None = None, seed: int = 1234, save_tensors: bool = True,
             max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
             on_stage: Callable[[str], None] | None = None) -> DiagnoseResult:
    """Dump both sides for the same batch into ``out_dir``, compare them and write the reports there."""
    from crossalign.checkpoint.megatron import read_megatron_checkpoint
    from crossalign.checkpoint.mindformers import read_mindformers_checkpoint

    stage = on_stage or (lambda name: None)
    model, core_version = config.model, config.training.megatron_core_version
    out_dir = Path(out_dir)
    the_batch = make_batch(config, seq, batch, data, seed)
    meta = {"config": model.name, "batch": list(the_batch.shape), "batch_source": the_batch.source}
    options = dict(save_tensors=save_tensors, max_tensor_bytes=max_tensor_bytes)

    stage("MindSpore forward with dump hooks")
    dump_mindspore(model, read_mindformers_checkpoint(Path(ms_ckpt)).model_state(), the_batch,
                   out_dir / MINDSPORE_DUMP, meta={**meta, "checkpoint": str(ms_ckpt)}, **options)
    stage("PyTorch forward with dump hooks")
    _, load_problems = dump_megatron(model, read_megatron_checkpoint(Path(mg_ckpt), model, core_version).state,
                                     the_batch,
                                     out_dir / MEGATRON_DUMP, core_version,
                                     meta={**meta, "checkpoint": str(mg_ckpt)}, **options)
    stage("comparing")
    diagnosis = compare_dump_folders(out_dir / MINDSPORE_DUMP, out_dir / MEGATRON_DUMP, model, core_version,
                                     "fp32", load_problems)
    return write_reports(diagnosis, out_dir, f"crossalign diagnose: {model.name}")
