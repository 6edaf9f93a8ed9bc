"""Retry policy: another attempt only for failures of the machine, never for failures of the input."""

from __future__ import annotations

from crossalign.tasks.errors import InfrastructureError


def retry_on_infrastructure(task, task_run, state) -> bool:
    """``retry_condition_fn`` for step tasks: retry a lost worker, a dropped SSH link or a killed process only."""
    error = state.result(raise_on_failure=False)
    return isinstance(error, InfrastructureError)


def backoff_delays(first_s: float, retries: int) -> list[float]:
    """Exponential backoff: first_s, 3*first_s, 9*first_s, ... (one delay per retry)."""
    return [first_s * 3**n for n in range(max(retries, 0))] or [0.0]
