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


def open_store(uri: str, create: bool = True):
    """The store a command names; without `create` (commands that only read), a local store that
    is not there is said (a mistyped --store), not made empty."""
    from farm.stores import open_store as opened
    from storage import StoreError

    try:
        return opened(uri, create=create)
    except (ValueError, StoreError) as e:
        raise store_failed(e) from e


def store_failed(e: Exception) -> typer.Exit:
    """A store that could not be opened or read, said; a local one not there, with the fix."""
    from storage import NoSuchStore

    fix = "; name the store with --store or FARM_STORE (a job that writes there makes it)"
    return fail(f"{e}{fix if isinstance(e, NoSuchStore) else ''}")


def interrupted(job_id: str, store: str) -> typer.Exit:
    """Ctrl-C stopped a job this process ran (scheduler.errors.JobInterrupted): what became of it."""
    from farm.console import console

    console.print(f"interrupted: job {job_id} ends as cancelled. What it compiled is published, the unit in flight "
                  f"published nothing; run it again to compile the rest (`farm status {job_id} --store {store}`)")
    return typer.Exit(130)


def cannot_write(path, e: OSError) -> typer.Exit:
    """A path the user named that this process could not write: which, and why; no traceback."""
    return fail(f"cannot write {path}: {e.strerror or e}; give a path where you can write")
