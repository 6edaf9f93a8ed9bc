"""The shared dataset and the sample order of both frameworks.

``prepare.prepare_dataset`` builds tokenizer.json and the Megatron indexed dataset from the
shipped corpus; ``order.batches_for`` gives the global batches each side reads;
``preflight.compare_sample_order`` checks that both read the same ones.
"""
