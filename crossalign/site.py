"""The site config: where this installation keeps its runs and finds the real frameworks.

Every field is explained in ``crossalign.site.example.yaml`` at the top of the repository.
One YAML file per site (``crossalign.site.yaml`` in the working directory, or the path in
``CROSSALIGN_SITE``; ``CROSSALIGN_STORE`` overrides its store). Without one, everything runs embedded on this machine: the run store is
``./runs`` and both training sides use the CPU backends.

```yaml
store: /mnt/shared/crossalign-runs      # every agent mounts the same path
backends: {npu: mindformers, gpu: megatron}
mindformers:
  path: /opt/mindformers                # a MindFormers fork with Qwen3.5 (public MindFormers has none)
  qwen35_class: PyNativeQwen35ForCausalLM    # its Qwen3.5 pynative training class (qwen35_moe_class: its MoE one)
  python: /usr/local/python3.9/bin/python3   # the framework's own interpreter
  nproc_per_node: 8
  env: {ASCEND_RT_VISIBLE_DEVICES: "0,1,2,3,4,5,6,7"}
megatron:
  path: /opt/Megatron-LM
  python: /opt/conda/bin/python
  nproc_per_node: 8
  ssh_host: gpu01                       # run there over SSH instead of locally
ssh_hosts:
  gpu01: {hostname: 10.0.0.12, username: train, key_file: ~/.ssh/id_ed25519}
```

A framework that names an ``ssh_host`` runs its training script there (``bash <step>/run_*.sh``
in ``workdir``, with the framework's own ``python``), so that host must mount the store at the
same path; the Prefect worker stays on a machine that can run Python 3.11.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from crossalign.dump_settings import DumpSettings

SITE_ENV = "CROSSALIGN_SITE"
STORE_ENV = "CROSSALIGN_STORE"  # overrides the site's store (agents set it for the flow runs they start)
HOME_ENV = "CROSSALIGN_HOME"  # where this machine keeps crossalign's own state (default: see machine_home)
TINY_CONFIGS = ("qwen35_dense_tiny", "qwen35_moe_tiny")
DEFAULT_SITE_FILE = "crossalign.site.yaml"
STEP_SETUP_S = 3600.0  # the part of a step's default timeout that does not grow with its iterations


class SiteError(ValueError):
    """A site config that cannot be used, with the file and field named."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SshHost(_Strict):
    hostname: str
    port: int = 22
    username: str | None = None
    key_file: Path | None = None
    known_hosts: Path | None = Field(default=None, description="default: ~/.ssh/known_hosts; unknown keys are refused")
    connect_timeout_s: float = Field(default=15.0, gt=0)


class FrameworkSite(_Strict):
    """One real framework: its checkout, its interpreter, how many devices per node, where it runs."""

    path: Path | None = None
    python: str = "python3"
    nproc_per_node: int = Field(default=1, gt=0)
    env: dict[str, str] = Field(default_factory=dict)
    ssh_host: str | None = None
    workdir: Path | None = Field(default=None, description="working directory on the remote host")


class MindFormersSite(FrameworkSite):
    """The MindFormers fork. Public MindFormers has no Qwen3.5 model, so the site names the fork's classes."""

    qwen35_class: str | None = Field(default=None, description="the fork's Qwen3.5 pynative training class, "
                                     "e.g. PyNativeQwen35ForCausalLM (the loss-logging patch goes there)")
    qwen35_moe_class: str | None = Field(default=None, description="its MoE class, if the fork has a separate one")

    @property
    def qwen35_classes(self) -> tuple[str, ...]:
        return tuple(name for name in (self.qwen35_class, self.qwen35_moe_class) if name)


class DiagnoseSite(_Strict):
    dump: DumpSettings | None = Field(default=None, description="msprobe dumps of both real trainings at one "
                                      "iteration (crossalign rerun --dump turns them on for one re-run)")


class NightlySite(_Strict):
    """The nightly regression run (prefect.yaml's nightly deployment): what it aligns, and in which time zone its
    schedule (02:00 every night) is set."""

    configs: tuple[str, ...] = Field(default=TINY_CONFIGS, min_length=1, description="the configs aligned every "
                                     "night (shipped names or YAML paths)")
    timezone: str | None = Field(default=None, description="the IANA time zone of the nightly's 02:00; default: "
                                 "the zone of the machine `crossalign deploy` runs on")

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                ZoneInfo(value)
            except (ZoneInfoNotFoundError, ValueError):
                raise ValueError(f"{value!r} is not an IANA time zone (Asia/Shanghai, Europe/Berlin, UTC)") from None
        return value


