"""crossalign: cross-framework training alignment for Qwen3.5 (MindFormers on Ascend vs Megatron-LM on GPU)."""

__version__ = "0.1.0"
