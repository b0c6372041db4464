"""Running `farm` commands in the test process and reading what they print.

The CLI prints through rich consoles bound to copies of fds 1 and 2 taken at start-up (a
unit in flight redirects the real ones into its log), so CliRunner's capture misses them;
here both consoles write into a buffer for the length of the call."""
from __future__ import annotations

import io

from typer.testing import CliRunner


def farm(*args: str) -> str:
    from farm import console
    from farm.cli import app

    buf = io.StringIO()
    saved = console.out.file, console.console.file
    console.out.file = console.console.file = buf
    try:
        result = CliRunner().invoke(app, list(args))
    finally:
        console.out.file, console.console.file = saved
    return buf.getvalue() + result.output
