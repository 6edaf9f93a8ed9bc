"""MindFormers and Megatron checkpoints: reading, writing, the bf16 cast and the conversion rules."""

from crossalign.tensorio.errors import CheckpointError

__all__ = ["CheckpointError"]
