"""The two ways a step can fail, because they call for opposite reactions.

``StepFailed`` is deterministic (bad input, a broken checkpoint): running the
same step again gives the same failure, so the orchestrator never retries it.
``InfrastructureError`` is the machine's fault (a killed process, a lost worker, a dropped SSH
connection): the same step may well succeed on the next attempt, so it is retried with backoff.
"""

from __future__ import annotations

# Exit codes of ``python -m crossalign.tasks`` (a step run as a process, locally or over SSH).
EXIT_OK = 0
EXIT_DETERMINISTIC = 3
EXIT_RETRYABLE = 75  # EX_TEMPFAIL


class StepFailed(Exception):
    """A step failed in a way that retrying cannot fix."""

    def __init__(self, step: str, message: str):
        super().__init__(f"step {step}: {message}")
        self.step = step


class InfrastructureError(RuntimeError):
    """A step was cut short by its machine, process or connection; worth another attempt."""

    def __init__(self, step: str, message: str):
        super().__init__(f"step {step}: {message}")
        self.step = step


def exit_code_error(step: str, returncode: int, detail: str = "") -> Exception:
    """The error for a step process that ended with ``returncode`` (negative: killed by a signal)."""
    suffix = f": {detail}" if detail else ""
    if returncode < 0:
        return InfrastructureError(step, f"process killed by signal {-returncode}{suffix}")
    if returncode in (EXIT_RETRYABLE, 128 + 9, 128 + 15, 255):  # tempfail, SIGKILL/SIGTERM via a shell, ssh's own failure
        return InfrastructureError(step, f"process exited with {returncode}{suffix}")
    return StepFailed(step, f"process exited with {returncode}{suffix}")


class PreflightFailed(StepFailed):
    """The two sides would not train the same thing (config mismatch, different sample order): bad input."""

    def __init__(self, message: str):
        super().__init__("preflight", message)
