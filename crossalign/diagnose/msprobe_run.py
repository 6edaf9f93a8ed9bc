"""``crossalign diagnose --npu-dump --gpu-dump``: read both msprobe dumps, check they belong together and fit the
config, merge, compare, and write the reports (CSV of every row, summary.json, and msprobe's own mapping files for
every rank pair) all at once.

Before anything is compared: both sides are the same step and task, their dump records say they belong together
(``msprobe_records``), and each fits the config's model and layout (``msprobe_fit``). A pair that does not is
refused naming what does not fit, and nothing is written. The thresholds come from the dtypes the dumps recorded
(``msprobe_precision``) unless ``--precision`` names them.
"""

from __future__ import annotations

import csv
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from crossalign.checkpoint.rules import conversion_plan
from crossalign.config import AlignmentConfig
from crossalign.diagnose.mapping import module_mapping
from crossalign.diagnose.msprobe_dump import OPTIONS, SIDE_NAMES, MsprobeDumpError, StepDump, read_dump
from crossalign.diagnose.msprobe_export import Mappings, write_mappings
from crossalign.diagnose.msprobe_fit import check_pair
from crossalign.diagnose.msprobe_match import MsprobeDiagnosis, compare_msprobe_dumps
from crossalign.diagnose.msprobe_precision import choose_precision
from crossalign.diagnose.msprobe_records import pair_records, records_against_config
from crossalign.diagnose.msprobe_shards import SideLayout, WholeDump, merge_side
from crossalign.store import RunStore, StoreError

CSV_NAME = "msprobe_diagnosis.csv"
SUMMARY_NAME = "msprobe_summary.json"


@dataclass
class MsprobeResult:
    diagnosis: MsprobeDiagnosis
    npu: WholeDump
    gpu: WholeDump
    files: dict[str, Path]
    mappings: Mappings


@dataclass
class LoadedPair:
    """Both sides as msprobe wrote them (``steps``) and merged by their layouts, with what the checks noted."""

    npu_step: StepDump
    gpu_step: StepDump
    npu: WholeDump
    gpu: WholeDump
    notes: list[str]


def read_side(folder: Path, framework: str, step: int | None) -> StepDump:
    """One side's step dump; a dump of the other framework is an error naming its dump.json."""
    dump = read_dump(Path(folder), step)
    if dump.framework != framework:
        first = next(iter(dump.ranks.values())).path / "dump.json"
        raise MsprobeDumpError(f"{first}: a {dump.framework} dump given as {OPTIONS[framework]}, which takes the "
                               f"{SIDE_NAMES[framework]} ({framework}) side")
    return dump


def load_pair(npu_dir: Path, gpu_dir: Path, config: AlignmentConfig, step: int | None = None) -> LoadedPair:
    """Both sides read, held against each other and the config (see the module), and merged by their layouts."""
    npu, gpu = read_side(npu_dir, "mindspore", step), read_side(gpu_dir, "pytorch", step)
    npu_json = next(iter(npu.ranks.values())).path / "dump.json"
    gpu_json = next(iter(gpu.ranks.values())).path / "dump.json"
    if npu.step != gpu.step:
        raise MsprobeDumpError(f"{npu_json} is step {npu.step} and {gpu_json} step {gpu.step}: dump the same "
                               f"iteration on both sides")
    if npu.mode != gpu.mode:
        raise MsprobeDumpError(f"{npu_json} holds {npu.mode} and {gpu_json} {gpu.mode}: dump both sides with the "
                               f"same task")
    records, notes = pair_records(npu, gpu)
    check_pair(npu, gpu, config)
    notes += records_against_config(records, {"mindformers": str(npu.path), "megatron": str(gpu.path)}, config)
    model = config.model
    return LoadedPair(npu, gpu, merge_side(npu, SideLayout.of(config.parallel.mindformers), model, "mindspore"),
                      merge_side(gpu, SideLayout.of(config.parallel.megatron), model, "megatron"), notes)