class SiteConfig(_Strict):
    store: Path = Path("runs")
    backends: dict[Literal["npu", "gpu"], Literal["local", "mindformers", "megatron"]] = Field(
        default_factory=lambda: {"npu": "local", "gpu": "local"}
    )
    mindformers: MindFormersSite = Field(default_factory=MindFormersSite)
    megatron: FrameworkSite = Field(default_factory=FrameworkSite)
    ssh_hosts: dict[str, SshHost] = Field(default_factory=dict)
    prefect_api_url: str | None = None
    report_url: str | None = Field(default=None, description="where `crossalign serve` publishes the store over "
                                   "HTTP, e.g. http://reports.example:8080/; artifacts and alerts link there")
    step_timeout_s: float | None = Field(default=None, gt=0, description="give up on (and retry) a step whose flow "
                                         "run has been running this long; default: derived from the run's config, "
                                         "see iteration_timeout_s")
    iteration_timeout_s: float = Field(default=120.0, gt=0, description="the most one training iteration may "
                                       "take: a step's default timeout is an hour plus this per iteration it trains")
    diagnose: DiagnoseSite = Field(default_factory=DiagnoseSite)
    fail_fast: bool = Field(default=True, description="stop both alignment trainings as soon as what they logged "
                            "cannot pass any more (false: they always finish and step 6 judges)")
    nightly: NightlySite = Field(default_factory=NightlySite)
    server_data: Path | None = Field(default=None, description="`crossalign server start`'s home and PostgreSQL "
                                     "cluster; default: this site's folder on the machine (site_home)")
    convert_parts: int = Field(default=1, ge=1, description="the parts (layer ranges) a torch_dist convert step is "
                               "spread over: each a flow run on the cpu pool, at the same time on its workers")

    @field_validator("report_url")
    @classmethod
    def _check_report_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"{value!r} is not an http:// or https:// URL")
        return value

    @model_validator(mode="after")
    def _check_backends(self) -> "SiteConfig":
        allowed = {"npu": ("local", "mindformers"), "gpu": ("local", "megatron")}
        for pool, kind in self.backends.items():
            if kind not in allowed[pool]:
                raise ValueError(f"backends.{pool}: {kind!r} cannot train on the {pool} pool "
                                 f"(choose {' or '.join(allowed[pool])})")
        return self

    def step_timeout(self, step: str, iterations: int) -> float:
        """Seconds a step's flow run may run: ``step_timeout_s``, else an hour of setup (imports, checkpoint
        loading, compilation) plus ``iteration_timeout_s`` per training iteration of the step."""
        if self.step_timeout_s is not None:
            return self.step_timeout_s
        return STEP_SETUP_S + iterations * self.iteration_timeout_s

    def framework(self, pool: str) -> FrameworkSite | None:
        """The real framework a pool's training steps use, or None where they run embedded (or the pool trains nothing)."""
        if pool == "npu" and self.backends.get("npu") == "mindformers":
            return self.mindformers
        if pool == "gpu" and self.backends.get("gpu") == "megatron":
            return self.megatron
        return None

    def ssh_host(self, name: str) -> SshHost:
        try:
            return self.ssh_hosts[name]
        except KeyError:
            known = ", ".join(sorted(self.ssh_hosts)) or "none"
            raise SiteError(f"ssh host {name!r} is not defined in ssh_hosts (defined: {known})") from None


def machine_timezone() -> str:
    """The IANA name of this machine's time zone: $TZ, else the zone /etc/localtime links to, else /etc/timezone's,
    else UTC."""
    localtime = Path("/etc/localtime")
    candidates = [os.environ.get("TZ", "").removeprefix(":"),
                  str(localtime.resolve()).partition("zoneinfo/")[2] if localtime.is_symlink() else "",
                  Path("/etc/timezone").read_text().strip() if Path("/etc/timezone").is_file() else ""]
    for name in candidates:
        try:
            if name:
                ZoneInfo(name)
                return name
        except (ZoneInfoNotFoundError, ValueError):
            continue
    return "UTC"


def machine_home() -> Path:
    """Where this machine keeps crossalign's own state: $CROSSALIGN_HOME, else /var/lib/crossalign as root (the
    PostgreSQL of `server start` runs as its own user, which must reach it), else ~/.crossalign."""
    if os.environ.get(HOME_ENV):
        return Path(os.environ[HOME_ENV]).expanduser().absolute()
    return Path("/var/lib/crossalign") if os.geteuid() == 0 else Path.home() / ".crossalign"


def site_home(site_file: Path | None) -> Path:
    """This machine's folder of one site: ``machine_home()/sites/<name>-<hash>``, named after the site file's
    folder (the checkout of the one-machine recipe) and keyed by the file's path, or by the working directory
    without a site file. The server's data (unless the site's ``server_data`` says otherwise) and the record of
    what `crossalign down` ends live there, so two checkouts never share them."""
    anchor = Path(site_file).resolve() if site_file is not None else Path.cwd().resolve()
    folder = anchor.parent if site_file is not None else anchor
    key = hashlib.sha256(str(anchor).encode()).hexdigest()[:8]
    return machine_home() / "sites" / f"{folder.name or 'root'}-{key}"


def site_path() -> Path | None:
    """The site file in use: $CROSSALIGN_SITE, else ./crossalign.site.yaml if present, else none."""
    if os.environ.get(SITE_ENV):
        return Path(os.environ[SITE_ENV])
    local = Path(DEFAULT_SITE_FILE)
    return local if local.exists() else None


def load_site(path: str | Path | None = None) -> SiteConfig:
    """Read the site config; with no file, the embedded defaults. $CROSSALIGN_STORE overrides the store."""
    site = _read_site(Path(path) if path is not None else site_path())
    if os.environ.get(STORE_ENV):
        site = site.model_copy(update={"store": Path(os.environ[STORE_ENV])})
    return site


def _read_site(path: Path | None) -> SiteConfig:
    if path is None:
        return SiteConfig()
    if not path.exists():
        raise SiteError(f"{path}: site config not found")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
        site = SiteConfig.model_validate(raw)
    except yaml.YAMLError as exc:
        raise SiteError(f"{path}: not valid YAML: {exc}") from exc
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise SiteError(f"{path}: invalid site config: {problems}") from None
    for framework in (site.mindformers, site.megatron):
        if framework.ssh_host is not None:
            try:
                site.ssh_host(framework.ssh_host)
            except SiteError as exc:
                raise SiteError(f"{path}: {exc}") from None
    return site
