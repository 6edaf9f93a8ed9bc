"""CLI commands of this area (registered on the main app)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this area's commands to app."""
