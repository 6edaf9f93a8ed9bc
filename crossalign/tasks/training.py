"""The training steps (base-train, megatron-train, pynative-train): one function, told apart by their specs.

A step's spec says everything it trains with: its side and pool (the pool's backend in the site
config), and its input: a step without one trains from a random init for ``base_train_iters``
(``base``) and saves the checkpoint the next step casts; a step with one trains from that step's
checkpoint for ``train_iters`` (``align``) and only logs, its log being one side of the comparison.

The two alignment trainings (steps 4 and 5) honour a stop request of the live comparison before
they start and after every iteration (``crossalign.stop``); a training that ends without
committing keeps its log in the run's ``live/`` folder.
"""

from __future__ import annotations

from typing import Any

from crossalign.dag import StepSpec
from crossalign.dump_settings import DumpSettings, collected_dump
from crossalign.preflight import gpu_env
from crossalign.sides.protocol import EnvironmentRefused, StepCallback, TrainRequest
from crossalign.site import SiteConfig
from crossalign.stop import STOPPABLE, check_stop, keep_log, record_refusal, stopping
from crossalign.store import Run
from crossalign.tasks.backends import training_backend
from crossalign.tasks.command import step_command


def checked_gpu_environment(backend, config) -> list[gpu_env.Finding]:
    """Before a backend that trains in this process takes the GPU (the embedded megatron-core trainer with
    ``training.embedded_device`` cuda, or auto on a GPU machine): the GPU environment check, which raises
    ``GpuEnvironmentError`` (an ``EnvironmentRefused``: the run is invalid) naming each refused combination and its
    fix. Nothing on CPU."""
    device = getattr(backend, "device", None)
    if device is None or device(config) != "cuda":
        return []
    return gpu_env.require(gpu_env.read_environment(deterministic=config.training.deterministic, side="embedded"))


def train(run: Run, spec: StepSpec, site: SiteConfig, on_step: StepCallback | None = None) -> dict[str, Any]:
    backend = training_backend(spec.pool, site)
    base = not spec.inputs
    stoppable = spec.name in STOPPABLE
    with run.commit(spec.name, command=step_command(run, spec.name)) as out:
        if stoppable:
            check_stop(run, spec.name)
            on_step = stopping(run, spec.name, on_step)
        dump = dump_settings(run, spec.name, site) if stoppable else None
        request = TrainRequest(config=run.config, side=spec.side, mode="base" if base else "align", data=run.dataset,
                               output_dir=out.dir,
                               init_checkpoint=None if base else run.step_dir(spec.inputs[0]) / "checkpoint",
                               save=base, on_step=on_step, published_dir=out.final_dir, dump=dump,
                               run_id=run.run_id)
        try:
            environment = checked_gpu_environment(backend, run.config)
            result = backend.train(request)
        except BaseException as exc:
            if isinstance(exc, EnvironmentRefused):  # the run is invalid (crossalign.flows.refused)
                record_refusal(run, spec.name, exc)
            if stoppable:
                keep_log(run, spec.name, request.log_path)
            raise
        describe = getattr(backend, "implementation", None)  # the embedded backends say what trains and how
        out.details.update(backend=backend.name, implementation=describe(run.config) if describe else backend.name,
                           iterations=result.iterations, train_seconds=round(result.seconds, 3),
                           loaded_tensors_verified=result.loaded_tensors_verified, **result.details,
                           log=result.log_path.relative_to(out.dir).as_posix(),
                           checkpoint=None if result.checkpoint_dir is None
                           else result.checkpoint_dir.relative_to(out.dir).as_posix())
        if environment:  # what the GPU environment check found short of a refusal
            out.details["gpu_environment"] = [f.line() for f in environment if f.status != "ok"]
        if dump is not None:
            out.details["msprobe_dump"] = collected_dump(dump, out.dir)
    return run.manifest(spec.name)


def dump_settings(run: Run, step: str, site: SiteConfig) -> DumpSettings | None:
    """The msprobe dump an alignment training takes: what ``crossalign rerun --dump`` asked of this step, else
    the site's ``diagnose.dump``, else none."""
    asked = run.dump_request(step)
    return DumpSettings.model_validate(asked) if asked is not None else site.diagnose.dump


def dumping_steps(affected: list[str], settings: DumpSettings | None) -> list[str]:
    """The alignment trainings among ``affected`` (the steps a rerun redoes) that take the dump ``settings``; a
    dump asked of a rerun that redoes neither is refused (ValueError)."""
    if settings is None:
        return []
    dumped = [name for name in affected if name in STOPPABLE]
    if not dumped:
        raise ValueError(f"--dump: redoing {', '.join(affected)} trains neither {' nor '.join(STOPPABLE)}, the "
                         "steps that dump")
    return dumped


def request_dumps(run: Run, affected: list[str], settings: DumpSettings | None) -> list[str]:
    """Record in run.json what a rerun of ``affected`` dumps: its alignment trainings take ``settings``, or (None)
    only the site's diagnose.dump again. Returns the steps that dump."""
    dumped = dumping_steps(affected, settings)
    run.request_dump(affected, None)
    if settings is not None:
        run.request_dump(dumped, settings.model_dump(mode="json"))
    return dumped
