"""``crossalign diagnose``: find the first module whose output differs between the two sides, and say why."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from crossalign.cli.common import console, user_errors
from crossalign.cli.runs import located_run

DIAGNOSE_DIR = "diagnose"


def register(app: typer.Typer) -> None:
    """Add this area's commands to app."""
    app.command("diagnose")(diagnose_command)


def _from_run(run_dir: Path):
    """(config, MindFormers checkpoint, Megatron checkpoint, dataset prefix or None) of a run store folder."""
    from crossalign.store import RunStore, StoreError

    run_dir = Path(run_dir).expanduser().absolute()
    run = RunStore(run_dir.parent).run(run_dir.name)
    ms_ckpt, mg_ckpt = run.step_dir("cast-bf16") / "checkpoint", run.step_dir("convert") / "checkpoint"
    for step, path in (("cast-bf16", ms_ckpt), ("convert", mg_ckpt)):
        if not path.is_dir():
            raise StoreError(f"run {run.run_id!r}: step {step} has no checkpoint at {path} (run it first)")
    try:
        prefix = run.dataset.prefix
    except StoreError:
        prefix = None
    return run.config, ms_ckpt, mg_ckpt, prefix


def _run_has_msprobe_dumps(run_dir: Path) -> bool:
    from crossalign.diagnose.msprobe_run import run_dump_folders
    from crossalign.store import StoreError

    try:
        run_dump_folders(Path(run_dir))
    except (StoreError, OSError):
        return False
    return True


def _diagnose_msprobe(model: Optional[str], run_dir: Optional[Path], npu_dump: Optional[Path],
                      gpu_dump: Optional[Path], step: Optional[int], out: Optional[Path], precision: str,
                      rows: Optional[int], overrides: list[str]) -> None:
    """``diagnose --npu-dump --gpu-dump``: the two real runs' msprobe dumps held side by side."""
    from crossalign.config import ConfigError, load_config, with_overrides
    from crossalign.diagnose.mapping import MappingError
    from crossalign.diagnose.msprobe_dump import MsprobeDumpError
    from crossalign.diagnose.msprobe_report import print_msprobe_diagnosis
    from crossalign.diagnose.msprobe_run import diagnose_msprobe, run_dump_folders
    from crossalign.diagnose.references import SideError
    from crossalign.store import RunStore, StoreError

    with user_errors(ConfigError, MsprobeDumpError, MappingError, SideError, StoreError, OSError):
        config = load_config(model, overrides) if model is not None else None
        if run_dir is not None:
            run_dir = Path(run_dir).expanduser().absolute()
            run_npu, run_gpu = run_dump_folders(run_dir)
            npu_dump, gpu_dump = npu_dump or run_npu, gpu_dump or run_gpu
            config = config or with_overrides(RunStore(run_dir.parent).run(run_dir.name).config, overrides,
                                              f"the config of run {run_dir.name}")
            out = out or run_dir / DIAGNOSE_DIR
        if precision not in ("auto", "fp32", "bf16"):
            raise SideError(f"--precision {precision!r}: expected auto, fp32 or bf16")
        if npu_dump is None or gpu_dump is None:
            raise SideError("--npu-dump and --gpu-dump go together (or --run of a run whose train steps dumped)")
        if config is None:
            raise SideError("--model is required with --npu-dump/--gpu-dump (the layouts and conversion rules)")
        with console.status("reading, merging and comparing the msprobe dumps"):
            result = diagnose_msprobe(npu_dump, gpu_dump, config, out or Path(DIAGNOSE_DIR), precision, step)
    print_msprobe_diagnosis(result, console, limit=rows)
    if result.diagnosis.diverged:
        raise typer.Exit(1)


