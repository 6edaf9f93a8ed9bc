"""What the two sides' launch-file readers return: each number-changing setting as that side will see it.

Each side reads its own launch files (``megatron/args_reader.py``, ``mindformers/yaml_reader.py``)
with its framework's own defaults; ``crossalign.preflight.config`` lays the two readings side by side.
"""

from __future__ import annotations

from dataclasses import dataclass
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from crossalign.data.settings import SampleOrderError, split_vector


UNSET = "(unset)"
# the dataset a generated launch is read back with (``Side.generated_readings``): only its form matters
PREFLIGHT_DATA_PREFIX = Path("DATA") / "corpus_text_document"
LAYOUT = "layout: "  # rows of the parallel layout: the sides may differ, the loss must not


class PreflightInputError(ValueError):
    """A Megatron argument file or MindFormers YAML that cannot be read; names the file."""


@dataclass(frozen=True)
class Reading:
    """One setting as one side will see it."""

    value: Any  # comparable; None when unknown
    shown: str
    origin: str = ""  # the flag or YAML key it came from, or "default"


def shown_value(value: Any) -> str:
    if value is None:
        return UNSET
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, tuple):
        return ", ".join(shown_value(v) for v in value)
    return str(value)


def reading(value: Any, origin: str) -> Reading:
    return Reading(value, shown_value(value), origin)



def split_reading(text: str | None) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        return split_vector(text)
    except SampleOrderError:
        return None


def layer_layout(num_layers: int | None, freq: Any) -> str | None:
    """'GGGA GGGA' from a layer count and linear_attention_freq (int N, or a per-layer list: 1 GDN, 0 attention)."""
    if num_layers is None or freq is None:
        return None
    if isinstance(freq, int):
        kinds = ["A" if (i + 1) % freq == 0 else "G" for i in range(num_layers)]
    else:
        kinds = ["G" if int(k) else "A" for k in freq]
    return " ".join("".join(kinds[i:i + 4]) for i in range(0, len(kinds), 4))


def data_path_form(tokens: Sequence[str] | None) -> tuple | None:
    """('bare', name) for one prefix, ('weighted', (w, name), ...) for a weighted blend."""
    if not tokens:
        return None
    tokens = [str(t) for t in tokens]
    if len(tokens) == 1:
        return ("bare", Path(tokens[0]).name)
    pairs = []
    for weight, prefix in zip(tokens[0::2], tokens[1::2]):
        try:
            pairs.append((float(weight), Path(prefix).name))
        except ValueError:
            return ("several prefixes",) + tuple(Path(t).name for t in tokens)
    return ("weighted",) + tuple(pairs)


def data_path_shown(value: tuple | None, tokens: Sequence[str] | None) -> str:
    if value is None:
        return UNSET
    form = "bare prefix" if value[0] == "bare" else ("weighted blend" if value[0] == "weighted" else value[0])
    return f"{form}: {' '.join(map(str, tokens or []))}"


def add_layout_rows(r: dict[str, Reading], sizes: Mapping[str, Reading], world: int | None, gbs: int | None,
                 mbs: int | None) -> None:
    """The layout readings, and whether the global batch splits into whole micro batches on every data-parallel
    rank (that one changes the numbers: a side that cannot split it does not train the same batch)."""
    r.update({LAYOUT + name: reading for name, reading in sizes.items()})
    if world is None:
        r[LAYOUT + "cards"] = Reading(None, "from the launcher", "")
        return
    r[LAYOUT + "cards"] = reading(world, "launch")
    model_parallel = math.prod(int(sizes[name].value) for name in ("tensor", "pipeline", "context"))
    splits = bool(gbs and mbs and world % model_parallel == 0 and gbs % (mbs * (world // model_parallel)) == 0)
    shown = (f"yes ({world // model_parallel} data-parallel ranks)" if splits else
             f"no: {world} cards over TP x PP x CP = {model_parallel}, global batch {gbs}, micro batch {mbs}")
    r["global batch splits over data-parallel ranks"] = Reading(True if splits else shown, shown, "layout")
