"""Framework versions as numbers: one reading of ``"0.16.1"``-style strings for every version rule."""

from __future__ import annotations

import re


def version_tuple(version: str, framework: str = "megatron core") -> tuple[int, int, int]:
    """``"0.16.1"`` -> ``(0, 16, 1)``; a leading ``v``/``r`` or git tag prefix (``core_v0.16.1``, ``core_r0.16.0``)
    and a suffix such as ``rc0`` or ``.dev0`` are ignored; a missing patch number is 0."""
    match = re.match(r"(?:core_)?[vr]?(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    if match is None:
        raise ValueError(f"{framework} version {version!r} is not of the form MAJOR.MINOR[.PATCH]")
    return int(match[1]), int(match[2]), int(match[3] or 0)
