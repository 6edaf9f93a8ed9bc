"""Hold each side's msprobe dump against the config before anything is compared: the model it is of, and the
parallel layout its rank folders were cut in.

A dump that does not fit is refused (:class:`DumpFitError`, exit 2 in the CLI), naming the folder and what the dump
itself implies, because a comparison of a dump read under the wrong layout or model names a wrong module with
confidence: rank 1 of a TP 2 x EP 2 dump read as one card is left out and half of every sharded weight looks like a
conversion fault.

What a dump says of itself, from the parameters msprobe records with each module's forward (``parameters``) and its
``parameters_grad``, rank folder by rank folder:

- the model, whatever the layout: every parameter name must be one of the model's, its layer number aside
  (``models.layout.megatron_shapes``, the TransformerEngine names, and megatron-core's local-module names that
  ``sides/megatron/te_local.py`` maps to them; ``mindformers_shapes`` and its buffers on the MindSpore side), with no
  layer or routed expert number beyond the model's; every dimension a layout does not split must be the model's
  width, and the split ones must split the model's widths alike; and the first rank folder (the first pipeline
  stage), where it holds the final norm too (the last stage), must hold the model's number of layers. A parameter
  the model does not have (a dense MLP's ``linear_fc1`` given with a MoE config, a fifth layer, a ninth expert), of
  another width, or another depth makes the pair "different models";
- the layout: each rank's parameters must be the shards that the config's layout gives that rank (Megatron:
  ``sides/megatron/sharding.shard_shapes`` at the rank's (tensor, pipeline, expert) coordinates, its layers
  numbered from 0 on each stage and its routed experts locally; MindFormers: its split axis
  ``mindformers_split_dim`` over the tensor ranks, the routed experts' axis over the expert ranks), and no rank
  folder may lie beyond the layout's cards. Where they do not fit, the message says what the dump implies: the
  tensor size from a split weight's shard against the model's width, the expert tensor size from a routed expert's,
  the expert size from the routed experts a rank holds, the pipeline size from the layers it holds, sequence
  parallelism from a column-parallel linear's input against its output (Megatron gathers the sequence there), and
  the cards from the rank folders; with the ``--set`` options that make the config say the same.

Settings whose dumps are not merged are refused by name: context parallelism (each rank holds two chunks of every
sequence in Megatron's load-balanced order, MindFormers' own split likewise) and virtual pipeline stages (msprobe
numbers each model chunk of a rank ``Module.<chunk>.``, with its own local layer numbers).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from crossalign.config import AlignmentConfig, ModelConfig
from crossalign.diagnose.hooks import DEFAULT_STRIP_PREFIXES, strip_wrapper_prefixes
from crossalign.diagnose.msprobe_dump import OPTIONS, SIDE_NAMES, MsprobeDumpError, RankDump, StepDump
from crossalign.diagnose.msprobe_shards import SideLayout
from crossalign.models.layout import megatron_shapes, mindformers_buffers, mindformers_shapes
from crossalign.sides.megatron.sharding import is_routed_expert, mindformers_split_dim, partition_of, shard_shapes
from crossalign.sides.megatron.te_local import te_to_local_names
from crossalign.tensorio.errors import CheckpointError

SECTIONS = {"mindspore": "mindformers", "megatron": "megatron"}  # each side's layout: parallel.<section>
_CHUNK = re.compile(r"^(\d+)\.")  # msprobe's index of a model chunk (Megatron) or stage (MindFormers) in a list
_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\..*)$")
_MS_EXPERTS = re.compile(r"\.mlp\.experts\.weight[12]$")
_EXPERT_NUMBER = re.compile(r"\.mlp\.experts\.(?:local_experts\.(\d+)\.|linear_fc[12]\.weight(\d+)$)")
SHOWN = 4  # mismatches named in a message
FINAL_NORM = "decoder.final_layernorm.weight"  # on the last pipeline stage only, on both sides


class DumpFitError(MsprobeDumpError):
    """A dump that does not fit the config's model or layout; the message names the folder and what it implies."""


