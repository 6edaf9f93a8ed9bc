"""The ``crossalign`` command line: one Typer app; each area registers its own commands.

Heavy frameworks (MindSpore, torch, Prefect) are imported inside the commands, so
``crossalign --help`` stays fast.
"""

from __future__ import annotations

import typer

from crossalign.cli import backends, checkpoint, compare, data, diagnose, models, orchestration

app = typer.Typer(
    name="crossalign",
    help="Prove that MindFormers on Ascend and Megatron-LM on GPU train the same Qwen3.5 identically.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

@app.command("configs")
def list_configs() -> None:
    """List the shipped model configs with the sizes derived from them."""
    from rich.table import Table

    from crossalign.cli.common import console
    from crossalign.config import CONFIG_DIR, load_config

    table = Table("config", "kind", "layers", "hidden", "experts", "qkv rows", "in_proj rows", "seq", "steps")
    for path in sorted(CONFIG_DIR.glob("*.yaml")):
        cfg = load_config(path)
        m, t = cfg.model, cfg.training
        table.add_row(path.stem, m.kind, "".join("A" if k == "attention" else "G" for k in m.layer_kinds),
                      str(m.hidden_size), str(m.num_experts or "-"), str(m.qkv_rows), str(m.in_proj_rows),
                      str(t.seq_length), f"{t.base_train_iters}+{t.train_iters}")
    console.print(table)


for area in (orchestration, checkpoint, models, data, compare, backends, diagnose):
    area.register(app)


def main() -> None:
    app()
