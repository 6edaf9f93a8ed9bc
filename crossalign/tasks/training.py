"""What the three training steps share: build the request, pick the backend, commit log and checkpoint.

The two alignment trainings (steps 4 and 5) honour a stop request of the live comparison before
they start and after every iteration (``crossalign.stop``); a training that ends without
committing keeps its log in the run's ``live/`` folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from crossalign.sides.protocol import Mode, SideName, StepCallback, TrainRequest
from crossalign.site import SiteConfig
from crossalign.store import Run
from crossalign.tasks.backends import TrainingPool, training_backend
from crossalign.tasks.command import step_command
from crossalign.stop import STOPPABLE, check_stop, keep_log, stopping


def train_step(run: Run, step: str, *, pool: TrainingPool, side: SideName, mode: Mode, site: SiteConfig,
               init_checkpoint: Path | None, save: bool, on_step: StepCallback | None) -> dict[str, Any]:
    backend = training_backend(pool, site)
    stoppable = step in STOPPABLE
    with run.commit(step, command=step_command(run, step)) as out:
        if stoppable:
            check_stop(run, step)
            on_step = stopping(run, step, on_step)
        request = TrainRequest(config=run.config, side=side, mode=mode, data=run.dataset, output_dir=out.dir,
                               init_checkpoint=init_checkpoint, save=save, on_step=on_step,
                               published_dir=out.final_dir)
        try:
            result = backend.train(request)
        except BaseException:
            if stoppable:
                keep_log(run, step, request.log_path)
            raise
        describe = getattr(backend, "implementation", None)  # the embedded backends say what trains and how
        out.details.update(backend=backend.name, implementation=describe(run.config) if describe else backend.name,
                           iterations=result.iterations, train_seconds=round(result.seconds, 3),
                           loaded_tensors_verified=result.loaded_tensors_verified,
                           log=result.log_path.relative_to(out.dir).as_posix(),
                           checkpoint=None if result.checkpoint_dir is None
                           else result.checkpoint_dir.relative_to(out.dir).as_posix())
    return run.manifest(step)
