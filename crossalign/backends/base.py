"""The contract between the DAG's training steps and whatever carries them out.

A step builds a :class:`TrainRequest`; a backend trains and returns a :class:`TrainResult`.
The embedded CPU backends (``backends/local``) and the real ones (``backends/megatron.py``,
``backends/mindformers.py``) take the same request, so a step never knows where it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Protocol

from crossalign.config import AlignmentConfig
from crossalign.launch_files import DatasetFiles

Side = Literal["mindformers", "megatron"]
Mode = Literal["base", "align"]

# on_step(step, total_steps, metrics) is called after every optimizer step, for progress bars and Prefect.
StepCallback = Callable[[int, int, dict[str, float]], None]


@dataclass
class TrainRequest:
    config: AlignmentConfig
    side: Side
    mode: Mode  # "base": random init, base_train_iters, save; "align": from init_checkpoint, train_iters
    data: DatasetFiles
    output_dir: Path  # the trainer writes train.log here, and checkpoint/ when save is set
    init_checkpoint: Path | None = None  # MindFormers checkpoint dir (mindformers) / Megatron dir (megatron)
    save: bool = False
    on_step: StepCallback | None = None
    extra: dict[str, object] = field(default_factory=dict)
    published_dir: Path | None = None  # where output_dir ends up once the step commits (paths in logs name it)

    @property
    def iterations(self) -> int:
        t = self.config.training
        return t.base_train_iters if self.mode == "base" else t.train_iters

    @property
    def named_output_dir(self) -> Path:
        """The output folder as logs and scripts should name it: where it ends up, not where it is staged."""
        return self.published_dir or self.output_dir

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


class TrainBackend(Protocol):
    name: str

    def train(self, request: TrainRequest) -> TrainResult: ...
