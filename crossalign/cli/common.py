"""Helpers shared by the CLI areas: loud, specific errors and rich output."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import typer
from rich.console import Console

console = Console()
err_console = Console(stderr=True)


@contextmanager
def user_errors(*kinds: type[BaseException], exit_code: int = 2) -> Iterator[None]:
    """Turn the expected errors of a command into one red line and an exit code, no traceback."""
    try:
        yield
    except kinds as exc:  # type: ignore[misc]
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(exit_code) from None
