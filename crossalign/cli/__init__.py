"""The ``crossalign`` command line: one Typer app; each area registers its own commands.

Heavy frameworks (MindSpore, torch, Prefect, and pydantic's config models) are imported inside the
commands, so ``crossalign --help`` stays fast.
"""

from __future__ import annotations

import typer

from crossalign.cli import agents, backends, checkpoint, compare, data, diagnose, models, rehearse, run, runs

app = typer.Typer(
    name="crossalign",
    help="Prove that MindFormers on Ascend and Megatron-LM on GPU train the same Qwen3.5 identically.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

for area in (run, runs, agents, checkpoint, models, data, compare, backends, diagnose, rehearse):
    area.register(app)


def main() -> None:
    app()
