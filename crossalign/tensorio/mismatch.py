"""One wording, everywhere, for a state whose keys or shapes are not the expected ones."""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

SHOWN = 8  # keys named per kind of mismatch; the rest are counted

Shapes = Mapping[str, Sequence[int]]


def key_names(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:SHOWN])
    return shown + (f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else "")


def key_mismatches(got: Shapes, expected: Shapes,
                   accepted: Callable[[str, tuple[int, ...]], bool] = lambda key, shape: False) -> str:
    """Empty when ``got`` has exactly the keys and shapes of ``expected``; else every kind of mismatch
    (``N missing keys: ...; N unexpected keys: ...; N wrong shapes: key [got] (expected [want])``).
    ``accepted(key, shape)`` lets a caller allow another layout of some key."""
    missing = expected.keys() - got.keys()
    unexpected = got.keys() - expected.keys()
    wrong = [f"{key} {list(got[key])} (expected {list(expected[key])})"
             for key in sorted(got.keys() & expected.keys())
             if tuple(got[key]) != tuple(expected[key]) and not accepted(key, tuple(got[key]))]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing keys: {key_names(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected keys: {key_names(unexpected)}")
    if wrong:
        problems.append(f"{len(wrong)} wrong shapes: " + "; ".join(wrong[:SHOWN])
                        + (f" and {len(wrong) - SHOWN} more" if len(wrong) > SHOWN else ""))
    return "; ".join(problems)
