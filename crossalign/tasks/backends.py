"""Which trainer carries out a training step, per pool, from the site config.

``local`` is the embedded CPU stand-in (on NPU our Qwen3.5 in MindSpore; on GPU megatron-core itself, on
CPU; our PyTorch Qwen3.5 is a reference for selfcheck and diagnose, not a backend); ``mindformers`` and
``megatron`` are the real frameworks on NPU and GPU machines. The real backends are imported
only when a site asks for them, so a laptop never needs their dependencies. A real backend
writes a run script into the step folder and hands it to a runner: run here by default, or
over SSH on the framework's ``ssh_host`` (which mounts the same store).
"""

from __future__ import annotations

from typing import Literal

from crossalign.sides.protocol import TrainBackend
from crossalign.site import FrameworkSite, SiteConfig, SiteError

TrainingPool = Literal["npu", "gpu"]


def training_backend(pool: TrainingPool, site: SiteConfig) -> TrainBackend:
    kind = site.backends.get(pool, "local")
    if pool == "npu" and kind == "local":
        from crossalign.sides.mindformers.embedded.trainer import LocalMindFormersBackend

        return LocalMindFormersBackend()
    if pool == "gpu" and kind == "local":
        from crossalign.sides.megatron.embedded.trainer import LocalMegatronBackend

        return LocalMegatronBackend()
    if pool == "npu" and kind == "mindformers":
        from crossalign.sides.mindformers.backend import MindFormersBackend

        return MindFormersBackend(site, **_runner(site, site.mindformers))
    if pool == "gpu" and kind == "megatron":
        from crossalign.sides.megatron.backend import MegatronBackend

        return MegatronBackend(site, **_runner(site, site.megatron))
    raise SiteError(f"backends.{pool}: {kind!r} cannot train on the {pool} pool")


def _runner(site: SiteConfig, framework: FrameworkSite) -> dict:
    """The real backend's script runner: SSH to the framework's host where the site names one, else the default."""
    if framework.ssh_host is None:
        return {}
    from crossalign.agents.ssh import SshRunner

    return {"runner": SshRunner(site.ssh_host(framework.ssh_host)).script_runner(workdir=framework.workdir)}
