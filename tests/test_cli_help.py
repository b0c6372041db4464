"""`farm --help` as a user reads it: each command's description on one line of the listing where
the terminal is wide enough (it kept its docstring's line breaks, ragged mid-sentence)."""
from __future__ import annotations

import inspect
import re

import pytest
from typer.testing import CliRunner

from farm.cli import app
from farm.zoo_cli import zoo_app


def _described(typer_app) -> dict[str, str]:
    """Command name → the first paragraph of its docstring, its lines joined, as a user reads it."""
    found = {}
    for command in typer_app.registered_commands:
        name = command.name or command.callback.__name__.replace("_", "-")
        first = inspect.cleandoc(command.callback.__doc__ or "").split("\n\n")[0]
        found[name] = " ".join(first.replace("`", "").split())
    return found


@pytest.mark.parametrize("args, typer_app", [([], app), (["zoo"], zoo_app)], ids=["farm", "farm zoo"])
def test_each_command_is_described_on_one_line_of_the_listing(args, typer_app):
    listing = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "400"})
    assert listing.exit_code == 0, listing.output
    lines = [" ".join(re.sub(r"[│╭╮╰╯─]", " ", line).split()) for line in listing.output.splitlines()]
    described = _described(typer_app)
    assert described and all(described.values()), described  # every command says what it does
    for name, text in described.items():
        assert any(line.startswith(f"{name} {text}") for line in lines), (name, text, listing.output)
