"""The two reference models of Qwen3.5, written independently side by side: MindSpore in MindFormers'
layout (`ms_model`, with its chunked GatedDeltaNet kernel in `ms_gdn`) and PyTorch in Megatron's
layout (`torch_model`). The embedded trainers in `sides/*/embedded/` train them; `selfcheck` and
`diagnose` run them as references."""
