"""Embedded CPU backends: Qwen3.5 in MindSpore (MindFormers layout) and in PyTorch (Megatron layout), with trainers that log and save like the real frameworks."""
