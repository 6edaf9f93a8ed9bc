"""Step events for whoever watches a run in this process (the CLI's live display).

The flows emit them next to their Prefect logs and artifacts; a listener sees them only when it
runs in the same process as the flow (embedded mode). Listeners must be quick and never raise.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal

EventKind = Literal["started", "skipped", "progress", "line", "done", "failed", "retrying", "alignment"]


@dataclass(frozen=True)
class StepEvent:
    step: str
    kind: EventKind
    host: str = ""
    done: int = 0
    total: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    message: str = ""
    seconds: float | None = None


Listener = Callable[[StepEvent], None]
_listeners: list[Listener] = []
_lock = threading.Lock()


def emit(event: StepEvent) -> None:
    with _lock:
        listeners = list(_listeners)
    for listener in listeners:
        listener(event)


@contextmanager
def listening(listener: Listener) -> Iterator[None]:
    with _lock:
        _listeners.append(listener)
    try:
        yield
    finally:
        with _lock:
            _listeners.remove(listener)
