"""The terminal view of an msprobe diagnosis: where each section first differs, why, and what was left unmapped."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from crossalign.diagnose.msprobe_match import SECTIONS, Row

SHOWN_METRICS = ("Cosine", "MaxAbsErr", "MaxRelativeErr", "One Thousandth Err Ratio", "Five Thousandths Err Ratio",
                 "relative difference")


def _number(value) -> str:
    return "-" if value is None else f"{value:.6g}"


def _table(rows: list[Row]) -> Table:
    table = Table(show_lines=False)
    for column in ("section", "Megatron (MindSpore: see the CSV)", "input", "status", "msprobe", *SHOWN_METRICS[:2]):
        table.add_column(column, overflow="fold")
    for row in rows:
        style = "red" if row.differs else None
        table.add_row(row.section, row.megatron, row.input_status, row.status, row.msprobe,
                      *(_number(row.metrics.get(m)) for m in SHOWN_METRICS[:2]), style=style)
    return table


def print_msprobe_diagnosis(result, console: Console, limit: int | None = None) -> None:
    """Summary lines, the rows around each section's first divergence (all rows without ``limit``), the files."""
    diagnosis = result.diagnosis
    console.print(f"msprobe dumps, step {diagnosis.step}, {diagnosis.mode}: MindFormers {result.npu.layout}, "
                  f"Megatron {result.gpu.layout}", highlight=False)
    console.print(f"thresholds: {diagnosis.precision.precision} ({diagnosis.precision.reason})", highlight=False)
    shown: list[Row] = []
    for section in SECTIONS:
        rows = [r for r in diagnosis.rows if r.section == section]
        first = diagnosis.first.get(section)
        if first is None:
            console.print(f"{section}: {len(rows)} compared, none differs", highlight=False)
            continue
        console.print(f"{section}: first differs at [bold]{first.megatron}[/] (MindSpore {first.mindspore})",
                      highlight=False)
        start = rows.index(first)
        shown += rows[start: start + (limit or len(rows))] if limit is not None else rows
    if shown:
        console.print(_table(shown))
    console.print(diagnosis.hint(), highlight=False)
    console.print(f"{len(diagnosis.mapped)} module pairs; unmapped: {len(diagnosis.unmapped_mindspore)} MindSpore, "
                  f"{len(diagnosis.unmapped_megatron)} Megatron (listed in the summary)", highlight=False)
    for note in diagnosis.notes:
        console.print(f"note: {note}", highlight=False)
    pairs = result.mappings.pairs
    console.print(f"msprobe's compare: mapping files for {len(pairs)} rank pair{'s' if len(pairs) != 1 else ''} ("
                  + ", ".join(f"{npu}-{gpu}" for npu, gpu, _ in pairs) + ")", highlight=False)
    console.print("reports: " + ", ".join(str(p) for p in result.files.values()), highlight=False)
