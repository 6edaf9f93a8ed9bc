"""The one error kind of the checkpoint package: a checkpoint that cannot be read, converted or written."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint problem; the message names the file and the keys involved."""
