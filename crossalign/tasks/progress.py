"""Per-iteration progress of a step that runs as a separate process (locally or over SSH).

The step process prints one marked JSON line per training iteration on stdout; whoever reads
that stdout (the embedded launcher, the SSH runner) turns the marked lines back into
``on_step(step, total, metrics)`` calls and treats every other line as log output.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

PROGRESS_MARK = "::crossalign-progress::"


def progress_line(step: int, total: int, metrics: dict[str, float]) -> str:
    clean = {k: (float(v) if math.isfinite(float(v)) else None) for k, v in metrics.items()}
    return f"{PROGRESS_MARK}{json.dumps({'step': step, 'total': total, 'metrics': clean})}"


def print_progress(step: int, total: int, metrics: dict[str, float]) -> None:
    """An ``on_step`` callback for a step process: one marked line on stdout, flushed at once."""
    sys.stdout.write(progress_line(step, total, metrics) + "\n")
    sys.stdout.flush()


def parse_progress(line: str) -> tuple[int, int, dict[str, Any]] | None:
    """(step, total, metrics) if ``line`` is a progress line, else None."""
    if not line.startswith(PROGRESS_MARK):
        return None
    try:
        data = json.loads(line[len(PROGRESS_MARK):])
        return int(data["step"]), int(data["total"]), dict(data.get("metrics") or {})
    except (ValueError, KeyError, TypeError):
        return None
