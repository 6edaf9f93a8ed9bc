"""Run Megatron-LM's own pretrain_gpt.py with an MTP layer built from the hybrid GDN block.

For megatron-core 0.16.0 .. 0.18.x (see patches/megatron/mtp_gdn.yaml): gpt_builders.gpt_builder
takes the MTP inner layer spec from get_gpt_decoder_layer_specs(), which ignores
--experimental-attention-variant. This launcher, run in place of pretrain_gpt.py with the same
arguments, wraps gpt_builder so that during the model build that function answers with the layer
specs of the hybrid block instead; the MTP layer then gets the block's last layer (full attention,
since linear_attention_freq divides num_layers), the same choice upstream made in 0.19.0. No file
of the checkout is edited, and everything else (argument parsing, data, training loop, logging,
checkpointing) is Megatron's own pretrain().

Usage (from the Megatron-LM checkout, which must be on PYTHONPATH):
    torchrun --nproc_per_node N /path/to/pretrain_qwen35.py <pretrain_gpt.py arguments>

Needs only the framework's own Python: it imports nothing from crossalign.
"""

from __future__ import annotations

import os
import runpy
import sys


def hybrid_block_layer_specs(config, *args, vp_stage=None, **kwargs):
    """Stand-in for get_gpt_decoder_layer_specs: the per-layer specs of the hybrid GDN/attention block."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_block_with_experimental_attention_variant_spec,
    )

    block = get_transformer_block_with_experimental_attention_variant_spec(config=config, vp_stage=vp_stage)
    return list(block.layer_specs)


def wrap_builder(builders_module):
    """A gpt_builder that, with an experimental attention variant and MTP, sees the hybrid layer specs."""
    original_builder = builders_module.gpt_builder

    def gpt_builder(args, *builder_args, **builder_kwargs):
        if getattr(args, "experimental_attention_variant", None) is None or not getattr(args, "mtp_num_layers", None):
            return original_builder(args, *builder_args, **builder_kwargs)
        standard = builders_module.get_gpt_decoder_layer_specs
        builders_module.get_gpt_decoder_layer_specs = hybrid_block_layer_specs
        try:
            return original_builder(args, *builder_args, **builder_kwargs)
        finally:
            builders_module.get_gpt_decoder_layer_specs = standard

    gpt_builder.__wrapped__ = original_builder
    return gpt_builder


def main() -> None:
    checkout = os.environ.get("MEGATRON_LM_PATH") or os.getcwd()
    entry = os.path.join(checkout, "pretrain_gpt.py")
    if not os.path.exists(entry):
        sys.exit(f"pretrain_qwen35.py: {entry} not found; run from the Megatron-LM checkout or set MEGATRON_LM_PATH")
    sys.path.insert(0, checkout)
    import gpt_builders

    # pretrain_gpt.py does `from gpt_builders import gpt_builder`: it picks up the wrapped builder.
    gpt_builders.gpt_builder = wrap_builder(gpt_builders)
    sys.argv = [entry] + sys.argv[1:]
    runpy.run_path(entry, run_name="__main__")


if __name__ == "__main__":
    main()
