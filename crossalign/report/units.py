"""Durations and sizes as people read them, the same in the CLI's tables and the Prefect artifacts."""

from __future__ import annotations


def duration_text(seconds: float | None) -> str:
    """``12.3 s``, ``4.5 min``, ``2.1 h``; empty for an unknown duration."""
    if seconds is None:
        return ""
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def size_text(num: float) -> str:
    """``512 B``, ``3.4 KB``, ``1.2 GB`` (powers of 1024)."""
    for unit in ("B", "KB", "MB", "GB"):
        if num < 1024:
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.1f} {unit}"
        num /= 1024
    return f"{num:.1f} TB"
