"""What every `farm` command shares: the store option and how errors are reported."""
from __future__ import annotations

import typer

from storage.uri import default_store

DEFAULT_STORE = default_store()
StoreOpt = typer.Option(DEFAULT_STORE, "--store", help="a directory, file://… or s3://bucket/prefix (env FARM_STORE)")


def fail(message: str, code: int = 2) -> typer.Exit:
    from rich.markup import escape

    from farm.console import console

    console.print(f"[red]error:[/red] {escape(message)}")
    return typer.Exit(code)


def open_store(uri: str):
    from farm.stores import open_store as opened
    from storage import StoreError

    try:
        return opened(uri)
    except (ValueError, StoreError) as e:
        raise fail(str(e)) from e
