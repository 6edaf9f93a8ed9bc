"""What a framework really loaded, held against the checkpoint it was given: one digest per tensor.

Neither framework's load message can be trusted. Megatron retries a failed strict load
non-strictly and prints ``load_return: None`` whatever was missing (SPEC section 4);
MindFormers' ``load_checkpoint`` loads only the network's own names and never reports extra
tensors. So right after loading, before the first step, each side records every tensor its
model holds (name, shape, dtype, sha256 of the bytes), and the step compares that record with
the checkpoint: a tensor missing from the checkpoint (it stayed at its initial value), one the
model never took (an extra or renamed key), or one whose values differ fails the step, named.

The model may hold a tensor in another dtype than the checkpoint (Megatron under ``--bf16``
builds bf16 parameters and copies the fp32 checkpoint into them): the checkpoint's tensor is
cast to the loaded dtype (round to nearest even, as ``copy_`` rounds) before it is hashed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import torch

from crossalign.tensorio.errors import LoadDigestError

SHOWN = 8  # names listed per kind of problem


def torch_sha256(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes in its own dtype, C order (the Megatron launcher hashes the same way)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def numpy_sha256(array: np.ndarray) -> str:
    """sha256 of an array's bytes, C order: equal to :func:`torch_sha256` of the same values and dtype."""
    return hashlib.sha256(np.ascontiguousarray(array).reshape(-1).view(np.uint8).tobytes()).hexdigest()


def entry(shape, dtype: str, sha256: str) -> dict:
    return {"shape": [int(n) for n in shape], "dtype": dtype, "sha256": sha256}


def torch_digests(state: Mapping[str, torch.Tensor]) -> dict[str, dict]:
    """The digest of every tensor of a torch state dict (``*._extra_state`` entries left out)."""
    return {key: entry(value.shape, str(value.dtype).replace("torch.", ""), torch_sha256(value))
            for key, value in state.items() if isinstance(value, torch.Tensor) and not key.endswith("_extra_state")}


def write_digest(path: Path, tensors: Mapping[str, dict], **fields) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**fields, "tensors": dict(tensors)}, indent=1, sort_keys=True))
    return path


def read_digest(path: Path) -> dict[str, dict]:
    """The ``tensors`` of a digest file, checked to be one."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LoadDigestError(f"{path}: no readable load digest ({exc})") from None
    tensors = raw.get("tensors") if isinstance(raw, dict) else None
    if not isinstance(tensors, dict):
        raise LoadDigestError(f"{path}: not a load digest (no 'tensors' object)")
    return tensors


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise LoadDigestError(f"unknown dtype {name!r} in a load digest")
    return dtype


def torch_checkpoint_hash(tensor: torch.Tensor, loaded: Mapping) -> str:
    """The checkpoint tensor's sha256 in the dtype the model holds it in (``loaded['dtype']``)."""
    want = _torch_dtype(loaded["dtype"])
    return torch_sha256(tensor if tensor.dtype == want else tensor.to(want))


def compare_loaded(loaded: Mapping[str, Mapping], checkpoint: Mapping[str, object], *, what: str,
                   rename: Callable[[str], str] = lambda name: name,
                   hash_in: Callable[[object, Mapping], str] = torch_checkpoint_hash,
                   shape_of: Callable[[object], tuple] = lambda t: tuple(t.shape)) -> None:
    """Raise :class:`LoadDigestError` unless ``loaded`` (digests, under the model's names, mapped to the
    checkpoint's by ``rename``) holds exactly the checkpoint's tensors, each with its values.

    ``what`` names the two sides in the message (e.g. "Megatron rank mp_rank_00 vs /ckpt/iter_0000000").
    """
    mapped = {rename(name): (name, value) for name, value in loaded.items()}
    missing = sorted(name for name in mapped if name not in checkpoint)
    unused = sorted(name for name in checkpoint if name not in mapped)
    shapes, values = [], []
    for name in sorted(set(mapped) & set(checkpoint)):
        model_name, digest = mapped[name]
        tensor = checkpoint[name]
        if tuple(digest["shape"]) != tuple(shape_of(tensor)):
            shapes.append(f"{name} (loaded {tuple(digest['shape'])}, checkpoint {tuple(shape_of(tensor))})")
        elif digest["sha256"] != hash_in(tensor, digest):
            values.append(f"{name} ({digest['dtype']})")
    problems = []
    for label, names in (("not in the checkpoint, so left at its initial value", missing),
                         ("in the checkpoint but never loaded (extra or renamed)", unused),
                         ("loaded with another shape", shapes), ("loaded with other values", values)):
        if names:
            shown = ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
            problems.append(f"{len(names)} {label}: {shown}")
    if problems:
        raise LoadDigestError(f"{what}: the loaded tensors are not the checkpoint's: " + "; ".join(problems))
