"""Layer-by-layer diagnosis: dump every module's output on both sides for one batch, compare them in forward
order, and name the first module that diverges with its likely cause.

``dump``/``hooks``: the dump format (``DUMP_FORMAT.md``) and the hook installers that write it,
for our reference models and for real MindFormers and Megatron runs. ``mapping``: which module
pairs with which, from the conversion rules. ``compare``/``causes``/``report``: the comparison,
the known causes, the CSV/HTML output. ``sides``: both reference models on one batch (shared with
the self-check). ``ranks``: a sharded Megatron checkpoint read as each rank loads its file.
``run``: the whole diagnosis.
"""
