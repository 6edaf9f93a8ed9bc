"""Write a directory completely or not at all: build it in a temporary sibling, rename it into place."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from crossalign.tensorio.errors import CheckpointError


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


def save_iteration(root: Path, name: str, iteration: int, tracker: str, fill: Callable[[Path], None]) -> Path:
    """Add the iteration folder ``name`` to the checkpoint ``root``, filled by ``fill(folder)``, and point the
    tracker file at ``iteration``; returns the iteration folder.

    A new root is built whole in a temporary sibling and renamed into place. An existing root
    (earlier saves of the same run) gets the new iteration folder the same way, then its tracker
    is replaced, so a reader always finds a complete iteration.
    """
    root = Path(root)
    if root.exists() and any(root.iterdir()):
        if (root / name).exists():
            raise CheckpointError(f"{root / name}: iteration {iteration} is already saved")
        with atomic_directory(root / name) as directory:
            fill(directory)
        write_text_atomic(root / tracker, str(iteration))
        return root / name
    with atomic_directory(root) as staging:
        (staging / name).mkdir()
        fill(staging / name)
        (staging / tracker).write_text(str(iteration))
    return root / name
