"""Forward hooks that write a dump (``DUMP_FORMAT.md``) from a PyTorch Module or a MindSpore Cell tree.

They need nothing but the module tree and a folder, so the same functions work on our CPU
reference models and inside a real Megatron (PyTorch) or MindFormers (MindSpore pynative)
run: install them on the model before the first forward, and the dump is written when the
root module's first forward finishes (one batch), after which the hooks remove themselves.
Neither framework is imported here until a tree of that framework is given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from crossalign.diagnose.dump import DEFAULT_MAX_TENSOR_BYTES, DumpWriter

# Wrappers put these in front of the model's own names: Megatron's DDP / Float16Module ("module."),
# MindFormers' CausalLM wrapper ("model."). The dump stores the model's own names.
DEFAULT_STRIP_PREFIXES = ("module.", "model.")


def strip_wrapper_prefixes(name: str, prefixes: Sequence[str]) -> str:
    """Remove wrapper prefixes from the front of a module name, repeatedly (``module.module.decoder`` -> ``decoder``)."""
    changed = True
    while changed:
        changed = False
        for prefix in prefixes:
            if prefix and name.startswith(prefix):
                name, changed = name[len(prefix):], True
    return name


def _flatten(value: Any, is_tensor: Callable[[Any], bool]) -> Iterator[Any]:
    """Tensors of a module output in a fixed order (tuples, lists and dict values depth first; None skipped)."""
    if is_tensor(value):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _flatten(item, is_tensor)
    elif isinstance(value, dict):
        for key in value:
            yield from _flatten(value[key], is_tensor)


class DumpSession:
    """Hooks on every named module of a tree, writing to one :class:`DumpWriter`.

    The dump closes itself when the root module's forward returns; :meth:`close` finishes it
    by hand (e.g. when the root is never called as a whole) and :meth:`remove` drops the hooks.
    """

    def __init__(self, writer: DumpWriter) -> None:
        self.writer = writer
        self._handles: list[Any] = []

    @property
    def folder(self) -> Path:
        return self.writer.folder

    @property
    def finished(self) -> bool:
        return self.writer.closed

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def close(self) -> Path:
        self.remove()
        return self.writer.close()


def _install(modules: Sequence[tuple[str, Any]], root: Any, session: DumpSession, strip_prefixes: Sequence[str],
             include: Callable[[str], bool] | None, to_numpy: Callable[[Any], tuple[np.ndarray, str]],
             is_tensor: Callable[[Any], bool]) -> DumpSession:
    writer = session.writer

    def make_hook(name: str) -> Callable[..., None]:
        def hook(module: Any, args: Any, output: Any) -> None:
            if writer.closed:
                return
            if module is root:
                session.close()
                return
            writer.record(name, type(module).__name__, [to_numpy(t) for t in _flatten(output, is_tensor)])
        return hook

    for raw_name, module in modules:
        name = strip_wrapper_prefixes(raw_name, strip_prefixes)
        if module is not root and (not name or (include is not None and not include(name))):
            continue
        session._handles.append(module.register_forward_hook(make_hook(name)))
    return session


def install_torch_dump_hooks(root: Any, folder: Path, *, side: str = "megatron", save_tensors: bool = True,
                             max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
                             strip_prefixes: Sequence[str] = DEFAULT_STRIP_PREFIXES,
                             include: Callable[[str], bool] | None = None,
                             meta: dict[str, Any] | None = None) -> DumpSession:
    """Dump every submodule output of a ``torch.nn.Module`` tree for its next forward (Megatron or ours)."""
    import torch

    def to_numpy(tensor: Any) -> tuple[np.ndarray, str]:
        return tensor.detach().to(torch.float32).cpu().numpy(), str(tensor.dtype).removeprefix("torch.")

    writer = DumpWriter(folder, side=side, framework="torch", save_tensors=save_tensors,
                        max_tensor_bytes=max_tensor_bytes, meta=meta)
    return _install(list(root.named_modules()), root, DumpSession(writer), strip_prefixes, include, to_numpy,
                    lambda x: isinstance(x, torch.Tensor))


def install_mindspore_dump_hooks(root: Any, folder: Path, *, side: str = "mindspore", save_tensors: bool = True,
                                 max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
                                 strip_prefixes: Sequence[str] = DEFAULT_STRIP_PREFIXES,
                                 include: Callable[[str], bool] | None = None,
                                 meta: dict[str, Any] | None = None) -> DumpSession:
    """Dump every sub-Cell output of a ``mindspore.nn.Cell`` tree for its next forward (pynative mode only)."""
    import mindspore

    def to_numpy(tensor: Any) -> tuple[np.ndarray, str]:
        dtype = str(tensor.dtype).lower()
        return tensor.astype(mindspore.float32).asnumpy(), dtype

    writer = DumpWriter(folder, side=side, framework="mindspore", save_tensors=save_tensors,
                        max_tensor_bytes=max_tensor_bytes, meta=meta)
    return _install(list(root.cells_and_names()), root, DumpSession(writer), strip_prefixes, include, to_numpy,
                    lambda x: isinstance(x, mindspore.Tensor))


def install_dump_hooks(root: Any, folder: Path, **options: Any) -> DumpSession:
    """Pick the installer by the tree's framework: a torch Module or a MindSpore Cell."""
    if hasattr(root, "named_modules") and hasattr(root, "register_forward_hook"):
        return install_torch_dump_hooks(root, folder, **options)
    if hasattr(root, "cells_and_names"):
        return install_mindspore_dump_hooks(root, folder, **options)
    raise TypeError(f"{type(root).__name__} is neither a torch.nn.Module nor a mindspore.nn.Cell")
