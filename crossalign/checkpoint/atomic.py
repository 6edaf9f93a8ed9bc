"""Write a directory completely or not at all: build it in a temporary sibling, rename it into place."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from crossalign.checkpoint.errors import CheckpointError


def check_output_dir(path: Path) -> None:
    """An output folder must not exist yet, or be empty: a conversion never mixes with older files."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise CheckpointError(f"{path}: output folder exists and is not empty")


@contextmanager
def atomic_directory(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` to fill; on success it becomes ``path``, on failure it is removed."""
    check_output_dir(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.parent / f".{path.name}.partial-{os.getpid()}"
    if temporary.exists():
        shutil.rmtree(temporary)
    temporary.mkdir()
    try:
        yield temporary
        check_output_dir(path)
        if path.exists():
            path.rmdir()
        temporary.rename(path)
    finally:
        if temporary.exists():
            shutil.rmtree(temporary)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace a small file (a tracker) in one step, so a reader never sees it half-written."""
    temporary = path.parent / f".{path.name}.partial-{os.getpid()}"
    temporary.write_text(text)
    os.replace(temporary, path)
