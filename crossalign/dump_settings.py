"""What an msprobe dump of a training run takes: the site's ``diagnose.dump`` setting and the ``config.json`` it
becomes for msprobe's ``PrecisionDebugger`` on either side (MindSpore or PyTorch).

```yaml
diagnose:
  dump: {step: 1, level: L0, task: statistics, ranks: [0, 1]}
```
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

DumpLevel = Literal["L0", "mix"]
DumpTask = Literal["statistics", "md5", "tensor"]


class DumpSettings(BaseModel):
    """One msprobe dump of both real trainings: which iteration, how deep and how much of each tensor."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    step: int = Field(default=0, ge=0, description="the training iteration msprobe dumps, counted from 0 as "
                      "msprobe counts its steps (PrecisionDebugger.step() after each iteration)")
    level: DumpLevel = Field(default="L0", description="L0: one record per module/cell; mix: modules "
                                        "and the framework APIs inside them")
    task: DumpTask = Field(default="statistics", description="statistics: max, min, "
                                                         "mean, norm; md5: statistics and a CRC of each tensor; "
                                                         "tensor: every tensor as .npy")
    ranks: tuple[int, ...] = Field(default=(), description="the global ranks that dump; empty: every rank")

    def msprobe_config(self, dump_path: str | Path) -> dict:
        """msprobe's ``config.json`` for this dump, written beside the launch files of a step."""
        task = "tensor" if self.task == "tensor" else "statistics"
        section: dict = {"scope": [], "list": [], "data_mode": ["all"]}
        if task == "statistics":
            section["summary_mode"] = "md5" if self.task == "md5" else "statistics"
        return {
            "task": task,
            "dump_path": str(dump_path),
            "rank": list(self.ranks),
            "step": [self.step],
            "level": self.level,
            "enable_dataloader": False,
            task: section,
        }


def rerun_dump(base: DumpSettings | None, dump: bool, changes: dict[str, Any], *, option: str = "--dump",
               separator: str = "-") -> DumpSettings | None:
    """The dump a rerun asks for (``crossalign rerun --dump``, the rerun form's ``dump``): ``base`` (the site's
    diagnose.dump, default settings without one) with ``changes`` (step, level, task; None: unchanged); None without
    ``dump``. A change without ``dump``, or one that is not a valid setting, raises ValueError naming it as the
    caller spells it (``--dump-step`` on the command line, ``dump_step`` in the form)."""
    given = {key: value for key, value in changes.items() if value is not None}
    if not dump:
        if given:
            raise ValueError(f"{option}{separator}{next(iter(given))} is given without {option}")
        return None
    try:
        return DumpSettings.model_validate({**(base or DumpSettings()).model_dump(), **given})
    except ValidationError as exc:
        raise ValueError("; ".join(f"{option}{separator}{error['loc'][0]}: {error['msg']}"
                                   for error in exc.errors())) from None


DUMP_DIR = "msprobe_dump"  # in a training step's outputs: msprobe's step{N}/rank{R}/{dump,construct,stack}.json
CONFIG_FILE = "msprobe_config.json"  # beside it: the config.json the training's PrecisionDebugger reads


def msprobe_import_check(module: str) -> str:
    """Python that a run script runs with the framework's own interpreter before a dump-enabled training: it stops
    the script, naming the interpreter, where msprobe's ``module`` (msprobe.pytorch, msprobe.mindspore) is missing."""
    return (f"import sys\ntry:\n    import {module}\nexcept ImportError as exc:\n"
            f"    sys.exit(f\"{{sys.executable}} cannot import {module} ({{exc}}): a dump (diagnose.dump, rerun --dump) "
            f"needs mindstudio-probe installed in the framework's Python\")\n")


class DumpStepError(ValueError):
    """A dump step the training never reaches."""


# ---- which run wrote a dump ---------------------------------------------------------------------------------

RECORD_FILE = "crossalign_dump.json"  # in each rank folder msprobe wrote, beside its dump.json
RECORD_TEMPLATE = "msprobe_record.json"  # beside CONFIG_FILE: the record less the rank, which each rank adds
RECORD_ENV = "CROSSALIGN_MSPROBE_RECORD"  # tells a real launch where RECORD_TEMPLATE is


