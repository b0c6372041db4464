"""What the CLI tells a user, in process: `farm --help` with each command's description on one line
of the listing where the terminal is wide enough (it kept its docstring's line breaks, ragged
mid-sentence), and what Ctrl-C says while a zoo run waits on a farm service."""
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


def test_ctrl_c_while_a_zoo_run_follows_a_service_job_says_what_goes_on_and_exits_130(monkeypatch):
    """A zoo run on a farm service waits on jobs the service runs: Ctrl-C stops the waiting, not the
    jobs, and the run is not added to the history; the user is told so (not a traceback)."""
    import io

    import typer
    from rich.console import Console

    from farm import console
    from farm.zoo_cli import _follow

    printed = io.StringIO()
    monkeypatch.setattr(console, "out", Console(file=printed, width=200))

    class Interrupted:  # the job's status, read as the user presses Ctrl-C
        job_id, store = "zoo-night-0-1", type("Store", (), {"uri": "file:///farm"})()

        def status(self):
            raise KeyboardInterrupt

    ended = None
    try:
        _follow(Interrupted())
    except KeyboardInterrupt:  # (caught here: escaping, it would stop the whole test session)
        pytest.fail("Ctrl-C escaped _follow: the user gets a traceback")
    except typer.Exit as e:
        ended = e
    said = " ".join(printed.getvalue().split())
    assert ended is not None and ended.exit_code == 130
    assert "farm status zoo-night-0-1 --watch --store file:///farm" in said
    assert "keep running on the farm service" in said and "not added to the history" in said
