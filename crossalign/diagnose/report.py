"""A diagnosis as a terminal table, a CSV file and a self-contained HTML page."""

from __future__ import annotations

import csv
import html
import io
import math
import os
from pathlib import Path

from crossalign.diagnose.compare import Diagnosis, ModuleRow

COLUMNS = ("order", "mindspore", "megatron", "shape", "cosine", "max_abs", "max_rel", "status", "basis", "note")


def _number(value: float | None, digits: str = ".3e") -> str:
    if value is None:
        return "-"
    if math.isnan(value):
        return "nan"
    return format(value, digits)


def _cells(row: ModuleRow) -> list[str]:
    return [str(row.order), row.mindspore, row.megatron, "x".join(map(str, row.shape)) if row.shape else "-",
            _number(row.cosine, ".8f"), _number(row.max_abs), _number(row.max_rel), row.status, row.basis, row.note]


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_csv(diagnosis: Diagnosis, path: Path) -> Path:
    """One row per compared module call, in forward order; numbers at full precision."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(COLUMNS)
    for row in diagnosis.rows:
        writer.writerow([row.order, row.mindspore, row.megatron, "x".join(map(str, row.shape or ())),
                         "" if row.cosine is None else repr(row.cosine),
                         "" if row.max_abs is None else repr(row.max_abs),
                         "" if row.max_rel is None else repr(row.max_rel), row.status, row.basis, row.note])
    _write_atomic(Path(path), buffer.getvalue())
    return Path(path)


_STYLE = """
body { font-family: sans-serif; margin: 2em; }
table { border-collapse: collapse; font-size: 13px; }
td, th { border: 1px solid #ccc; padding: 2px 6px; text-align: left; }
td.num { text-align: right; font-family: monospace; }
tr.diverged { background: #fdd; }
tr.first { background: #f88; font-weight: bold; }
tr.shape { background: #ffd; }
.hint { border: 2px solid #c00; padding: 1em; margin: 1em 0; white-space: pre-wrap; }
.ok { border: 2px solid #080; padding: 1em; margin: 1em 0; }
"""


def write_html(diagnosis: Diagnosis, path: Path, title: str = "crossalign diagnose") -> Path:
    """The table with diverged rows coloured, the first one marked, and the hint above it."""
    esc = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)}</title>",
             f"<style>{_STYLE}</style></head><body><h1>{esc(title)}</h1>"]
    if diagnosis.load_problems:
        parts.append("<div class='hint'><b>Megatron checkpoint does not load strictly:</b>\n"
                     + esc("\n".join(diagnosis.load_problems)) + "</div>")
    parts.append(f"<div class='{'hint' if diagnosis.diverged else 'ok'}'>{esc(diagnosis.hint())}</div>")
    t = diagnosis.thresholds
    parts.append(f"<p>diverged: cosine &lt; {t.cosine_min} or max rel &gt; {t.max_rel} (tensors), "
                 f"statistics rel &gt; {t.stat_rel}; max rel = max|megatron - mindspore| / max|mindspore|.</p>")
    parts.append("<table><tr>" + "".join(f"<th>{c}</th>" for c in COLUMNS) + "</tr>")
    numeric = {0, 4, 5, 6}
    for row in diagnosis.rows:
        css = ("first" if row is diagnosis.first_divergence else "diverged" if row.diverged
               else "shape" if row.status == "shape differs" else "")
        cells = "".join(f"<td class='num'>{esc(c)}</td>" if i in numeric else f"<td>{esc(c)}</td>"
                        for i, c in enumerate(_cells(row)))
        parts.append(f"<tr class='{css}'>{cells}</tr>")
    parts.append("</table>")
    if diagnosis.not_compared:
        parts.append("<h2>Not compared</h2><ul>" + "".join(f"<li>{esc(n)}</li>" for n in diagnosis.not_compared)
                     + "</ul>")
    parts.append("</body></html>")
    _write_atomic(Path(path), "\n".join(parts))
    return Path(path)


def print_diagnosis(diagnosis: Diagnosis, console, limit: int | None = None) -> None:
    """The rich table (all rows, or the rows up to a little past the first divergence), then the hint."""
    from rich.markup import escape
    from rich.table import Table

    rows = diagnosis.rows
    if limit is not None and diagnosis.first_divergence is not None:
        stop = rows.index(diagnosis.first_divergence) + limit
        rows = rows[:stop]
    table = Table("#", "MindSpore", "Megatron", "shape", "cosine", "max abs", "max rel", "status",
                  title="module outputs in forward order (MindSpore = reference)")
    for row in rows:
        cells = _cells(row)
        style = ("bold red" if row is diagnosis.first_divergence else "red" if row.diverged
                 else "yellow" if row.status == "shape differs" else None)
        table.add_row(*map(escape, cells[:8]), style=style)
    console.print(table)
    if len(rows) < len(diagnosis.rows):
        console.print(f"... {len(diagnosis.rows) - len(rows)} more rows in the CSV/HTML report")
    for problem in diagnosis.load_problems:
        console.print(f"[bold red]load:[/] {escape(problem)}", highlight=False, soft_wrap=True)
    colour = "red" if diagnosis.diverged else "green"
    console.print(f"[bold {colour}]{escape(diagnosis.hint())}[/]", highlight=False, soft_wrap=True)
