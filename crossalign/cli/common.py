"""Helpers shared by the CLI areas: loud, specific errors and rich output."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import typer
from rich.console import Console

# soft_wrap: a line longer than the terminal is left for the terminal to wrap, never broken by rich, so a
# path or a run id printed in a sentence stays whole and can be copied (tables still fit the width)
console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)


@contextmanager
def user_errors(*kinds: type[BaseException], exit_code: int = 2) -> Iterator[None]:
    """Turn the expected errors of a command into one red line and an exit code, no traceback."""
    try:
        yield
    except kinds as exc:  # type: ignore[misc]
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(exit_code) from None