class DumpRecord(BaseModel):
    """What a rank folder of a dump says of the training that wrote it (``crossalign_dump.json``): ``crossalign
    diagnose`` holds both sides' records against each other and each side's ranks against one another."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str | None = Field(description="the run the training step belongs to; null outside a run store")
    step: int = Field(ge=0, description="the dumped iteration, as msprobe counts it (its step{N} folder)")
    config_digest: str = Field(description="sha256 of the run's config (AlignmentConfig.digest)")
    model_digest: str = Field(description="sha256 of its model section, what both sides must share")
    side: Literal["megatron", "mindformers"]
    layout: dict = Field(description="the side's parallel section of the config (parallel.megatron or "
                         "parallel.mindformers)")
    rank: int | None = Field(default=None, ge=0, description="the global rank that wrote the folder; null in the "
                             "template the step writes beside msprobe's config.json")

    @classmethod
    def of(cls, config, side: Literal["megatron", "mindformers"], run_id: str | None, step: int) -> "DumpRecord":
        """The record of a training of ``config`` (an ``AlignmentConfig``) on ``side`` dumping ``step``."""
        layout = config.parallel.megatron if side == "megatron" else config.parallel.mindformers
        return cls(run_id=run_id, step=step, config_digest=config.digest(), model_digest=config.model.digest(),
                   side=side, layout=layout.model_dump(mode="json"))


def write_rank_record(config_path: Path, rank: int) -> Path | None:
    """After an iteration under msprobe's debugger made from ``config_path`` (:data:`CONFIG_FILE`): the record of
    ``rank`` (:data:`RECORD_TEMPLATE` beside it, with the rank) in its rank folder of the dump step, once msprobe
    has written that folder's dump.json; None before, or where msprobe dumps other ranks. The real launches do
    the same in their own code (``patches/megatron/pretrain_qwen35.py``, ``patches/mindformers/msprobe_dump.yaml``)."""
    config_path = Path(config_path)
    record = DumpRecord.model_validate_json((config_path.parent / RECORD_TEMPLATE).read_text())
    dump_root = Path(json.loads(config_path.read_text())["dump_path"])
    folder = dump_root / f"step{record.step}" / f"rank{rank}"
    if not (folder / "dump.json").is_file():
        return None
    path = folder / RECORD_FILE
    path.write_text(record.model_copy(update={"rank": rank}).model_dump_json(indent=1) + "\n")
    return path


def write_msprobe_config(settings: DumpSettings, output_dir: Path, iterations: int, record: DumpRecord) -> Path:
    """msprobe's ``config.json`` of a training step of ``iterations`` iterations, in ``output_dir`` (as
    :data:`CONFIG_FILE`), dumping into ``output_dir``/:data:`DUMP_DIR` (absolute: the training runs in its own
    working directory), and beside it the dump record that each rank completes in its rank folder
    (:data:`RECORD_TEMPLATE`)."""
    if settings.step >= iterations:
        raise DumpStepError(f"diagnose.dump.step: {settings.step} is not reached by a training of {iterations} "
                            f"iterations (msprobe counts them from 0: steps 0 to {iterations - 1})")
    if record.step != settings.step:
        raise ValueError(f"the dump record is of step {record.step}, the dump of step {settings.step}")
    output_dir = Path(output_dir).absolute()
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / CONFIG_FILE
    path.write_text(json.dumps(settings.msprobe_config(output_dir / DUMP_DIR), indent=2) + "\n")
    (output_dir / RECORD_TEMPLATE).write_text(record.model_dump_json(indent=1) + "\n")
    return path


class DumpMissingError(ValueError):
    """A training asked to dump that left no msprobe dump of its dump step."""


def collected_dump(settings: DumpSettings, output_dir: Path) -> dict:
    """What a training step's msprobe dump holds, for its manifest: the folder, the settings, and for the dump
    step the rank folders msprobe wrote (``rank{R}``; ``proc{pid}`` without a process group) and their files.
    Raises :class:`DumpMissingError` naming the folder when msprobe wrote nothing for that step."""
    root = Path(output_dir) / DUMP_DIR
    step_dir = root / f"step{settings.step}"
    rank_dirs = sorted(p for p in step_dir.iterdir() if (p / "dump.json").is_file()) if step_dir.is_dir() else []
    if not rank_dirs:
        ranks = f" on ranks {list(settings.ranks)}" if settings.ranks else ""
        raise DumpMissingError(f"{step_dir}: the training was asked for an msprobe dump of step {settings.step}{ranks} "
                               "(diagnose.dump) and no rank folder with a dump.json is there")
    files = [p for p in root.rglob("*") if p.is_file()]
    return {"folder": DUMP_DIR, "config": CONFIG_FILE, **settings.model_dump(mode="json"),
            "rank_folders": [p.name for p in rank_dirs], "files": len(files),
            "bytes": sum(p.stat().st_size for p in files)}
