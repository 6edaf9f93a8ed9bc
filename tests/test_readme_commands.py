"""The README's commands, as written: every fenced command line that starts with ``crossalign`` or
``.venv/bin/crossalign`` is read back from the README and parsed by the CLI's own parser (click, under Typer);
those that need only the embedded default run here, and those that take a finished run run on the embedded run
of tests/test_flow_embedded.py (``helpers.readme.RUN_COMMANDS``). The rest name files, servers or checkouts a
site has (logs, Hugging Face folders, a Prefect server): the parser holds them to the options the CLI has."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

try:  # Typer 0.2x parses with its own copy of click
    from typer._click.core import Context
    from typer._click.exceptions import UsageError
except ImportError:
    from click import Context, UsageError

from crossalign.cli import app
from helpers.readme import RUN_COMMANDS, readme_commands

# run by this file: (the README's line, what its output must show, its exit code)
RUN_HERE = {
    "crossalign preflight config --model qwen35_moe --set parallel.megatron.tensor=2 "
    "--set parallel.megatron.sequence_parallel=true --set parallel.megatron.cards_per_node=2":
        ("both sides will train with the same settings", 0),
}
RUN_HERE_SLOW = {
    ".venv/bin/crossalign selfcheck --model qwen35_moe_tiny": ("PASS", 0),
    ".venv/bin/crossalign selfcheck --model qwen35_moe_tiny --fault routed_expert_not_transposed":
        ("FAIL MindSpore vs PyTorch: logits", 1),
    "crossalign selfcheck --model qwen35_dense_tiny --tp 2 --fault in_proj_split_as_one_block":
        ("part first at transformers lm.model.layers.0.linear_attn", 1),
    "crossalign diagnose --model qwen35_moe_tiny --tp 2 --fault in_proj_split_as_one_block":
        ("first divergence at decoder.layers.0.self_attention.in_proj", 1),
    "crossalign diagnose --model qwen35_moe_tiny --ep 2 --fault experts_not_renumbered":
        ("first divergence at decoder.layers.0.mlp.experts", 1),
}


def parse(argv: list[str]) -> Context:
    """The CLI's own parse of ``argv`` (the program name left out), down to the command it names; raises UsageError
    as the CLI would print it, without running anything."""
    command = typer.main.get_command(app)
    context = command.make_context("crossalign", list(argv))
    while hasattr(command, "resolve_command"):  # a group: the rest names one of its commands
        name, command, rest = command.resolve_command(context, [*context._protected_args, *context.args])
        context = command.make_context(name, rest, parent=context)
    return context


def test_the_readme_commands_are_found_as_the_readme_writes_them():
    commands = readme_commands()
    assert len(commands) >= 30, commands
    # the loop and the redirections of the one-machine recipe
    assert ".venv/bin/crossalign agent start --pool gpu" in commands
    assert ".venv/bin/crossalign server start" in commands
    listed = {*RUN_HERE, *RUN_HERE_SLOW, *RUN_COMMANDS}
    assert not listed - set(commands), f"run by the tests but no longer in the README: {listed - set(commands)}"


@pytest.mark.parametrize("command", readme_commands())
def test_every_readme_command_parses_as_written(command):
    try:
        context = parse(shlex.split(command)[1:])
    except UsageError as exc:
        pytest.fail(f"{command}: {exc.format_message()}")
    assert context.command.callback is not None, f"{command}: names a group, not a command"


def test_a_command_the_cli_does_not_have_is_refused_by_the_parse():
    for argv in (["preflight", "config", "--model", "qwen35_moe", "..."], ["rerun", "runs/RUN", "--stepp", "x"],
                 ["serve", "--hots", "0.0.0.0"]):
        with pytest.raises(UsageError):
            parse(argv)


def _run_as_written(command: str, tmp_path: Path, monkeypatch) -> tuple[str, int]:
    monkeypatch.chdir(tmp_path)  # what a command writes by default (./diagnose, ./runs) stays here
    monkeypatch.delenv("CROSSALIGN_SITE", raising=False)
    done = CliRunner().invoke(app, shlex.split(command)[1:], env={"COLUMNS": "200"})
    return done.output, done.exit_code


@pytest.mark.parametrize("command", list(RUN_HERE))
def test_readme_commands_run_as_written(command, tmp_path, monkeypatch):
    shown, code = RUN_HERE[command]
    output, exit_code = _run_as_written(command, tmp_path, monkeypatch)
    assert exit_code == code and shown in output, output[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("command", list(RUN_HERE_SLOW))
def test_readme_model_commands_run_as_written_and_say_what_the_readme_says(command, tmp_path, monkeypatch):
    """selfcheck and diagnose of the embedded default (random weights of a shipped config), each with the outcome
    its README comment promises."""
    shown, code = RUN_HERE_SLOW[command]
    output, exit_code = _run_as_written(command, tmp_path, monkeypatch)
    assert exit_code == code and shown in output, output[-3000:]
