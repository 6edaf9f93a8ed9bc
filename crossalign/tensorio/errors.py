"""The one error kind of the checkpoint package: a checkpoint that cannot be read, converted or written."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint problem; the message names the file and the keys involved."""


class LoadDigestError(CheckpointError):
    """The tensors a framework loaded are not the checkpoint's; the message names them."""
