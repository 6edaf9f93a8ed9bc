"""The GPU environment check: known-bad combinations of torch, CUDA, Triton, fla, TransformerEngine,
megatron-core, causal-conv1d and the GPU, held before GPU hours are spent.

:func:`check` is a pure function of a :class:`GpuEnvironment` (versions, the GPU's compute capability, the
run's ``training.deterministic`` and which side trains); :func:`read_environment` fills one from this Python
(``gpu_env_read``), and the gpu agent's probe fills one from the framework's interpreter. Every entry of
:data:`KNOWN_ISSUES` cites where the trap is written down and names the fix. An entry that needs what the
machine cannot tell (no CUDA device: no compute capability) is *undecided*, with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from typing import Callable, Literal, Mapping

from packaging.version import Version

from crossalign.preflight import gpu_env_read
from crossalign.sides.protocol import EnvironmentRefused
from crossalign.versions import version_tuple

Side = Literal["real", "embedded"]
Status = Literal["refused", "warning", "ok", "undecided"]
READ_TIMEOUT_S = 300
READ_MARKER = "@@gpu_env@@"


class GpuEnvironmentError(EnvironmentRefused):
    """A known-bad combination, or an environment that could not be read: the run would fail late or train on wrong
    numbers. A training step that meets it refuses its machine, and the run is ``invalid`` with the reason."""

    def __init__(self, problem: str, details: list[str] | None = None):
        super().__init__(f"environment: {problem}", details or [])
        self.problem = problem + "".join(f"\n{line}" for line in details or [])


@dataclass(frozen=True)
class GpuEnvironment:
    """What the table is held against. Versions are distribution versions (None: not installed)."""

    torch: str | None = None
    cuda: str | None = None  # torch.version.cuda: the CUDA torch was built for (None: a CPU build)
    triton: str | None = None
    fla: str | None = None  # fla-core or flash-linear-attention
    tilelang: str | None = None
    transformer_engine: str | None = None
    megatron_core: str | None = None
    causal_conv1d: str | None = None
    capability: tuple[int, int] | None = None  # the GPU's (major, minor); None: no CUDA device seen
    device_name: str | None = None
    nvcc: bool | None = None  # whether fla would find an nvcc for TileLang's JIT (None: not read)
    fla_settings: Mapping[str, str] = field(default_factory=dict)  # FLA_TILELANG, FLA_DISABLE_BACKEND_DISPATCH
    import_errors: Mapping[str, str] = field(default_factory=dict)  # field -> why its modules do not import
    deterministic: bool = True  # training.deterministic: Megatron's --deterministic-mode
    side: Side = "embedded"  # "real": Megatron-LM with TransformerEngine; "embedded": local modules

    @classmethod
    def from_record(cls, record: Mapping, *, deterministic: bool, side: Side) -> "GpuEnvironment":
        capability = record.get("capability")
        return cls(**{name: record.get(name) for name in (*gpu_env_read.DISTRIBUTIONS, "cuda", "device_name",
                                                          "nvcc")},
                   capability=tuple(capability) if capability else None,
                   fla_settings=dict(record.get("fla_settings") or {}),
                   import_errors=dict(record.get("import_errors") or {}), deterministic=deterministic, side=side)

    def describe(self) -> str:
        gpu = (f"sm_{self.capability[0]}{self.capability[1]}" + (f" ({self.device_name})" if self.device_name else "")
               if self.capability else "no CUDA device")
        parts = [f"torch {self.torch or '-'} (CUDA {self.cuda or 'none'})", f"Triton {self.triton or '-'}",
                 f"fla {self.fla or '-'}", f"megatron-core {self.megatron_core or '-'}",
                 f"TransformerEngine {self.transformer_engine or '-'}", f"causal-conv1d {self.causal_conv1d or '-'}",
                 f"tilelang {self.tilelang or '-'}", f"nvcc {_found(self.nvcc)}", gpu]
        parts += [f"{name}={value}" for name, value in self.fla_settings.items()]
        return ", ".join(parts)


def _found(flag: bool | None) -> str:
    return "not read" if flag is None else "found" if flag else "not found"


@dataclass(frozen=True)
class Finding:
    """One entry of the table against one environment."""

    name: str
    status: Status
    detail: str
    fix: str
    source: str

    def line(self) -> str:
        text = f"[{self.status}] {self.name}: {self.detail}"
        if self.status in ("refused", "warning"):
            text += f" Fix: {self.fix}"
        return text + f" (source: {self.source})"


@dataclass(frozen=True)
class KnownIssue:
    name: str
    source: str
    fix: str
    judge: Callable[[GpuEnvironment], tuple[Status, str]]

    def finding(self, env: GpuEnvironment) -> Finding:
        status, detail = self.judge(env)
        return Finding(self.name, status, detail, self.fix, self.source)


def _between(version: str, low: tuple[int, int, int], high: tuple[int, int, int]) -> bool:
    return low <= version_tuple(version, "version") < high


# Triton's miscompile of fla's gated chunk_bwd_dqkwg on Hopper: wrong dq, dk, dw and dg, without a word
# (fla-org/flash-linear-attention#640), fixed in Triton 3.7.1 (#983: fla-core 0.5.2 narrowed its guard to it).
# Versions are compared as fla compares them (packaging's Version: 3.7.1rc1 is below 3.7.1).
TRITON_MISCOMPILES = (Version("3.4.0"), Version("3.7.1"))


@dataclass(frozen=True)
class FlaRelease:
    """How the fla-core releases in [low, high) reach the gated chunk_bwd_dqkwg that GatedDeltaNet's backward
    calls, read from each release's own code (``source``).

    ``dispatch``: chunk_bwd_dqkwg is wrapped by fla's backend dispatch, which hands it to the TileLang backend where
    that backend is available and enabled (unless FLA_DISABLE_BACKEND_DISPATCH=1); ``tilelang_needs``: what makes
    TileLang available ("import": ``import tilelang`` works; "nvcc": tilelang is installed and fla finds an nvcc);
    ``tilelang_default``: where it is enabled without FLA_TILELANG ("everywhere", or "hopper" with Triton >= 3.4.0);
    ``guard``: the Triton versions [low, high) for which the Triton path raises on a Hopper GPU (None: no guard;
    high None: every later Triton)."""

    low: Version
    high: Version | None
    dispatch: bool
    tilelang_needs: str | None
    tilelang_default: str | None
    guard: tuple[Version, Version | None] | None
    source: str


FLA_RELEASES = (
    FlaRelease(Version("0"), Version("0.5.0"), False, None, None, None,
               "fla-core 0.4.0, 0.4.1, 0.4.2 fla/ops/common/chunk_o.py chunk_bwd_dqkwg (lines 631, 630, 647): "
               "no guard and no backend dispatch"),
    FlaRelease(Version("0.5.0"), Version("0.5.2"), True, "import", "everywhere", (TRITON_MISCOMPILES[0], None),
               "fla-core 0.5.0 fla/ops/common/chunk_o.py lines 696 (@dispatch) and 715-720 (the guard), "
               "fla/ops/common/backends/tilelang/__init__.py lines 27-33 (available where tilelang imports), "
               "fla/ops/backends/__init__.py lines 25 (FLA_DISABLE_BACKEND_DISPATCH) and 55-60 (on unless "
               "FLA_TILELANG=0); 0.5.1 chunk_o.py lines 659 and 677-682, tilelang/__init__.py lines 27-33, "
               "fla/ops/backends/__init__.py lines 27 and 65-70"),
    FlaRelease(Version("0.5.2"), None, True, "nvcc", "hopper", TRITON_MISCOMPILES,
               "fla-core 0.5.2 fla/ops/common/chunk_o.py lines 686 (@dispatch) and 704-709 (the guard), "
               "fla/ops/common/backends/tilelang/__init__.py lines 23 and 31-44 (available where tilelang is "
               "installed and an nvcc is found; on by default on Hopper with Triton >= 3.4.0), fla/utils/_compat.py "
               "lines 38-65 (has_usable_nvcc); 0.6.0 chunk_o.py lines 709 and 727-732, "
               "fla/ops/common/backends/tilelang/__init__.py lines 17-19, fla/backends.py lines 27, 76-82 and "
               "114-123, fla/utils/env.py lines 125-153"),
)


def fla_release(version: str) -> FlaRelease:
    found = Version(version)
    return next(r for r in FLA_RELEASES if r.low <= found and (r.high is None or found < r.high))


def _fla_backward(env: GpuEnvironment, hopper: bool, nvcc: bool) -> tuple[Status, str]:
    """The outcome of fla's gated chunk_bwd_dqkwg for ``env`` on a GPU that fla takes for a Hopper or not
    (IS_NVIDIA_HOPPER: "NVIDIA H" in the device name or compute capability 9.x) with or without an nvcc."""
    release, triton = fla_release(env.fla), Version(env.triton)
    where = f"fla {env.fla} with Triton {env.triton} on {'a Hopper GPU' if hopper else 'this GPU'}"
    settings = env.fla_settings
    tilelang = release.tilelang_needs is not None and env.tilelang is not None and (
        release.tilelang_needs == "import" and "tilelang" not in env.import_errors
        or release.tilelang_needs == "nvcc" and nvcc)
    if "FLA_TILELANG" in settings:
        enabled = settings["FLA_TILELANG"] != "0"
    else:
        enabled = release.tilelang_default == "everywhere" or hopper and triton >= TRITON_MISCOMPILES[0]
    if release.dispatch and settings.get("FLA_DISABLE_BACKEND_DISPATCH") != "1" and tilelang and enabled:
        if "tilelang" in env.import_errors:
            return "refused", (f"{where}: fla hands the backward to tilelang {env.tilelang}, which does not import "
                               f"({env.import_errors['tilelang']}): the first GatedDeltaNet backward fails.")
        if not nvcc:
            return "refused", (f"{where}: fla hands the backward to tilelang {env.tilelang} wherever tilelang "
                               "imports, and tilelang's JIT finds no nvcc (CUDA_HOME, CUDA_PATH, PATH, "
                               "nvidia-cuda-nvcc, /usr/local/cuda): the first GatedDeltaNet backward fails to "
                               "compile (fla 0.5.2 on looks for nvcc first).")
        return "ok", f"{where}: fla hands the gated chunk_bwd_dqkwg to tilelang {env.tilelang} (nvcc found)"
    guard = release.guard
    if hopper and guard is not None and guard[0] <= triton and (guard[1] is None or triton < guard[1]):
        why = ("tilelang is not installed" if env.tilelang is None
               else "its TileLang route is off (FLA_DISABLE_BACKEND_DISPATCH=1 or FLA_TILELANG=0)" if not enabled
               or settings.get("FLA_DISABLE_BACKEND_DISPATCH") == "1"
               else "tilelang does not import" if release.tilelang_needs == "import" else "no nvcc is found")
        upper = f" and < {guard[1]}" if guard[1] else ""
        return "refused", (f"{where} and training.deterministic false: {why}, so fla raises \"Triton >= 3.4.0"
                           f"{upper} on Hopper GPUs produces incorrect results for gated chunk_bwd_dqkwg (see "
                           "#640)\" in the first GatedDeltaNet backward.")
    if hopper and TRITON_MISCOMPILES[0] <= triton < TRITON_MISCOMPILES[1]:
        return "refused", (f"{where} and training.deterministic false: fla {env.fla} has no guard and runs Triton's "
                           "chunk_bwd_dqkwg, which Triton [3.4.0, 3.7.1) miscompiles on Hopper: wrong dq, dk, dw "
                           "and dg without a word" + (f", whatever tilelang {env.tilelang}" if env.tilelang else "")
                           + ".")
    if not hopper:
        return "ok", f"{where}: not a Hopper GPU; fla runs Triton's chunk_bwd_dqkwg"
    return "ok", f"{where}: Triton {env.triton} is outside [3.4.0, 3.7.1) and fla {env.fla} does not refuse it"


def _fla_hopper_triton(env: GpuEnvironment) -> tuple[Status, str]:
    if env.deterministic:
        return "ok", ("training.deterministic: Megatron's --deterministic-mode runs torch_chunk_gated_delta_rule; "
                      "fla's chunk backward never runs")
    if env.fla is None:
        return "ok", "fla is not installed (megatron-core's own check refuses GatedDeltaNet without it)"
    if env.triton is None:
        return "undecided", "Triton is not installed in this Python: its version decides"
    if env.capability is None:
        hoppers: tuple[bool, ...] = (True, False)
    else:
        hoppers = ("NVIDIA H" in (env.device_name or "") or env.capability[0] == 9,)
    nvccs = (True, False) if env.nvcc is None else (env.nvcc,)
    outcomes = {(hopper, nvcc): _fla_backward(env, hopper, nvcc) for hopper in hoppers for nvcc in nvccs}
    if len({status for status, _ in outcomes.values()}) == 1:
        return next(iter(outcomes.values()))
    unknown = [what for what, given in (("whether the GPU is a Hopper (sm_90) cannot be told without a CUDA "
                                         "device", env.capability), ("whether fla finds an nvcc was not read",
                                                                     env.nvcc)) if given is None]
    refused = next(detail for status, detail in outcomes.values() if status == "refused")
    return "undecided", f"{'; '.join(unknown)}: where it is, {refused}"


def _megatron_needs_fla(env: GpuEnvironment) -> tuple[Status, str]:
    if env.megatron_core is None:
        return "ok", "megatron-core is not installed here"
    if env.fla is None:
        return "refused", (f"megatron-core {env.megatron_core} builds GatedDeltaNet only with fla (its l2norm runs "
                           "even in deterministic mode); fla is not installed: \"FLA is not installed\" at model "
                           "build.")
    if "fla" in env.import_errors:
        return "refused", (f"fla {env.fla} is installed but megatron-core's imports fail ({env.import_errors['fla']}): "
                           "megatron-core catches the ImportError and refuses GatedDeltaNet at model build.")
    return "ok", f"fla {env.fla} provides fla.modules.l2norm and fla.ops.gated_delta_rule"


def _megatron_fla_range(env: GpuEnvironment) -> tuple[Status, str]:
    if env.megatron_core is None or env.fla is None:
        return "ok", "megatron-core or fla is not installed here"
    if version_tuple(env.megatron_core, "megatron-core")[:2] != (0, 16):
        return "ok", f"megatron-core {env.megatron_core}: the entry is about 0.16"
    if _between(env.fla, (0, 4, 0), (0, 5, 0)):
        return "ok", f"fla {env.fla} is in megatron-core 0.16's flash-linear-attention~=0.4.0"
    return "warning", (f"megatron-core {env.megatron_core} was released against flash-linear-attention~=0.4.0; fla "
                       f"{env.fla} is outside it (fla.modules.l2norm is a compatibility alias there, and fla's "
                       "kernels, precisions and guards differ): hold the kernels with scripts/gpu_check.sh.")


def _causal_conv1d(env: GpuEnvironment) -> tuple[Status, str]:
    if env.causal_conv1d is None:
        return "ok", "causal-conv1d is not installed: megatron-core runs torch's conv1d"
    if env.deterministic:
        return "ok", "training.deterministic: megatron-core runs torch's conv1d, never causal_conv1d_fn"
    if "causal_conv1d" in env.import_errors:
        return "warning", (f"causal-conv1d {env.causal_conv1d} does not import with torch {env.torch} "
                           f"({env.import_errors['causal_conv1d']}): megatron-core catches the ImportError and runs "
                           "torch's conv1d instead, without saying so.")
    if env.megatron_core and version_tuple(env.megatron_core, "megatron-core")[:2] == (0, 16) and not _between(
            env.causal_conv1d, (1, 5, 0), (2, 0, 0)):
        return "warning", f"causal-conv1d {env.causal_conv1d} is outside megatron-core 0.16's causal-conv1d~=1.5."
    return "ok", f"causal-conv1d {env.causal_conv1d} imports"


def _transformer_engine(env: GpuEnvironment) -> tuple[Status, str]:
    if env.side != "real":
        return "ok", "the embedded side builds megatron-core's local modules: TransformerEngine is not used"
    if env.transformer_engine is None:
        return "refused", ("the real Megatron side runs TransformerEngine layers, and TransformerEngine is not "
                           "installed in this Python.")
    if "transformer_engine" in env.import_errors:
        return "refused", (f"TransformerEngine {env.transformer_engine} does not load with torch {env.torch} "
                           f"({env.import_errors['transformer_engine']}): its torch extension was built for "
                           "another torch.")
    if env.megatron_core and version_tuple(env.megatron_core, "megatron-core")[:2] == (0, 16) and not _between(
            env.transformer_engine, (2, 9, 0), (2, 12, 0)):
        return "warning", (f"TransformerEngine {env.transformer_engine} is outside megatron-core 0.16's "
                           "transformer-engine>=2.9.0a0,<2.12.0.")
    return "ok", f"TransformerEngine {env.transformer_engine} loads with torch {env.torch}"


MEGATRON_016 = "megatron-core 0.16.1 METADATA (Megatron-LM core_v0.16.1 pyproject.toml, extra 'dev')"
KNOWN_ISSUES: tuple[KnownIssue, ...] = (
    KnownIssue(
        "fla GatedDeltaNet backward on Hopper with Triton [3.4.0, 3.7.1)",
        "fla-org/flash-linear-attention#640 (the miscompile), #983 (fixed in Triton 3.7.1); each fla-core "
        "release's chunk_bwd_dqkwg guard and TileLang route: " + "; ".join(r.source for r in FLA_RELEASES),
        "training.deterministic: true (Megatron's torch chunk rule), or Triton >= 3.7.1 with fla-core 0.4.x or "
        ">= 0.5.2 (pip install 'triton>=3.7.1'), or tilelang with an nvcc (pip install tilelang; a CUDA toolkit "
        "or CUDA_HOME)",
        _fla_hopper_triton),
    KnownIssue(
        "megatron-core GatedDeltaNet needs fla",
        "Megatron-LM core_v0.16.1 megatron/core/ssm/gated_delta_net.py lines 39-47 (imports fla.modules.l2norm and "
        "fla.ops.gated_delta_rule, ImportError caught) and 103-106 (GatedDeltaNet raises without them)",
        "install fla-core (pip install --no-deps fla-core) into the framework's Python",
        _megatron_needs_fla),
    KnownIssue(
        "megatron-core 0.16 with fla outside ~=0.4.0",
        f"{MEGATRON_016}: Requires-Dist flash-linear-attention~=0.4.0",
        "fla-core 0.4.x, or keep this fla after scripts/gpu_check.sh --no-te passes its kernel checks",
        _megatron_fla_range),
    KnownIssue(
        "causal-conv1d built for another torch",
        "Megatron-LM core_v0.16.1 megatron/core/ssm/gated_delta_net.py lines 49-53 (ImportError caught: torch conv1d) "
        "and 326-337; Dao-AILab/causal-conv1d#77 (undefined symbol with a torch it was not built for); "
        f"{MEGATRON_016}: Requires-Dist causal-conv1d~=1.5",
        "rebuild it against this torch (pip install --no-build-isolation --no-binary causal-conv1d "
        "'causal-conv1d~=1.5') or uninstall it",
        _causal_conv1d),
    KnownIssue(
        "TransformerEngine with this torch",
        "NVIDIA/TransformerEngine#1684 and #1192 (transformer_engine_torch: undefined symbol with a torch it was not "
        f"built for); {MEGATRON_016}: Requires-Dist transformer-engine>=2.9.0a0,<2.12.0",
        "build TransformerEngine against this torch (pip install --no-build-isolation 'transformer_engine[pytorch]"
        ">=2.9,<2.12'), or train without it: backends gpu: local (the embedded side) or scripts/gpu_check.sh --no-te",
        _transformer_engine),
)


def check(env: GpuEnvironment) -> list[Finding]:
    """Every entry of the table against ``env`` (pure: no import, no device)."""
    return [issue.finding(env) for issue in KNOWN_ISSUES]


def refusals(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.status == "refused"]


def read_environment(*, deterministic: bool, side: Side = "embedded", python: str | None = None) -> GpuEnvironment:
    """This Python's environment, or (``python``) that interpreter's, read in a separate process. The embedded
    side does not use TransformerEngine: it is not imported for it."""
    imports = tuple(field for field in gpu_env_read.IMPORTS if side == "real" or field != "transformer_engine")
    if python is None:
        return GpuEnvironment.from_record(gpu_env_read.read_environment(imports), deterministic=deterministic,
                                          side=side)
    try:
        done = subprocess.run([python, gpu_env_read.__file__, *imports], capture_output=True, text=True,
                              timeout=READ_TIMEOUT_S, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GpuEnvironmentError(f"reading the GPU environment with {python} failed: {exc}") from None
    for line in done.stdout.splitlines():
        if line.startswith(READ_MARKER):
            return GpuEnvironment.from_record(json.loads(line[len(READ_MARKER):]), deterministic=deterministic,
                                              side=side)
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    raise GpuEnvironmentError(f"reading the GPU environment with {python} failed: {tail[0]}")


def require(env: GpuEnvironment) -> list[Finding]:
    """The findings, or GpuEnvironmentError naming every refused entry with its fix and source."""
    findings = check(env)
    refused = refusals(findings)
    if refused:
        raise GpuEnvironmentError(f"the GPU environment check refuses {', '.join(f.name for f in refused)} "
                                  f"({env.describe()})", [f.line() for f in refused])
    return findings
