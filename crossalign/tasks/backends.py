"""Which trainer carries out a training step, per pool, from the site config.

``local`` is the side's embedded CPU stand-in (on NPU our Qwen3.5 in MindSpore; on GPU megatron-core
itself, on CPU); ``mindformers`` and ``megatron`` are the real frameworks on NPU and GPU machines. A
real backend writes a run script into the step folder and hands it to a runner: run here by default,
or over SSH on the framework's ``ssh_host`` (which mounts the same store).
"""

from __future__ import annotations

from typing import Literal

from crossalign.agents.ssh import SshRunner
from crossalign.sides.protocol import TrainBackend
from crossalign.sides.registry import side_of_pool
from crossalign.site import SiteConfig, SiteError

TrainingPool = Literal["npu", "gpu"]


def training_backend(pool: TrainingPool, site: SiteConfig) -> TrainBackend:
    side = side_of_pool(pool)
    kind = site.backends.get(pool, "local")
    if kind == "local":
        return side.embedded_backend()
    if kind != side.name:
        raise SiteError(f"backends.{pool}: {kind!r} cannot train on the {pool} pool")
    framework = getattr(site, side.name)
    if framework.ssh_host is None:
        return side.real_backend(site)
    return side.real_backend(site, SshRunner(site.ssh_host(framework.ssh_host)).script_runner(workdir=framework.workdir))