def diagnose_msprobe(npu_dir: Path, gpu_dir: Path, config: AlignmentConfig, out_dir: Path,
                     precision: str = "auto", step: int | None = None) -> MsprobeResult:
    """Compare the two dumps and write the reports into ``out_dir`` (written only when everything was read);
    ``precision``: auto (from the dumps' dtypes), fp32 or bf16."""
    pair = load_pair(npu_dir, gpu_dir, config, step)
    npu, gpu = pair.npu, pair.gpu
    core_version = config.training.megatron_core_version
    mapping = module_mapping(config.model, core_version)
    chosen = choose_precision(pair.npu_step, pair.gpu_step, precision)
    diagnosis = compare_msprobe_dumps(npu, gpu, mapping, config.model, core_version, chosen)
    diagnosis.notes[:0] = pair.notes
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".msprobe-diagnose-", dir=out_dir.parent) as tmp:
        staging = Path(tmp)
        _write_csv(diagnosis, staging / CSV_NAME)
        mappings = write_mappings(staging, pair.npu_step, pair.gpu_step, npu, gpu, mapping,
                                  conversion_plan(config.model, core_version))
        (staging / SUMMARY_NAME).write_text(json.dumps(summary(diagnosis, npu, gpu, mappings), indent=1))
        out_dir.mkdir(parents=True, exist_ok=True)
        files = {}
        for name in [CSV_NAME, SUMMARY_NAME, *mappings.files]:
            target = out_dir / name
            if target.is_dir():
                shutil.rmtree(target)
            target.parent.mkdir(parents=True, exist_ok=True)
            files[name] = Path(shutil.move(str(staging / name), target))
    return MsprobeResult(diagnosis, npu, gpu, files, mappings)


def _row_dict(row) -> dict:
    return {"section": row.section, "mindspore": row.mindspore, "megatron": row.megatron,
            "shape": list(row.shape) if row.shape is not None else None, "basis": row.basis, "status": row.status,
            "input": row.input_status, "msprobe": row.msprobe, **row.metrics, "note": row.note}


def summary(diagnosis: MsprobeDiagnosis, npu: WholeDump, gpu: WholeDump, mappings) -> dict:
    first = diagnosis.first_divergence
    return {
        "diverged": diagnosis.diverged,
        "step": diagnosis.step,
        "mode": diagnosis.mode,
        "thresholds": diagnosis.precision.as_dict(),
        "first_divergence": None if first is None else _row_dict(first),
        "first_by_section": {s: (None if r is None else _row_dict(r)) for s, r in diagnosis.first.items()},
        "evidence": None if diagnosis.evidence is None else diagnosis.evidence.kind,
        "conversion_ruled_out": diagnosis.ruled_out or None,
        "causes": [{"cause": c.cause, "check": c.check, "needs": c.needs, "faults": list(c.faults)}
                   for c in diagnosis.causes],
        "hint": diagnosis.hint(),
        "layouts": {"mindformers": str(npu.layout), "megatron": str(gpu.layout)},
        "msprobe_compare": mappings.as_dict(),
        "mapped": [list(pair) for pair in diagnosis.mapped],
        "unmapped_mindspore": diagnosis.unmapped_mindspore,
        "unmapped_megatron": diagnosis.unmapped_megatron,
        "notes": diagnosis.notes,
    }


def _write_csv(diagnosis: MsprobeDiagnosis, path: Path) -> None:
    rows = [_row_dict(r) for r in diagnosis.rows]
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


# ---- the dumps a run's train steps collected ------------------------------------------------------------------

RUN_DUMP_DIR = "msprobe_dump"  # in each train step's outputs: msprobe's dump_path (step{N}/rank{R}/...)


def run_dump_folders(run_dir: Path) -> tuple[Path, Path]:
    """(MindFormers dump, Megatron dump) that the run's pynative-train and megatron-train steps collected."""
    run_dir = Path(run_dir).expanduser().absolute()
    run = RunStore(run_dir.parent).run(run_dir.name)
    folders = []
    for step in ("pynative-train", "megatron-train"):
        folder = run.step_dir(step) / RUN_DUMP_DIR
        if not folder.is_dir():
            raise StoreError(f"run {run.run_id!r}: step {step} has no msprobe dump at {folder} (re-run it with "
                             f"dumps on: crossalign rerun {run_dir} --step {step} --dump)")
        folders.append(folder)
    return folders[0], folders[1]
