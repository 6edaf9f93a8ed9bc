"""The README's commands as a shell would run them: every command of its fenced shell blocks that starts with
``crossalign`` or ``.venv/bin/crossalign`` (tests/test_readme_commands.py, tests/test_flow_embedded.py)."""

from __future__ import annotations

import shlex
from pathlib import Path

README = Path(__file__).resolve().parent.parent.parent / "README.md"
PROGRAMS = ("crossalign", ".venv/bin/crossalign")
REDIRECTIONS = (">", ">>", "<", ">&", "&>", ">|")
SEPARATORS = (";", "&&", "||", "|", "&")
SHELL_VARIABLES = {"$pool": "gpu"}  # the one-machine recipe's `for pool in orchestrator npu cpu gpu`

# run on a finished embedded run by tests/test_flow_embedded.py, in a folder whose runs/ is its store
# (RUN and the example's run id: that run)
RUN_COMMANDS = (
    ".venv/bin/crossalign diagnose --run runs/qwen35_dense_tiny-20261129-171129",
    "crossalign rerun runs/RUN --step megatron-train --dump",
    "crossalign rerun runs/RUN --step pynative-train --dump",
    "crossalign diagnose --run runs/RUN",
)


def readme_commands() -> list[str]:
    """Each crossalign command of the README's fenced shell blocks, as its line writes it: shell comments,
    redirections and background marks left out, commands joined by ; && | or a loop's ``do`` taken one by one."""
    commands = []
    for line in _shell_lines(README.read_text()):
        for argv in _commands_of(line):
            if argv and argv[0] in PROGRAMS:
                commands.append(shlex.join(argv))
    return commands


def _shell_lines(markdown: str) -> list[str]:
    """The lines of the fenced blocks marked bash or sh, a line continued with a backslash joined to the next."""
    lines, language = [], None
    for line in markdown.replace("\\\n", " ").splitlines():
        if line.startswith("```"):
            language = line[3:].strip() if language is None else None
        elif language in ("bash", "sh", "shell"):
            lines.append(line)
    return lines


def _commands_of(line: str) -> list[list[str]]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    tokens = list(lexer)
    commands, current, skip = [], [], False
    for index, token in enumerate(tokens):
        if skip:
            skip = False
        elif token in SEPARATORS:
            commands.append(current)
            current = []
        elif token in REDIRECTIONS:
            skip = True  # and its target
        elif token.isdigit() and index + 1 < len(tokens) and tokens[index + 1] in REDIRECTIONS:
            continue  # the descriptor of a redirection (2>&1)
        elif not current and token in ("do", "then"):
            continue
        else:
            current.append(SHELL_VARIABLES.get(token, token))
    commands.append(current)
    return commands
