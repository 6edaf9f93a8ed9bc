"""msprobe's MindSpore dump on CPU: the one stand-in it needs there.

msprobe 26.2.0 computes a tensor's ``norm`` statistic in
``msprobe/core/dump/data_dump/data_processor/mindspore_processor.py:129-133``
(``MindsporeDataProcessor.get_stat_info``: ``get_norm_value = mint.norm ...; tensor_stat.norm = get_norm_value(data)``).
MindSpore 2.10's CPU backend has no ``LinalgVectorNorm`` kernel, so every statistics dump on CPU fails with
``RuntimeError: The kernel LinalgVectorNorm unregistered``. On Ascend the kernel exists and nothing is replaced.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import mindspore as ms
import numpy as np
from mindspore import mint

from msprobe.core.dump.data_dump.data_processor import mindspore_processor


class MintWithoutNorm:
    """Stands in for ``mindspore.mint`` inside msprobe's MindSpore data processor only, on CPU only, while dumping.

    Replaces: ``mint.norm(data)`` (the L2 norm statistic; kernel ``LinalgVectorNorm``, absent on MindSpore CPU).
    With: ``sqrt(sum(x * x))`` in fp32, computed in numpy so that no MindSpore API (hooked by msprobe at level mix)
    runs inside the statistics. Every other attribute is ``mindspore.mint``'s own.
    """

    def __init__(self, real: ModuleType) -> None:
        self._real = real

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    @staticmethod
    def norm(data: ms.Tensor) -> ms.Tensor:
        values = data.to(ms.float32).asnumpy().astype(np.float64)
        return ms.Tensor(np.float32(np.sqrt(np.sum(values * values))))


def cpu_needs_norm_stand_in() -> bool:
    """True where msprobe's norm statistic has no kernel: MindSpore's CPU device target."""
    return ms.get_context("device_target") == "CPU"


@contextmanager
def msprobe_norm_on_cpu() -> Iterator[None]:
    """While the block runs, msprobe's statistics on CPU use :class:`MintWithoutNorm`; elsewhere nothing changes."""
    if not cpu_needs_norm_stand_in():
        yield
        return
    real = mindspore_processor.mint
    mindspore_processor.mint = MintWithoutNorm(mint)
    try:
        yield
    finally:
        mindspore_processor.mint = real
