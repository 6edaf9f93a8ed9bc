"""``crossalign configs`` (the model configs, and ``import-hf`` to make one from a Hugging Face checkpoint) and
``crossalign selfcheck``: prove a conversion with one forward pass of every implementation of the model.

What a command runs is imported inside it, so that ``crossalign --help`` starts without torch, MindSpore or Prefect.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import typer

from crossalign.cli.common import console, user_errors


configs_app = typer.Typer(help="The shipped model configs; import-hf makes one from a Hugging Face checkpoint.",
                          invoke_without_command=True, no_args_is_help=False)


def register(app: typer.Typer) -> None:
    """Add this area's commands to app."""
    app.add_typer(configs_app, name="configs")
    app.command("selfcheck")(selfcheck_command)


@configs_app.callback()
def list_configs(context: typer.Context) -> None:
    """List the shipped model configs with the sizes derived from them."""
    if context.invoked_subcommand is not None:
        return
    from rich.table import Table

    from crossalign.config import CONFIG_DIR, load_config

    table = Table("config", "kind", "layers", "hidden", "experts", "qkv rows", "in_proj rows", "seq", "steps")
    for path in sorted(CONFIG_DIR.glob("*.yaml")):
        cfg = load_config(path)
        m, t = cfg.model, cfg.training
        table.add_row(path.stem, m.kind, m.layer_pattern,
                      str(m.hidden_size), str(m.num_experts or "-"), str(m.qkv_rows), str(m.in_proj_rows),
                      str(t.seq_length), f"{t.base_train_iters}+{t.train_iters}")
    console.print(table)


def _config_name(directory: Path) -> str:
    """A config name from a checkpoint folder's name: Qwen3.5-35B-A3B -> qwen3_5_35b_a3b."""
    return "".join(c if c.isalnum() else "_" for c in directory.resolve().name.lower()).strip("_") or "hf_model"


@configs_app.command("import-hf")
def import_hf_command(
    directory: Path = typer.Argument(..., help="Hugging Face Qwen3.5 checkpoint folder (config.json + safetensors)."),
    name: Optional[str] = typer.Option(None, "--name", help="Config name (default: from the folder name)."),
    training: Optional[str] = typer.Option(None, "--training", help="Config whose training section to take "
                                           "(default: the shipped qwen35_dense or qwen35_moe)."),
    out: Optional[Path] = typer.Option(None, "--out", help="YAML file to write (default: ./NAME.yaml)."),
) -> None:
    """Read a Hugging Face config.json (and whether the checkpoint carries an MTP layer) into a crossalign config."""
    import yaml

    from crossalign.tensorio.errors import CheckpointError
    from crossalign.checkpoint.hf import read_hf_checkpoint
    from crossalign.config import AlignmentConfig, ConfigError, load_config

    with user_errors(CheckpointError, ConfigError, OSError):
        source = read_hf_checkpoint(directory)
        model = source.model_config(name or _config_name(directory))
        base = load_config(training or ("qwen35_moe" if model.is_moe else "qwen35_dense"))
        target = out or Path(f"{model.name}.yaml")
        if target.exists():
            raise ConfigError(f"{target}: exists; choose another --out")
        config = AlignmentConfig(model=model, training=base.training)
        target.write_text(f"# imported from {directory} (crossalign configs import-hf)\n" + yaml.safe_dump(
            config.model_dump(mode="json", exclude_none=True), sort_keys=False))
        load_config(target)
    console.print(f"{model.name}: {model.kind}, {model.num_layers} layers "
                  f"({model.layer_pattern}), hidden {model.hidden_size}, "
                  f"{model.mtp_num_layers} MTP layer(s); training section from {training or base.model.name} -> {target}",
                  highlight=False)


def _number(value: float | None, digits: str) -> str:
    if value is None:
        return "-"
    return "nan" if math.isnan(value) else format(value, digits)


