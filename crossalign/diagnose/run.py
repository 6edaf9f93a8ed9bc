"""The layer-by-layer diagnosis: dump both reference models for one batch, compare module by module, report.

The MindSpore model runs the MindFormers checkpoint (strict load: it is the reference), the
PyTorch model runs the converted Megatron checkpoint loaded the way Megatron loads it:
strictly if it can, otherwise what fits is loaded and the rest keeps its initial values,
exactly what a training run would then use. A sharded checkpoint is merged from its ranks,
each loaded as that rank would load its file (``ranks``). The load problems head the report,
and the numbers still show where the model first goes wrong. Without a converted checkpoint
the conversion is made here, into any (tp, pp, ep) layout and optionally with a known fault,
as the self-check makes it (``selfcheck.make_checkpoints``).
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from crossalign.config import AlignmentConfig, ModelConfig
from crossalign.diagnose.compare import Diagnosis, Thresholds, compare_dumps
from crossalign.diagnose.dump import DEFAULT_MAX_TENSOR_BYTES, read_dump
from crossalign.diagnose.hooks import install_mindspore_dump_hooks, install_torch_dump_hooks
from crossalign.diagnose.mapping import module_mapping
from crossalign.diagnose.ranks import LoadedMegatron, read_as_megatron_loads
from crossalign.diagnose.report import write_csv, write_html
from crossalign.diagnose.references import (Batch, SideError, build_megatron, build_mindspore, make_batch, run_megatron,
                                       run_mindspore)

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
        "megatron_layout": None if diagnosis.layout is None else dict(zip(("tp", "pp", "ep"), diagnosis.layout)),
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
                         precision: str = "fp32", load_problems: list[str] | None = None,
                         layout: tuple[int, int, int] | None = None) -> Diagnosis:
    """Compare two dump folders (ours or written by hooks in the real frameworks) for ``model``; ``layout``: the
    (tp, pp, ep) of the Megatron checkpoint the dump ran, when known."""
    return compare_dumps(read_dump(mindspore_dir), read_dump(megatron_dir), module_mapping(model, core_version),
                         model, Thresholds.for_precision(precision), load_problems, layout)


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


def _check_layout(asked: tuple[int, int, int] | None, loaded: LoadedMegatron, checkpoint: Path) -> None:
    """A layout asked for (--tp/--pp/--ep) with a given checkpoint must be the one its rank folders hold."""
    if asked is None or asked == loaded.layout:
        return
    if loaded.format == "torch_dist":
        raise SideError(f"{checkpoint} is a torch_dist checkpoint: it holds the model once, not per rank (Megatron "
                        f"reshards it at load), so it has no (tp, pp, ep) = {asked}; drop --tp/--pp/--ep")
    raise SideError(f"{checkpoint} holds (tp, pp, ep) = {loaded.layout} ranks, not the {asked} asked for")


def diagnose(config: AlignmentConfig, ms_ckpt: Path | None, mg_ckpt: Path | None, out_dir: Path, *,
             fault: str | None = None, layout: tuple[int, int, int] | None = None, seq: int | None = None,
             batch: int | None = None, data: Path | None = None, seed: int = 1234, save_tensors: bool = True,
             max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
             on_stage: Callable[[str], None] | None = None) -> DiagnoseResult:
    """Dump both sides for the same batch into ``out_dir``, compare them and write the reports there.

    ms_ckpt and mg_ckpt: a MindFormers checkpoint and its conversion, in any legacy Megatron layout or torch_dist.
    With ms_ckpt alone it is converted here, with neither a random model of the config (seeded) is written and
    converted, both as the self-check does: into ``layout`` (tp, pp, ep; default one rank), with ``fault``
    (``faults.FAULTS`` or ``faults.LAYOUT_FAULTS``) injected when named. ``layout`` with mg_ckpt: the layout the
    checkpoint must hold.
    """
    from crossalign.checkpoint.faults import FAULTS, LAYOUT_FAULTS
    from crossalign.sides.mindformers.checkpoint import read_mindformers_checkpoint
    from crossalign.diagnose.selfcheck import check_sources, converted_here, make_checkpoints

    check_sources(ms_ckpt, mg_ckpt, fault)
    if fault is not None and fault not in {**FAULTS, **LAYOUT_FAULTS}:
        raise SideError(f"fault {fault!r} is not one of {', '.join({**FAULTS, **LAYOUT_FAULTS})}")
    stage = on_stage or (lambda name: None)
    model, core_version = config.model, config.training.megatron_core_version
    out_dir = Path(out_dir)
    the_batch = make_batch(config, seq, batch, data, seed)
    meta = {"config": model.name, "batch": list(the_batch.shape), "batch_source": the_batch.source}
    options = dict(save_tensors=save_tensors, max_tensor_bytes=max_tensor_bytes)

    with tempfile.TemporaryDirectory(prefix="crossalign-diagnose-") as tmp:
        if mg_ckpt is None:
            stage("writing and converting a checkpoint" if ms_ckpt is None else "converting the checkpoint")
            ms_label = str(ms_ckpt) if ms_ckpt is not None else f"random {model.name} (seed {seed})"
            ms_ckpt, mg_ckpt = make_checkpoints(config, Path(tmp), ms_ckpt, fault, seed, layout or (1, 1, 1))
            mg_label = converted_here(layout or (1, 1, 1), fault)
        else:
            ms_label, mg_label = str(ms_ckpt), str(mg_ckpt)
        # The Megatron checkpoint is read first: one that does not fit fails before the slow forwards.
        stage("reading the Megatron checkpoint")
        loaded = read_as_megatron_loads(Path(mg_ckpt), model, core_version)
        _check_layout(layout, loaded, Path(mg_ckpt))
        stage("MindSpore forward with dump hooks")
        dump_mindspore(model, read_mindformers_checkpoint(Path(ms_ckpt)).model_state(), the_batch,
                       out_dir / MINDSPORE_DUMP, meta={**meta, "checkpoint": ms_label}, **options)
        stage("PyTorch forward with dump hooks")
        _, build_problems = dump_megatron(model, loaded.state, the_batch, out_dir / MEGATRON_DUMP, core_version,
                                          meta={**meta, "checkpoint": mg_label, "layout": list(loaded.layout),
                                                "format": loaded.format}, **options)
    stage("comparing")
    diagnosis = compare_dump_folders(out_dir / MINDSPORE_DUMP, out_dir / MEGATRON_DUMP, model, core_version,
                                     "fp32", loaded.problems + build_problems, loaded.layout)
    return write_reports(diagnosis, out_dir, f"crossalign diagnose: {model.name}")