@dataclass
class RankParameters:
    """One rank folder's parameters as msprobe's names give them: wrappers dropped, layers numbered as on the rank,
    megatron-core's local-module names as they are."""

    folder: str
    rank: int
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    chunks: set[int] = field(default_factory=set)
    sequence_split: tuple[str, tuple[int, ...], tuple[int, ...]] | None = None  # a column-parallel linear's in/out


def _own(name: str) -> tuple[str, int]:
    """(the module's own name, msprobe's chunk index) of a dumped module path."""
    match = _CHUNK.match(name)
    chunk = int(match.group(1)) if match else 0
    own = strip_wrapper_prefixes(_CHUNK.sub("", name + "."), DEFAULT_STRIP_PREFIXES)[:-1]
    return own, chunk


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(n) for n in shape) + "]"


def _some(items: list[str]) -> str:
    more = len(items) - SHOWN
    return "; ".join(items[:SHOWN]) + (f"; and {more} more" if more > 0 else "")


def _global_name(name: str, offset: int) -> str:
    """A layer's parameter renumbered by ``offset`` (the number of a stage's first layer; negative: back)."""
    match = _LAYER.match(name)
    return name if not match or not offset else f"{match.group(1)}{int(match.group(2)) + offset}{match.group(3)}"


def _pattern(name: str) -> str:
    """A parameter's name with its layer number left out (``decoder.layers.*.``)."""
    match = _LAYER.match(name)
    return f"{match.group(1)}*{match.group(3)}" if match else name


def _layers(names) -> set[int]:
    return {int(m.group(2)) for name in names if (m := _LAYER.match(name))}