def selfcheck_command(
    model: str = typer.Option(..., "--model", help="Model config name or YAML path."),
    input_dir: Optional[Path] = typer.Option(None, "--input", help="MindFormers checkpoint (default: a random "
                                             "model of the config, written and converted here)."),
    converted: Optional[Path] = typer.Option(None, "--converted", help="Megatron checkpoint converted from --input "
                                             "(default: convert --input here)."),
    fault: Optional[str] = typer.Option(None, "--fault", help="Inject a known conversion bug into the conversion "
                                        "made here, to see how it shows."),
    seq: Optional[int] = typer.Option(None, "--seq", help="Tokens per sample (default: training.seq_length)."),
    batch: Optional[int] = typer.Option(None, "--batch", help="Samples (default: training.micro_batch_size)."),
    data: Optional[Path] = typer.Option(None, "--data", help="Indexed dataset prefix (or its folder): use its first "
                                        "batch instead of random tokens."),
    seed: int = typer.Option(1234, "--seed", help="Seed of the random weights and tokens."),
    hf: Optional[Path] = typer.Option(None, "--hf", help="Hugging Face Qwen3.5 checkpoint folder as the source: "
                                      "converted to both layouts here, run by transformers as it is."),
    tp: int = typer.Option(1, "--tp", help="Convert here into this many tensor-parallel ranks."),
    pp: int = typer.Option(1, "--pp", help="Convert here into this many pipeline stages."),
    ep: int = typer.Option(1, "--ep", help="Convert here into this many expert-parallel ranks."),
) -> None:
    """Load a MindFormers checkpoint into the MindSpore model and its conversions into the PyTorch reference,
    megatron-core's own GPTModel and transformers' Qwen3.5 (the public reference implementation), all
    strictly, run one batch through each in fp32 and compare every output of every pair; name the odd one
    out. With --hf a Hugging Face checkpoint is the source instead.

    Exit status 0 when every output is within tolerance, 1 when not (or when the converted
    checkpoint does not load strictly), 2 for unusable input.
    """
    from rich.markup import escape
    from rich.table import Table

    from crossalign.tensorio.errors import CheckpointError
    from crossalign.checkpoint.faults import FAULTS, LAYOUT_FAULTS
    from crossalign.config import ConfigError, load_config
    from crossalign.diagnose.references import SideError
    from crossalign.diagnose.selfcheck import scalar_outputs, selfcheck

    with user_errors(CheckpointError, ConfigError, SideError, OSError):
        if fault is not None and fault not in {**FAULTS, **LAYOUT_FAULTS}:
            raise CheckpointError(f"--fault {fault!r} is not one of {', '.join({**FAULTS, **LAYOUT_FAULTS})}")
        config = load_config(model)
        with console.status("starting") as status:
            report = selfcheck(config, input_dir, converted, fault, seq, batch, data=data, seed=seed,
                               on_stage=lambda stage: status.update(stage), hf_ckpt=hf, layout=(tp, pp, ep))

    console.print(f"{report.config}: batch {report.batch_shape[0]} x {report.batch_shape[1]} ({report.batch_source})\n"
                  f"  MindFormers checkpoint: {report.mindspore_checkpoint}\n"
                  f"  Megatron checkpoint:    {report.megatron_checkpoint}\n"
                  f"  Hugging Face checkpoint: {report.huggingface_checkpoint}", highlight=False)
    for result in report.implementations:
        if result.load_error is not None:
            console.print(f"[bold red]FAIL[/] {result.name}: the {result.checkpoint} checkpoint does not load strictly "
                          f"(Megatron would keep random weights):\n{escape(result.load_error)}",
                          highlight=False, soft_wrap=True)
    loaded = [r for r in report.implementations if r.outputs is not None]
    if report.pairs:
        values = Table("output", *(r.name for r in loaded), title="outputs")
        for name in scalar_outputs(loaded[0].outputs):
            values.add_row(name, *(_number(scalar_outputs(r.outputs).get(name), ".6f") for r in loaded))
        console.print(values)
        for pair in report.pairs:
            table = Table("output", "max abs", "max rel", "cosine", "limit", "", title=pair.name)
            for check in pair.checks:
                table.add_row(check.name, _number(check.max_abs, ".3e"), _number(check.max_rel, ".3e"),
                              _number(check.cosine, ".7f"), check.limit,
                              "[green]ok[/]" if check.passed else "[bold red]FAIL[/]")
            console.print(table)
    timing = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in report.seconds.items())
    if report.passed:
        console.print(f"[bold green]PASS[/] {len(report.implementations)} implementations agree on every output "
                      f"({timing})", highlight=False)
        return
    for pair in report.pairs:
        console.print(f"  {pair.name}: " + ("[green]agree[/]" if pair.passed else "[bold red]differ[/]"), highlight=False)
    if report.departure is not None:
        console.print(f"  transformers and PyTorch part {report.departure}", highlight=False)
    odd = report.odd_one_out()
    if odd is not None:
        console.print(f"[bold red]FAIL[/] the odd one out is {odd}" +
                      (": the conversion (or the MindSpore model) is wrong" if odd == "MindSpore" else
                       f": {odd} disagrees with the others"), highlight=False)
    console.print("[bold red]FAIL[/] " + escape("; ".join(report.failures())) +
                  "\n  localise it with: crossalign diagnose --model ... --input ... --converted ...",
                  highlight=False, soft_wrap=True)
    raise typer.Exit(1)
