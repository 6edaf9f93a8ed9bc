"""msprobe's PyTorch dump of the embedded megatron-core training, taken as a Megatron-LM run takes it.

Every rank makes msprobe's ``PrecisionDebugger`` from the step's ``config.json``
(:func:`crossalign.dump_settings.write_msprobe_config`) and wraps each iteration of the training loop in
``start(model)`` / ``stop()`` / ``step()``, ``model`` being the list of model chunks Megatron's ``train()`` holds
(``[DDP(Float16Module(GPTModel))]``), so the module names are the ones a GPU run dumps
(``Module.0.module.module.decoder.layers.0...``). msprobe itself picks the configured step and ranks and writes
``step{N}/rank{R}/{dump.json, construct.json, stack.json, dump_tensor_data/}``: the rank is the global rank of
the gloo group (0 for a one-process run, which has no group). Beside msprobe's files each dumping rank writes the
record of the run it belongs to (``crossalign_dump.json``, :func:`crossalign.dump_settings.write_rank_record`).

msprobe's debugger is one per process (``msprobe/core/dump/debugger/precision_debugger.py:27-38``, a singleton
that keeps its first config), which the embedded trainer's spawned ranks are.

At level ``mix`` the MLPs run SwiGLU unfused, as the Megatron-LM launch dumping at mix does with
``--no-bias-swiglu-fusion`` (why: ``sides/megatron/args.py`` :func:`swiglu_fusion_under`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from crossalign.dump_settings import write_rank_record


class IterationDump:
    """msprobe around each training iteration of one rank; a no-op without a config."""

    def __init__(self, config_path: Path | None):
        self._debugger = None
        self._config_path = config_path
        if config_path is not None:
            from msprobe.pytorch import PrecisionDebugger  # heavy (patches torch on import): only when dumping

            self._debugger = PrecisionDebugger(config_path=str(config_path))
        self._rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    @contextmanager
    def iteration(self, model_chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
        """One iteration under msprobe: ``debugger.start(model)`` before, ``stop()`` and ``step()`` after."""
        if self._debugger is None:
            yield
            return
        self._debugger.start(model=list(model_chunks), rank_id=self._rank)
        try:
            yield
        finally:
            self._debugger.stop()
        self._debugger.step()
        write_rank_record(self._config_path, self._rank)