class SideModel:
    """The model's parameters as one side's dumps name them: whole shapes, the split rules of its layouts, and
    megatron-core's local-module names beside the TransformerEngine ones (``sides/megatron/te_local.py``)."""

    def __init__(self, side: str, model: ModelConfig, core_version: str):
        self.side, self.model = side, model
        if side == "megatron":
            self.whole = megatron_shapes(model, core_version)
            self.local = {local: te for te, local in te_to_local_names(model, core_version).items()}
        else:
            self.whole = {**mindformers_shapes(model), **mindformers_buffers(model)}
            self.local = {}
        self.patterns: dict[str, set[tuple[int, ...]]] = {}
        self.te_patterns: dict[str, str] = {}  # a local name's pattern -> a TransformerEngine one (same split rule)
        for name, key in {**dict(zip(self.whole, self.whole)), **self.local}.items():
            self.patterns.setdefault(_pattern(name), set()).add(self.whole[key])
            self.te_patterns.setdefault(_pattern(name), _pattern(key))

    def te_name(self, name: str, offset: int = 0) -> str:
        """The TransformerEngine name of a parameter named as on a rank whose first layer is global ``offset``
        (a layer's kind decides the name of its fused norm), numbered as on the rank."""
        global_name = _global_name(name, offset)
        return _global_name(self.local.get(global_name, global_name), -offset)

    def rule_name(self, name: str) -> str:
        """A name under which the split rules know a parameter, whatever its layer's kind."""
        pattern = self.te_patterns.get(_pattern(name))
        match = _LAYER.match(name)
        return pattern.replace("*", match.group(2), 1) if pattern and match else (pattern or name)

    def routed(self, key: str) -> bool:
        return is_routed_expert(key) if self.side == "megatron" else bool(_MS_EXPERTS.search(key))

    def split_dim(self, key: str, shape: tuple[int, ...]) -> int | None:
        """The axis the ranks split a parameter along (None: replicated); routed experts: their own axis."""
        if self.side != "megatron":
            return mindformers_split_dim(key, shape)
        try:
            return partition_of(key, len(shape), self.model).dim
        except CheckpointError:
            return None

    def split_ways(self, name: str, shape: tuple[int, ...], whole: tuple[int, ...]) -> tuple[int | None, int | None]:
        """(the axis ranks split a parameter along or None, how many ways ``shape`` splits ``whole`` there; None
        where another axis differs or it does not divide)."""
        key = self.rule_name(name)
        split = self.split_dim(key, whole)
        if len(shape) != len(whole) or any(n != m for d, (n, m) in enumerate(zip(shape, whole)) if d != split):
            return split, None
        if split is None:
            return None, 1
        n, m = shape[split], whole[split]
        return split, (m // n if n and m % n == 0 else None)


def rank_parameters(rank: RankDump, names: SideModel) -> RankParameters:
    """Every parameter a rank folder's forward and parameters_grad records hold, and a column-parallel linear's
    input and output shapes (Megatron gathers the sequence there under sequence parallelism)."""
    found = RankParameters(rank.path.name, rank.rank)
    for entry in rank.entries.values():
        if not entry.is_module:
            continue
        module, chunk = _own(entry.name)
        found.chunks.add(chunk)
        for pname, record in entry.parameters.items():
            found.shapes.setdefault(f"{module}.{pname}" if module else pname, record.shape)
        if (names.side == "megatron" and found.sequence_split is None and entry.direction == "forward"
                and "weight" in entry.parameters and entry.inputs and entry.outputs
                and len(entry.inputs[0].shape) == 3 and len(entry.outputs[0].shape) == 3
                and names.split_dim(names.rule_name(f"{module}.weight"), (1, 1)) == 0):
            found.sequence_split = (module, entry.inputs[0].shape, entry.outputs[0].shape)
    return found


# ---- the model --------------------------------------------------------------------------------------------------


def model_problems(params: RankParameters, names: SideModel, first: bool) -> list[str]:
    """What in one rank's parameters the model does not have, whatever the layout: names (layer numbers aside), a
    layer or routed expert number beyond the model's, widths no layout splits, a tensor split different ways by
    different weights, and (on the first rank, where it holds both ends of the model) another number of layers."""
    model = names.model
    foreign, widths, ways = [], [], {}
    for name, shape in params.shapes.items():
        candidates = names.patterns.get(_pattern(name), set())
        layer, expert = _LAYER.match(name), _EXPERT_NUMBER.search(name)
        number = int(expert.group(1) or expert.group(2)) if expert else None
        if not candidates or (layer and int(layer.group(2)) >= model.num_layers) or (
                number is not None and number >= (model.num_experts or 0)):
            foreign.append(f"{name} {_shape(shape)}")
            continue
        fits = [(whole, *names.split_ways(name, shape, whole)) for whole in sorted(candidates)]
        fits = [fit for fit in fits if fit[2] is not None]
        if not fits:
            widths.append(f"{name} is {_shape(shape)}, the model's {' or '.join(map(_shape, sorted(candidates)))}")
        elif fits[0][1] is not None and not names.routed(names.rule_name(name)):
            ways.setdefault(fits[0][2], []).append(f"{name} {_shape(shape)} of {_shape(fits[0][0])}")
    problems = []
    if foreign:
        problems.append(f"{params.folder} holds parameters the model does not have: {_some(foreign)}")
    if widths:
        problems.append(f"{params.folder} holds parameters of other widths: {_some(widths)}")
    if len(ways) > 1:
        usual = max(ways, key=lambda count: len(ways[count]))
        odd = [f"{text} (1/{count})" for count, texts in ways.items() if count != usual for text in texts]
        problems.append(f"{params.folder} holds {len(ways[usual])} weights at 1/{usual} of the model's widths, but "
                        f"{_some(odd)}: widths of another model")
    layers = _layers(params.shapes)
    if first and FINAL_NORM in params.shapes and len(layers) != model.num_layers:
        # the first rank is the first pipeline stage: holding the final norm, it holds the last stage too
        problems.append(f"{params.folder} holds the first pipeline stage and the final norm (the last stage) and "
                        f"{len(layers)} decoder layers: a model of {len(layers)} layers, the config's has "
                        f"{model.num_layers}")
    return problems


# ---- the layout -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """The sizes of a layout that a dump shows (None: the dump does not tell)."""

    tensor: int | None = None
    pipeline: int | None = None
    expert: int | None = None
    expert_tensor: int | None = None
    sequence_parallel: bool | None = None
    cards: int | None = None

    def __str__(self) -> str:
        parts = [f"{name} {value}" for name, value in (("TP", self.tensor), ("PP", self.pipeline),
                                                        ("EP", self.expert), ("ETP", self.expert_tensor))
                 if value is not None]
        text = " x ".join(parts) or "no split it can tell"
        text += " + SP" if self.sequence_parallel else ""
        return text + (f" on {self.cards} card{'s' if self.cards != 1 else ''}" if self.cards else "")


def expected_shards(names: SideModel, layout) -> dict[tuple[int, int, int], dict[str, tuple[int, ...]]]:
    """The parameters the config's layout gives each (tensor rank, stage, expert rank), named as on that rank (its
    stage's layers from 0, its routed experts numbered locally on the Megatron side), with their shapes."""
    model = names.model
    cut = SideLayout.of(layout)
    found: dict[tuple[int, int, int], dict[str, tuple[int, ...]]] = {}
    if names.side == "megatron":
        for key, shape in names.whole.items():
            for coordinates, local, local_shape in shard_shapes(key, shape, model, cut.tensor, cut.pipeline,
                                                                cut.expert, layout.expert_tensor_size):
                found.setdefault(coordinates, {})[local] = local_shape
        return found
    per_stage = model.num_layers // cut.pipeline
    for key, shape in names.whole.items():
        match = _LAYER.match(key)
        stage = int(match.group(2)) // per_stage if match else 0 if key.startswith("embedding.") else cut.pipeline - 1
        local = list(shape)
        if _MS_EXPERTS.search(key):
            local[0] //= cut.expert
        elif (dim := mindformers_split_dim(key, shape)) is not None:
            local[dim] //= cut.tensor
        for tensor_rank in range(cut.tensor):
            for expert_rank in range(cut.expert):
                found.setdefault((tensor_rank, stage, expert_rank), {})[
                    _global_name(key, -stage * per_stage)] = tuple(local)
    return found


def _coordinates(layout, rank: int) -> tuple[int, int, int]:
    """(tensor rank, pipeline stage, expert rank) of a global rank in ``layout``."""
    cut = SideLayout.of(layout)
    tensor_rank, stage, _ = cut.coordinates(rank)
    return tensor_rank, stage, cut.expert_coordinates(rank)[1]


def _ranges(numbers: set[int]) -> str:
    ordered = sorted(numbers)
    if len(ordered) > 1 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}-{ordered[-1]}"
    return ", ".join(str(n) for n in ordered)


