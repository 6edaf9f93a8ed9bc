"""The live alignment in the CLI's run display: the table of ``crossalign.flows.live``'s snapshots."""

from __future__ import annotations

from crossalign.flows.events import StepEvent

COLUMNS = {"series": "series", "steps": "steps", "step1_rel_err": "step-1 rel err",
           "mean_rel_err_so_far": "mean rel err so far", "comove_so_far": "co-movement so far",
           "comove_needed": "a pass needs", "nan": "NaN"}


def alignment_line(event: StepEvent) -> str:
    """One line per update, for terminals without the live table (and the record of a piped run)."""
    rows = event.metrics.get("rows", [])
    parts = [f"{row['series']} step-1 {row['step1_rel_err']} mean {row['mean_rel_err_so_far']} "
             f"co-movement {row['comove_so_far']}" for row in rows]
    decision = event.metrics.get("decision")
    text = f"  alignment: {event.message}" + (": " + "; ".join(parts) if parts else "")
    return text + (f"\n  [bold red]cannot pass:[/] {decision}" if decision else "")


def alignment_table(event: StepEvent):
    from rich.table import Table

    decision = event.metrics.get("decision")
    caption = f"[red]cannot pass: {decision}[/]" if decision else None
    table = Table(title=f"alignment so far: {event.message}", title_justify="left", caption=caption,
                  caption_justify="left")
    for title in COLUMNS.values():
        table.add_column(title)
    for row in event.metrics.get("rows", []):
        table.add_row(*(str(row.get(key, "")) for key in COLUMNS))
    return table
