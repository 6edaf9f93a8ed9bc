"""The work pools of prefect.yaml and how their workers start flow runs: the facts both the
machine probe and the worker need."""

from __future__ import annotations

POOLS: tuple[str, ...] = ("orchestrator", "npu", "cpu", "gpu")
FLOW_RUN_PYTHON = "python3"  # the interpreter named by prefect.yaml's job_variables.command