def _experts_per_layer(shapes: dict[str, tuple[int, ...]]) -> Counter:
    """Megatron's routed experts (``...mlp.experts.linear_fc1.weight{j}``) per MoE layer."""
    counts: Counter = Counter()
    for name in shapes:
        if is_routed_expert(name) and ".linear_fc1." in name and name[-1].isdigit():
            counts[name.rpartition(".mlp.experts.")[0]] += 1
    return counts


def layout_problems(params: RankParameters, names: SideModel, layout, expected: dict[str, tuple[int, ...]]
                    ) -> list[str]:
    """Where one rank's parameters are not the shards the config's layout gives it (``expected``): other shapes,
    parameters of other ranks (layers of another stage, experts of another expert rank), fewer layers or experts."""
    offset = _coordinates(layout, params.rank)[1] * (names.model.num_layers // layout.pipeline)
    held = {names.te_name(name, offset): shape for name, shape in params.shapes.items()}
    problems = []
    shapes = [f"{name} {_shape(shape)} (the layout's shard: {_shape(expected[name])})"
              for name, shape in held.items() if name in expected and expected[name] != shape]
    if shapes:
        problems.append(f"{params.folder} holds shards of other shapes: {_some(shapes)}")
    elsewhere = [name for name in held if name not in expected]
    if elsewhere:
        problems.append(f"{params.folder} holds parameters the layout puts on other ranks: {_some(elsewhere)}")
    dumped, wanted = _layers(held), _layers(expected)
    if dumped and dumped < wanted:
        problems.append(f"{params.folder} holds decoder layers {_ranges(dumped)}; the layout gives it "
                        f"{_ranges(wanted)}")
    experts, should = _experts_per_layer(held), _experts_per_layer(expected)
    short = sorted(layer for layer, count in experts.items() if count < should.get(layer, 0))
    if short:
        problems.append(f"{params.folder} holds {experts[short[0]]} routed experts in {short[0]}; the layout gives "
                        f"it {should[short[0]]}")
    return problems


def implied_layout(ranks: list[RankParameters], names: SideModel) -> tuple[Layout, list[str]]:
    """The layout the dump's first rank folder (the first pipeline stage) and its number of folders show, and the
    evidence of each size."""
    model = names.model
    first = ranks[0]
    held = {names.te_name(name): shape for name, shape in first.shapes.items()}
    evidence: list[str] = []
    tensor = expert_tensor = expert = pipeline = None
    for name, shape in held.items():
        whole = names.whole.get(name)
        if whole is None:
            continue
        split, ways = names.split_ways(name, shape, whole)
        if split is None or ways is None:
            continue
        what = f"{first.folder} {name} is {_shape(shape)} of the model's {_shape(whole)}"
        routed = names.routed(name)
        if routed and names.side == "mindspore" and expert is None:
            expert = ways
            evidence.append(f"{what}: EP {ways}")
        elif routed and names.side == "megatron" and expert_tensor is None:
            expert_tensor = ways
            evidence.append(f"{what}: ETP {ways}")
        elif not routed and tensor is None:
            tensor = ways
            evidence.append(f"{what}: TP {ways}")
    counts = _experts_per_layer(held)
    if names.side == "megatron" and counts:
        layer, count = next(iter(counts.items()))
        if model.num_experts % count == 0:
            expert = model.num_experts // count
            evidence.append(f"{first.folder} holds {count} of the {model.num_experts} routed experts of {layer}: "
                            f"EP {expert}")
    layers = _layers(held)
    if FINAL_NORM in held:
        pipeline = 1  # the first rank is the first pipeline stage, and holds the last one too
    elif layers and model.num_layers % len(layers) == 0:
        pipeline = model.num_layers // len(layers)
        evidence.append(f"{first.folder} holds {len(layers)} of the {model.num_layers} decoder layers and not the "
                        f"final norm: PP {pipeline}")
    sequence_parallel = False if tensor == 1 else None  # nothing to split the sequence over
    if first.sequence_split is not None and tensor is not None and tensor > 1:
        module, inputs, outputs = first.sequence_split
        sequence_parallel = outputs[0] == inputs[0] * tensor
        evidence.append(f"{first.folder} {module} takes {_shape(inputs)} and gives {_shape(outputs)}: "
                        f"{'sequence parallel' if sequence_parallel else 'no sequence parallelism'}")
    cards = max(r.rank for r in ranks) + 1
    return Layout(tensor, pipeline, expert, expert_tensor, sequence_parallel, cards), evidence


def _settings(side: str, implied: Layout, layout) -> list[str]:
    """The ``--set`` options that make the config's layout say what the dump implies."""
    section = f"parallel.{SECTIONS[side]}"
    wanted = {"tensor": implied.tensor, "pipeline": implied.pipeline, "expert": implied.expert,
              "sequence_parallel": implied.sequence_parallel}
    current = {"tensor": layout.tensor, "pipeline": layout.pipeline, "expert": layout.expert,
               "sequence_parallel": layout.sequence_parallel}
    if side == "megatron" and implied.expert_tensor is not None:
        wanted["expert_tensor"] = implied.expert_tensor
        # unset, Megatron's expert tensor size is the tensor size: the one the config will say
        current["expert_tensor"] = layout.expert_tensor or implied.tensor or layout.tensor
    options = [f"--set {section}.{key}={str(value).lower()}" for key, value in wanted.items()
               if value is not None and value != current[key]]
    if implied.cards is not None and implied.cards > layout.world_size and layout.nodes == 1:
        options.append(f"--set {section}.cards_per_node={implied.cards}")
    return options


def unmerged_settings(layout, section: str, ranks: list[RankParameters]) -> list[str]:
    """The settings, stated by the config or shown by the dump, whose dumps are not merged."""
    found = []
    if layout.context != 1:
        found.append(f"parallel.{section}.context is {layout.context}: context-parallel dumps are not merged (each "
                     f"rank holds two chunks of every sequence, in the load-balanced order)")
    if layout.virtual_layers:
        found.append(f"parallel.{section}.virtual_pipeline_layers is {layout.virtual_layers}: dumps of virtual "
                     f"pipeline stages are not merged (each model chunk numbers its layers from 0)")
    chunked = [f"{r.folder} (chunks {sorted(r.chunks)})" for r in ranks if max(r.chunks, default=0) > 0]
    if chunked:
        found.append(f"the dump holds several model chunks in a rank, {', '.join(chunked)}: virtual pipeline "
                     f"stages are not merged")
    return found


def check_side(step: StepDump, config: AlignmentConfig, side: str) -> list[str]:
    """Problems of one side's dump against the config (empty: it fits): settings whose dumps are not merged, then
    the model (names, widths, layers), then the layout (rank folders, shards)."""
    option, framework, section = OPTIONS[step.framework], SIDE_NAMES[step.framework], SECTIONS[side]
    model = config.model
    layout = config.parallel.megatron if side == "megatron" else config.parallel.mindformers
    names = SideModel(side, model, config.training.megatron_core_version)
    ranks = [rank_parameters(step.ranks[r], names) for r in sorted(step.ranks)]
    where = f"{option} {step.path}"
    unmerged = unmerged_settings(layout, section, ranks)
    if unmerged:
        return [f"{where}: " + "; ".join(unmerged)]
    different = [problem for params in ranks for problem in model_problems(params, names, params is ranks[0])]
    if different:
        return [f"{where} is not a dump of the config's model {model.name} ({_describe(model)}): "
                + "; ".join(different) + ": different models"]
    misfits = []
    beyond = [r.folder for r in ranks if r.rank >= layout.world_size]
    if beyond:
        misfits.append(f"{', '.join(beyond)} {'is not a rank' if len(beyond) == 1 else 'are not ranks'} of the "
                       f"config's layout ({layout.world_size} card{'s' if layout.world_size > 1 else ''})")
    shards = expected_shards(names, layout)
    misfits += [problem for params in ranks if params.rank < layout.world_size
                for problem in layout_problems(params, names, layout,
                                               shards.get(_coordinates(layout, params.rank), {}))]
    if not misfits:
        return []
    implied, evidence = implied_layout(ranks, names)
    text = (f"{where}: the {framework} dump does not fit the config's layout parallel.{section} ({layout.ranks}). "
            f"It implies {implied}: {len(ranks)} rank folder{'s' if len(ranks) > 1 else ''} ("
            + ", ".join(r.folder for r in ranks) + ")" + "".join(f"; {line}" for line in evidence)
            + ". What does not fit: " + "; ".join(misfits))
    options = _settings(side, implied, layout)
    if options:
        text += f". Pass {' '.join(options)}"
    return [text]


def _describe(model: ModelConfig) -> str:
    ffn = f"MoE, {model.num_experts} experts" if model.is_moe else "dense"
    return f"{ffn}, {model.num_layers} layers, hidden {model.hidden_size}"


def check_pair(npu: StepDump, gpu: StepDump, config: AlignmentConfig) -> None:
    """Both sides held against the config; :class:`DumpFitError` naming every problem, nothing written."""
    problems = check_side(npu, config, "mindspore") + check_side(gpu, config, "megatron")
    if problems:
        raise DumpFitError("\n".join(problems))
