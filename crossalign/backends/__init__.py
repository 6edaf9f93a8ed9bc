"""How a training step is carried out: real frameworks (MindFormers on NPU, Megatron on GPU) or embedded CPU stand-ins."""
