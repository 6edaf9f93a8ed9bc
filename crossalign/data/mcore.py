"""Importing megatron-core's dataset code without its unrelated import-time warnings.

megatron-core warns at import that TransformerEngine and Apex are missing and about deprecated
inference imports; none of it concerns the datasets we use, and it would bury our own output.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def quiet_megatron_import() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"megatron\.")
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        yield
