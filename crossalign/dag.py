"""The DAG of a run, in one table: each step's name, position, pool, side, inputs, timeout rule and function.

    1 base-train (npu) -> 2 cast-bf16 (cpu) -> 3 convert (cpu) -> 4 megatron-train (gpu)
                                   2 -> 5 pynative-train (npu);    4 + 5 -> 6 compare (cpu)

The run store (folders, input digests, invalidation), the tasks (which function carries a step out
and how a training step trains), the flows (where a step runs, its deployment, its time limit, the
two sides the live comparison watches) and the CLI (its tables) all read this table; none keeps a
list of steps of its own.

Step 1 of a run started from Hugging Face weights is not base training but their import, on the
cpu pool, training nothing: :func:`step_for` gives the spec that carries a step out for a run's
start, and everything that depends on it (pool, deployment, time limit, function) follows.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import Any, Callable, Literal, Mapping

from crossalign.config import TrainingConfig
from crossalign.sides.protocol import SideName

StepPool = Literal["npu", "cpu", "gpu"]


class UnknownStep(ValueError):
    """A step name (or folder name) that is not a step of the DAG."""


@dataclass(frozen=True)
class StepSpec:
    """One node of the DAG and how it is carried out.

    ``trains`` is the timeout rule: the iterations the step trains under a config's training
    section (None: it trains nothing). ``function`` is the step function, ``"module:name"``,
    called as ``fn(run, spec, site, on_step)`` (``crossalign.tasks.run_step``). ``deployment``
    names the step flow's deployment that runs it on its pool (prefect.yaml; default: the name).
    """

    name: str
    index: int
    pool: StepPool
    inputs: tuple[str, ...]
    title: str
    function: str
    side: SideName | None = None
    uses_dataset: bool = False
    trains: Callable[[TrainingConfig], int] | None = field(default=None, compare=False)
    deployment: str = ""

    def __post_init__(self) -> None:
        if not self.deployment:
            object.__setattr__(self, "deployment", self.name)

    @property
    def dirname(self) -> str:
        return f"{self.index:02d}-{self.name}"

    def iterations(self, training: TrainingConfig) -> int:
        """The iterations this step trains under ``training`` (0 for a step that trains nothing)."""
        return 0 if self.trains is None else self.trains(training)


# Functions are named, not imported: they commit through the run store, which reads this table.
TRAIN = "crossalign.tasks.training:train"

STEPS: tuple[StepSpec, ...] = (
    StepSpec("base-train", 1, "npu", (), "base train (MindFormers)", TRAIN, side="mindformers",
             uses_dataset=True, trains=attrgetter("base_train_iters")),
    StepSpec("cast-bf16", 2, "cpu", ("base-train",), "cast to bf16", "crossalign.tasks.cast_bf16:cast_bf16"),
    StepSpec("convert", 3, "cpu", ("cast-bf16",), "convert MindSpore -> Megatron", "crossalign.tasks.convert:convert"),
    StepSpec("megatron-train", 4, "gpu", ("convert",), "Megatron train", TRAIN, side="megatron",
             uses_dataset=True, trains=attrgetter("train_iters")),
    StepSpec("pynative-train", 5, "npu", ("cast-bf16",), "MindFormers pynative train", TRAIN, side="mindformers",
             uses_dataset=True, trains=attrgetter("train_iters")),
    StepSpec("compare", 6, "cpu", ("megatron-train", "pynative-train"), "compare losses",
             "crossalign.tasks.compare:compare"),
)
STEP_NAMES: tuple[str, ...] = tuple(s.name for s in STEPS)
StepName = Literal[STEP_NAMES]  # type: ignore[valid-type]

# step 1 of a run started from Hugging Face weights: their import, in base-train's place (same folder, inputs and
# digests, so nothing downstream changes), on the cpu pool
HF_IMPORT = replace(STEPS[0], pool="cpu", title="import of Hugging Face weights", side=None, trains=None,
                    function="crossalign.tasks.import_hf:import_hf", deployment="import-hf")


def step_spec(name: str) -> StepSpec:
    """The step called ``name`` (also accepts its folder name, ``03-convert``)."""
    for spec in STEPS:
        if name in (spec.name, spec.dirname):
            return spec
    raise UnknownStep(f"unknown step {name!r} (steps: {', '.join(STEP_NAMES)})")


def step_for(name: str, start: Mapping[str, Any]) -> StepSpec:
    """The spec that carries out step ``name`` of a run whose start (run.json's ``start``) is ``start``."""
    spec = step_spec(name)
    return HF_IMPORT if spec.index == 1 and start.get("from") == "huggingface" else spec


def downstream(name: str) -> list[str]:
    """``name`` and every step that reads from it, directly or not, in DAG order."""
    affected = {step_spec(name).name}
    for spec in STEPS:  # STEPS is topologically ordered
        if affected.intersection(spec.inputs):
            affected.add(spec.name)
    return [s for s in STEP_NAMES if s in affected]


# the two trainings the comparison (the last step) reads, one per side: megatron-train (gpu), pynative-train (npu)
COMPARED: tuple[StepSpec, ...] = tuple(step_spec(name) for name in STEPS[-1].inputs)
