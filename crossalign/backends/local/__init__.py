"""Embedded CPU backends: trainers of the reference models (`crossalign.models`) and of megatron-core that log and save like the real frameworks."""
