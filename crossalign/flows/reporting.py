"""Make a long step visible: a Prefect progress artifact updated in place, log lines, local events."""

from __future__ import annotations

import time
from typing import Any

from crossalign.flows.events import StepEvent, emit
from crossalign.report.units import duration_text
from crossalign.tasks.progress import parse_progress

ARTIFACT_INTERVAL_S = 2.0


def _format_metrics(metrics: dict[str, Any]) -> str:
    parts = []
    for key, value in metrics.items():
        parts.append(f"{key} {value:.6g}" if isinstance(value, float) else f"{key} {value}")
    return " | ".join(parts)


class StepReporter:
    """Turns per-iteration callbacks and output lines of one step into logs, an artifact and events."""

    def __init__(self, step: str, run_id: str, logger: Any, host: str = ""):
        self.step = step
        self.run_id = run_id
        self.logger = logger
        self.host = host
        self._artifact_id = None
        self._last_update = 0.0

    def on_step(self, done: int, total: int, metrics: dict[str, Any]) -> None:
        """The ``on_step`` callback of a trainer (also fed from progress lines of a step process)."""
        self.logger.info(f"{self.step} iteration {done}/{total}: {_format_metrics(metrics)}")
        emit(StepEvent(self.step, "progress", host=self.host, done=done, total=total, metrics=metrics))
        left = metrics.get("seconds_left")  # a step that knows its time left (a conversion) says it
        description = None if not isinstance(left, (int, float)) or left != left else \
            f"run {self.run_id}: {self.step}, {duration_text(left)} left"
        self._update_artifact(100.0 * done / max(total, 1), force=done >= total, description=description)

    def on_line(self, line: str) -> None:
        """One output line of a step process: progress lines become progress, the rest log lines."""
        parsed = parse_progress(line)
        if parsed is not None:
            self.on_step(*parsed)
            return
        if line.strip():
            self.logger.info(line)
            emit(StepEvent(self.step, "line", host=self.host, message=line))

    def _update_artifact(self, percent: float, force: bool, description: str | None = None) -> None:
        # Prefect loads in seconds: imported only where its API is called
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        now = time.monotonic()
        if not force and now - self._last_update < ARTIFACT_INTERVAL_S:
            return
        self._last_update = now
        try:
            if self._artifact_id is None:
                self._artifact_id = create_progress_artifact(
                    percent, key=f"{self.step}-progress",
                    description=description or f"run {self.run_id}: {self.step} training progress")
            else:
                update_progress_artifact(self._artifact_id, percent, description=description)
        except Exception as exc:  # progress display must never fail a training step
            self.logger.debug(f"progress artifact not updated: {exc}")
