"""A run that ends without a pass as an expected outcome (a failed verdict, a regression, bad input named in the
run form): the flow returns a Failed state whose message says why, with a :class:`RunOutcome` as its data.

Prefect's process engine, which runs every flow of a deployment, turns a Failed state returned by the flow into
its exception and logs it as "Engine execution exited with unexpected exception" with a traceback at ERROR
(prefect 3.9.1 ``prefect/flow_engine.py`` ``run_flow``, the ``except Exception`` branch, and ``states.py``
``aget_state_exception``, which refuses any data that is not an exception). The filter below leaves that one
record out for a ``RunOutcome``: the state message is the outcome, and nothing crashed.
"""

from __future__ import annotations

import logging
from typing import Any

from prefect.states import Failed, State


class RunOutcome(Exception):
    """Why a run ended Failed: its ``outcome`` (verdict, report, summary) or the bad input (``cause``)."""

    def __init__(self, message: str, outcome: dict[str, Any] | None = None, cause: BaseException | None = None):
        super().__init__(message)
        self.outcome = outcome
        self.cause = cause


def failed(message: str, outcome: dict[str, Any] | None = None, cause: BaseException | None = None) -> State:
    """The Failed state of an expected outcome, told in its message."""
    return Failed(message=message, data=RunOutcome(message, outcome, cause))


def outcome_of(state: State) -> tuple[dict[str, Any] | None, BaseException | None]:
    """What a run's final state carries: its outcome (the alignment's run_id, verdict, report, ...), else the
    error that ended it (bad input, a failed step); (None, None) when it carries neither."""
    data = state.result(raise_on_failure=False)
    if isinstance(data, RunOutcome):
        return data.outcome, data.cause
    if isinstance(data, BaseException):
        return None, data
    return (data, None) if isinstance(data, dict) else (None, None)


class _OutcomeIsNotAnError(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], RunOutcome))


logging.getLogger("prefect.flow_runs").addFilter(_OutcomeIsNotAnError())
