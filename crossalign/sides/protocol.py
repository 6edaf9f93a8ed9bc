"""What both framework sides meet: the training contract, and the small protocol of a side.

A step builds a :class:`TrainRequest`; a backend trains and returns a :class:`TrainResult`. Each side
(``sides/megatron``, ``sides/mindformers``) has an embedded CPU backend and the real one, which take the
same request, so a step never knows where it runs. Everything else shared code asks of a side goes
through :class:`Side` (``sides/registry.py`` holds the two).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Literal, Protocol

from crossalign.config import AlignmentConfig, TrainingConfig
from crossalign.data.files import DatasetFiles
from crossalign.data.settings import SampleOrderSettings
from crossalign.dump_settings import DumpRecord, DumpSettings, write_msprobe_config
from crossalign.sides.readings import Reading

if TYPE_CHECKING:
    from crossalign.site import SiteConfig
    from crossalign.sides.launch import Runner

SideName = Literal["mindformers", "megatron"]
Pool = Literal["npu", "gpu"]
Mode = Literal["base", "align"]

# on_step(step, total_steps, metrics) is called after every optimizer step, for progress bars and Prefect.
StepCallback = Callable[[int, int, dict[str, float]], None]


@dataclass
class TrainRequest:
    config: AlignmentConfig
    side: SideName
    mode: Mode  # "base": random init, base_train_iters, save; "align": from init_checkpoint, train_iters
    data: DatasetFiles
    output_dir: Path  # the trainer writes train.log here, and checkpoint/ when save is set
    init_checkpoint: Path | None = None  # MindFormers checkpoint dir (mindformers) / Megatron dir (megatron)
    save: bool = False
    on_step: StepCallback | None = None
    extra: dict[str, object] = field(default_factory=dict)
    published_dir: Path | None = None  # where output_dir ends up once the step commits (paths in logs name it)
    dump: DumpSettings | None = None  # msprobe dumps this iteration into output_dir/msprobe_dump (DUMP_DIR)
    run_id: str | None = None  # the run the step belongs to, for the dump's record (None outside a run store)

    @property
    def iterations(self) -> int:
        t = self.config.training
        return t.base_train_iters if self.mode == "base" else t.train_iters

    @property
    def named_output_dir(self) -> Path:
        """The output folder as logs and scripts should name it: where it ends up, not where it is staged."""
        return self.published_dir or self.output_dir

    def write_dump_config(self) -> Path:
        """msprobe's ``config.json`` of this request's dump and, beside it, the record of the run each dumping rank
        writes into its rank folder (``dump_settings.write_msprobe_config``); returns the config's path."""
        if self.dump is None:
            raise ValueError("write_dump_config: this request asks for no dump")
        record = DumpRecord.of(self.config, self.side, self.run_id, self.dump.step)
        return write_msprobe_config(self.dump, self.output_dir, self.iterations, record)

    @property
    def log_path(self) -> Path:
        return self.output_dir / "train.log"

    @property
    def checkpoint_dir(self) -> Path:
        return self.output_dir / "checkpoint"


@dataclass
class TrainResult:
    log_path: Path
    checkpoint_dir: Path | None
    iterations: int
    seconds: float
    loaded_tensors_verified: int | None = None  # tensors the step's load digest held against init_checkpoint
    details: dict = field(default_factory=dict)  # what the backend says of the run (device, kernels), for the manifest


class EnvironmentRefused(RuntimeError):
    """What a backend raises before training on a machine that would train wrong numbers (a kernel that disagrees
    with its reference): the run is ``invalid``, not ``fail`` (``crossalign.stop.record_refusal``). ``reason``:
    one line, "environment: ..."; ``details``: what was measured, one line each; ``facts``: the same as values."""

    def __init__(self, reason: str, details: list[str], **facts):
        super().__init__(reason + "".join(f"\n  {line}" for line in details))
        self.reason = reason
        self.details = details
        self.facts = facts


class TrainBackend(Protocol):
    name: str

    def train(self, request: TrainRequest) -> TrainResult: ...


ProgressLine = tuple[int, int, dict[str, float]]  # (step, total steps, metrics) of one logged step


class Side(Protocol):
    """One framework's knowledge, as the shared code (preflight, data, tasks, compare) asks for it."""

    name: SideName
    framework: str  # as people name it: "Megatron-LM", "MindFormers"
    pool: Pool  # the kind of machine its real backend trains on
    log_formats: tuple[str, ...]  # the log formats its parser reads (``crossalign.logs.detect_format``)

    def sample_order(self, training: TrainingConfig, num_samples: int | None = None) -> SampleOrderSettings:
        """The sample order of the launch this side generates for ``training``."""

    def launch_sample_order(self, path: Path) -> SampleOrderSettings:
        """The sample order a real launch file of this framework implies, with the framework's defaults."""

    def generated_readings(self, config: AlignmentConfig) -> dict[str, Reading]:
        """Every number-changing setting of the launch this side generates for ``config``, read back as the
        framework will run it (``crossalign preflight config`` lays the two sides' readings side by side)."""

    def progress(self, line: str) -> ProgressLine | None:
        """The step a line of this framework's training output reports, None for other lines."""

    def embedded_backend(self) -> TrainBackend:
        """The embedded CPU trainer of this side."""

    def real_backend(self, site: SiteConfig, runner: Runner | None = None) -> TrainBackend:
        """The real framework, launched as the site says (``runner``: where its run script runs)."""
