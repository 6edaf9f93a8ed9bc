"""Which run wrote each rank folder of a dump: the record (``crossalign_dump.json``, ``dump_settings.DumpRecord``)
that crossalign's trainings write beside msprobe's files, held against the other ranks, the other side and the
config before anything is compared.

- every rank folder of a side has a record, or none has (a user's own msprobe dump): a folder without one among
  folders with one was not written by that run;
- a side's records name one run, one config, one dump step and one layout, each its own folder's rank, and the
  step of the ``step{N}`` folder they lie in;
- the two sides' records name the same run (where both were written in a run store), the same config and step;
- the records' model and layout are the config's: a dump of another model config is refused, and one taken in
  another layout is refused with the ``--set`` options that make the config say it. A config that differs only
  elsewhere (training settings) is a note.

Dumps without records are read as before, with a note that which run wrote them could not be checked.
"""

from __future__ import annotations

from pydantic import ValidationError

from crossalign.config import AlignmentConfig
from crossalign.diagnose.msprobe_dump import OPTIONS, MsprobeDumpError, StepDump
from crossalign.dump_settings import RECORD_FILE, DumpRecord

FRAMEWORK = {"mindformers": "mindspore", "megatron": "pytorch"}  # a record's side -> msprobe's framework of it


class DumpRecordError(MsprobeDumpError):
    """Rank folders or sides whose records say they do not belong together; the message names the folders."""


def read_records(step: StepDump) -> dict[int, DumpRecord | None]:
    """Each rank's record, None where its folder has none; an unreadable record is an error naming the file."""
    found: dict[int, DumpRecord | None] = {}
    for rank, dump in step.ranks.items():
        path = dump.path / RECORD_FILE
        if not path.is_file():
            found[rank] = None
            continue
        try:
            found[rank] = DumpRecord.model_validate_json(path.read_text())
        except ValidationError as exc:
            error = exc.errors()[0]
            raise DumpRecordError(f"{path}: not a crossalign dump record ({'.'.join(map(str, error['loc']))}: "
                                  f"{error['msg']})") from None
    return found


def _one_run(step: StepDump, side: str, records: dict[int, DumpRecord | None]) -> DumpRecord | None:
    """The record every rank of a side shares (rank aside), or None where none has one."""
    option = OPTIONS[FRAMEWORK[side]]
    have = {rank: record for rank, record in records.items() if record is not None}
    if not have:
        return None
    folder = {rank: step.ranks[rank].path for rank in records}
    lacking = [folder[rank].name for rank, record in records.items() if record is None]
    if lacking:
        raise DumpRecordError(f"{option} {step.path}: {', '.join(lacking)} {'has' if len(lacking) == 1 else 'have'} "
                              f"no dump record ({RECORD_FILE}) beside msprobe's files while "
                              f"{', '.join(folder[r].name for r in have)} {'has' if len(have) == 1 else 'have'} one: "
                              f"not written by one run")
    first_rank = min(have)
    first = have[first_rank]
    for rank, record in have.items():
        path = folder[rank] / RECORD_FILE
        if record.side != side:
            raise DumpRecordError(f"{path}: written by the {record.side} training, given as {option}")
        if record.rank != rank:
            raise DumpRecordError(f"{path}: written by rank {record.rank}, in the folder of rank {rank}")
        if record.step != step.step:
            raise DumpRecordError(f"{path}: the record of step {record.step}, in the folder of step {step.step}")
        differs = [name for name in ("run_id", "config_digest", "step", "layout")
                   if getattr(record, name) != getattr(first, name)]
        if differs:
            raise DumpRecordError(
                f"{option} {step.path}: {folder[rank].name} and {folder[first_rank].name} come from different runs "
                f"(their records differ in {', '.join(differs)}: "
                + "; ".join(f"{name} {getattr(record, name)!r} vs {getattr(first, name)!r}" for name in differs)
                + ")")
    return first.model_copy(update={"rank": None})


def _layout_options(side: str, recorded: dict, config: AlignmentConfig) -> list[str]:
    section = config.parallel.megatron if side == "megatron" else config.parallel.mindformers
    stated = section.model_dump(mode="json")
    return [f"--set parallel.{side}.{key}={str(value).lower()}" for key, value in recorded.items()
            if key in stated and stated[key] != value]


def pair_records(npu: StepDump, gpu: StepDump) -> tuple[dict[str, DumpRecord | None], list[str]]:
    """Each side's one record (None: it has none) and the notes; :class:`DumpRecordError` where a side's ranks come
    from several runs or the two sides from different runs or configs."""
    records = {"mindformers": _one_run(npu, "mindformers", read_records(npu)),
               "megatron": _one_run(gpu, "megatron", read_records(gpu))}
    notes = [f"{OPTIONS[step.framework]} {step.path} has no dump record ({RECORD_FILE}): which run wrote it, and with which "
             f"config, could not be checked" for side, step in (("mindformers", npu), ("megatron", gpu))
             if records[side] is None]
    ms, mg = records["mindformers"], records["megatron"]
    if ms is not None and mg is not None:
        if ms.run_id is not None and mg.run_id is not None and ms.run_id != mg.run_id:
            raise DumpRecordError(f"--npu-dump {npu.path} was written by run {ms.run_id!r} and --gpu-dump {gpu.path} "
                                  f"by run {mg.run_id!r}: compare the two sides of one run")
        if ms.config_digest != mg.config_digest:
            raise DumpRecordError(f"--npu-dump {npu.path} and --gpu-dump {gpu.path} were trained with different "
                                  f"configs (digests {ms.config_digest[:12]} and {mg.config_digest[:12]})")
    return records, notes


def records_against_config(records: dict[str, DumpRecord | None], paths: dict[str, str],
                           config: AlignmentConfig) -> list[str]:
    """The records' model and layouts held against the config given (see the module); returns the notes."""
    notes = []
    for side, record in records.items():
        if record is None:
            continue
        where = f"{OPTIONS[FRAMEWORK[side]]} {paths[side]}"
        if record.model_digest != config.model.digest():
            raise DumpRecordError(f"{where}: its record says it was trained with another model config (model digest "
                                  f"{record.model_digest[:12]}; the config {config.model.name!r} given has "
                                  f"{config.model.digest()[:12]}): give the config the run trained with")
        options = _layout_options(side, record.layout, config)
        if options:
            raise DumpRecordError(f"{where}: its record says it was dumped in the layout parallel.{side} "
                                  f"{record.layout}, which the config does not state: pass {' '.join(options)}")
        if record.config_digest != config.digest():
            notes.append(f"{where} was trained with a config (digest {record.config_digest[:12]}) that differs from "
                         f"the one given outside its model and layouts")
    return notes