def diagnose_command(
    model: Optional[str] = typer.Option(None, "--model", help="Model config name or YAML path (default with --run: "
                                        "the run's config)."),
    input_dir: Optional[Path] = typer.Option(None, "--input", help="MindFormers checkpoint (the reference side; "
                                             "default: a random model of the config, written and converted here)."),
    converted: Optional[Path] = typer.Option(None, "--converted", help="Megatron checkpoint converted from --input, "
                                             "any legacy layout or torch_dist (default: convert --input here)."),
    fault: Optional[str] = typer.Option(None, "--fault", help="Inject a known conversion bug into the conversion "
                                        "made here, to see where it shows (layout faults need --tp or --ep > 1)."),
    tp: Optional[int] = typer.Option(None, "--tp", help="Tensor-parallel ranks: convert here into this many (default "
                                     "1), or the number --converted must hold (default: any)."),
    pp: Optional[int] = typer.Option(None, "--pp", help="Pipeline stages, likewise."),
    ep: Optional[int] = typer.Option(None, "--ep", help="Expert-parallel ranks, likewise."),
    run_dir: Optional[Path] = typer.Option(None, "--run", help="A run, by its folder (runs/ID) or its id in the "
                                           "site's store: uses 02-cast-bf16/checkpoint, 03-convert/checkpoint and "
                                           "the run's dataset."),
    out: Optional[Path] = typer.Option(None, "--out", help="Folder for the dumps and the reports (default: "
                                       "./diagnose, or RUN/diagnose with --run)."),
    mindspore_dump: Optional[Path] = typer.Option(None, "--mindspore-dump", help="Compare this existing dump "
                                                  "(e.g. from a real MindFormers run) instead of running the models."),
    megatron_dump: Optional[Path] = typer.Option(None, "--megatron-dump", help="The Megatron-side dump to compare "
                                                 "with --mindspore-dump."),
    precision: str = typer.Option("auto", "--precision", help="Divergence thresholds for existing dumps: fp32 (our "
                                  "CPU models) or bf16 (real runs); auto: fp32 for --mindspore-dump/--megatron-dump, "
                                  "and for msprobe dumps from the dtypes they recorded (fp32 where both sides ran in "
                                  "fp32, else the looser side's, bf16's)."),
    seq: Optional[int] = typer.Option(None, "--seq", help="Tokens per sample (default: training.seq_length)."),
    batch: Optional[int] = typer.Option(None, "--batch", help="Samples (default: training.micro_batch_size)."),
    data: Optional[Path] = typer.Option(None, "--data", help="Indexed dataset prefix (or its folder): use its first "
                                        "batch (default: random tokens; with --run, the run's dataset)."),
    seed: int = typer.Option(1234, "--seed", help="Seed of the random tokens."),
    tensors: bool = typer.Option(True, "--tensors/--stats-only", help="Keep the output tensors in the dumps "
                                 "(exact cosine and errors) or only their statistics."),
    rows: Optional[int] = typer.Option(None, "--rows", help="Print only this many rows past the first divergence "
                                       "(the CSV/HTML always hold all)."),
    npu_dump: Optional[Path] = typer.Option(None, "--npu-dump", help="msprobe dump of the MindFormers (MindSpore) run: "
                                            "its dump_path, a step{N} folder or one rank folder."),
    gpu_dump: Optional[Path] = typer.Option(None, "--gpu-dump", help="msprobe dump of the Megatron (PyTorch) run, "
                                            "likewise; each side's rank folders are merged by its parallel layout "
                                            "in the config."),
    dump_step: Optional[int] = typer.Option(None, "--step", help="The dumped iteration to compare when the msprobe "
                                            "dumps hold several."),
    overrides: list[str] = typer.Option([], "--set", help="Override a config value for the msprobe dumps, e.g. "
                                        "parallel.megatron.tensor=2 (the layout a refused dump implies)."),
) -> None:
    """Dump every module's output on both sides for the same batch, compare them module by module in forward
    order, write the table as CSV and HTML, and name the first diverging module with its likely cause.
    A sharded Megatron checkpoint is read back rank by rank, as each Megatron rank loads its file; with
    --tp/--pp/--ep and no --converted, the conversion is made here into that layout, as selfcheck makes it.

    With --npu-dump/--gpu-dump (or --run of a run whose train steps dumped with msprobe) it compares the two
    real runs' msprobe dumps instead: weights through the conversion rules, forward, backward and weight gradients,
    with msprobe's metrics, and writes msprobe's own layer_mapping.yaml and data_mapping.yaml beside the report, for
    every pair of rank folders msprobe's compare takes. The dumps are first held against the config: a rank folder
    or shard that does not fit its side's layout, or a model other than the config's, is refused (exit 2).

    Exit status 0 when no module diverges and the checkpoint loads strictly, 1 otherwise, 2 for unusable input.
    """
    if run_dir is not None:
        from crossalign.site import SiteError
        from crossalign.store import StoreError

        with user_errors(SiteError, StoreError):
            run_dir = located_run(str(run_dir), None).path
    if npu_dump is not None or gpu_dump is not None or (run_dir is not None and _run_has_msprobe_dumps(run_dir)):
        _diagnose_msprobe(model, run_dir, npu_dump, gpu_dump, dump_step, out, precision, rows, overrides)
        return
    if overrides:
        raise typer.BadParameter("--set applies to msprobe dumps (--npu-dump/--gpu-dump)", param_hint="--set")
    from crossalign.tensorio.errors import CheckpointError
    from crossalign.config import ConfigError, load_config
    from crossalign.diagnose.dump import DumpError
    from crossalign.diagnose.mapping import MappingError
    from crossalign.diagnose.report import print_diagnosis
    from crossalign.diagnose.run import compare_dump_folders, diagnose, write_reports
    from crossalign.diagnose.references import SideError
    from crossalign.store import StoreError

    with user_errors(CheckpointError, ConfigError, SideError, DumpError, MappingError, StoreError, OSError):
        if (mindspore_dump is None) != (megatron_dump is None):
            raise SideError("--mindspore-dump and --megatron-dump go together")
        config = load_config(model) if model is not None else None
        if run_dir is not None:
            if input_dir is not None or converted is not None:
                raise SideError("--run takes the checkpoints from the run: drop --input/--converted")
            run_config, input_dir, converted, run_data = _from_run(run_dir)
            config = config or run_config
            data = data or run_data
            out = out or Path(run_dir) / DIAGNOSE_DIR
        if config is None:
            raise SideError("--model is required (or --run, which records its config)")
        out = out or Path(DIAGNOSE_DIR)
        layout = None if (tp, pp, ep) == (None, None, None) else (tp or 1, pp or 1, ep or 1)
        if mindspore_dump is not None:
            if fault is not None:
                raise SideError("--fault applies to a conversion made here, not to existing dumps")
            diagnosis = compare_dump_folders(mindspore_dump, megatron_dump, config.model,
                                             config.training.megatron_core_version,
                                             "fp32" if precision == "auto" else precision, layout=layout)
            result = write_reports(diagnosis, out, f"crossalign diagnose: {config.model.name}")
        else:
            with console.status("starting") as status:
                result = diagnose(config, input_dir, converted, out, fault=fault, layout=layout, seq=seq,
                                  batch=batch, data=data, seed=seed, save_tensors=tensors,
                                  on_stage=lambda stage: status.update(stage))
    if result.diagnosis.layout is not None:
        console.print("Megatron checkpoint: (tp, pp, ep) = ({}, {}, {})".format(*result.diagnosis.layout),
                      highlight=False)
    print_diagnosis(result.diagnosis, console, limit=rows)
    console.print(f"reports: {result.csv}, {result.html}, {result.summary}", highlight=False)
    if result.diagnosis.diverged or result.diagnosis.load_problems:
        raise typer.Exit(1)
