"""`farm zoo …`: the model zoo, its nightly runs, their history and report."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from farm.cli_common import StoreOpt, cannot_write, fail, interrupted, open_store

zoo_app = typer.Typer(no_args_is_help=True, rich_markup_mode="markdown",  # as farm/cli.py's app
                      help="The model zoo: export it, run a suite nightly, report on the history.")
SuiteOpt = typer.Option("smoke", "--suite", help="smoke, hf, nightly, or a team's own: path/to/zoo.py or package.module:NAME")
ReportOpt = typer.Option(Path(".farm/zoo-report.html"), "--report", help="where to write the HTML report")


@zoo_app.command("list")
def zoo_list(suite: str = SuiteOpt) -> None:
    """The entries of a suite: family, targets, tolerances, and the optional packages they need."""
    from farm.console import out
    from farm.zoo import load_suite
    from rich.table import Table

    try:
        entries = load_suite(suite)
    except ValueError as e:
        raise fail(str(e)) from e
    table = Table(title=f"suite {suite}")
    for col in ("model", "family", "targets", "atol / rtol", "needs"):
        table.add_column(col)
    for e in entries:
        missing = e.missing()
        needs = ", ".join(e.needs) + (" (missing: pip install -e '.[hf]')" if missing else "") if e.needs else "-"
        table.add_row(e.name, e.family, ", ".join(e.targets), f"{e.atol:g} / {e.rtol:g}", needs)
    out.print(table)


@zoo_app.command("export")
def zoo_export(dest: Path, model: list[str] = typer.Option([], "--model", help="only these models (default: the smoke suite)")) -> None:
    """Export zoo models as .pt2 files into DEST, with a job.yaml that compiles them."""
    from farm.console import out
    from farm.zoo import export_zoo

    try:
        paths = export_zoo(dest, model or None)
    except (ValueError, ModuleNotFoundError) as e:
        raise fail(str(e)) from e
    except OSError as e:
        raise cannot_write(dest, e) from e
    for p in paths:
        out.print(f"wrote {p}")
    out.print(f"wrote {dest / 'job.yaml'} (farm submit {dest / 'job.yaml'})")


@zoo_app.command("run")
def zoo_run(
    suite: str = SuiteOpt,
    store: str = StoreOpt,
    address: Optional[str] = typer.Option(None, help="Ray cluster to join (default: RAY_ADDRESS, else start a local Ray)"),
    report: Path = ReportOpt,
    date: Optional[str] = typer.Option(None, help="the history date of this run, YYYY-MM-DD (default: today, UTC)"),
    target: list[str] = typer.Option([], "--target", "-t", help="compile every entry for these targets instead of "
                                     "the suite's own, e.g. -t aoti-cpu -t executorch:xnnpack -t core-aten"),
) -> None:
    """Export and compile a suite on the farm, append it to the store's history, write the report, and exit 1
    when it regressed against the previous run (new failures, compile time +20%, speedup -10%, numerics)."""
    from farm.console import ProgressEvents, out
    from farm.nightly import run_suite
    from farm.report import write_report
    from scheduler.errors import JobInterrupted
    from scheduler.spec import SpecError
    from storage import StoreError

    s = open_store(store)
    try:
        run = run_suite(suite, s, address=address, date=date, progress=ProgressEvents, targets=target or None,
                        follow=_follow)
    except (ValueError, SpecError, StoreError) as e:
        raise fail(str(e)) from e
    except JobInterrupted as e:
        raise interrupted(e.job_id, store) from None
    try:
        write_report(run.history.to_pylist(), report)
    except OSError as e:  # the run is in the store's history: `farm zoo report` writes it again
        raise cannot_write(report, e) from e
    counts = {k: sum(r["status"] == k for r in run.rows) for k in ("compiled", "hit", "failed", "skipped")}
    out.print(f"run {run.run_id} ({run.date}): " + ", ".join(f"{v} {k}" for k, v in counts.items())
              + f". History: {s.uri}/history · report: {report}")
    if run.regressions:
        _print_regressions(run.regressions)
        raise typer.Exit(1)
    out.print("no regressions against the previous run")


def _follow(handle) -> None:
    """A job of the run that the farm service runs: its status as it changes, until it ends."""
    from farm.console import out, watch_status

    out.print(f"job {handle.job_id} on the farm service: `farm status {handle.job_id} --watch --store "
              f"{handle.store.uri}` follows it from any machine, `farm cancel {handle.job_id}` cancels it")
    try:
        watch_status(handle.status, 0.25)
    except KeyboardInterrupt:
        out.print("stopped following; the run's jobs keep running on the farm service (`farm jobs`, `farm cancel "
                  "JOB`), and this run is not added to the history")
        raise typer.Exit(130) from None


@zoo_app.command("report")
def zoo_report(store: str = StoreOpt, report: Path = ReportOpt) -> None:
    """Write the HTML report from the store's history alone."""
    from farm.console import out
    from farm.report import write_report
    from storage import StoreError
    from storage.history import read_history

    try:
        rows = read_history(open_store(store, create=False)).to_pylist()
    except StoreError as e:
        raise fail(str(e)) from e
    if not rows:
        raise fail(f"no history in {store}: run `farm zoo run --store {store}` first")
    try:
        written = write_report(rows, report)
    except OSError as e:
        raise cannot_write(report, e) from e
    out.print(f"wrote {written} ({len({r['run_id'] for r in rows})} runs)")


def _print_regressions(regressions) -> None:
    from rich.markup import escape

    from farm.console import console

    console.print(f"[red]{len(regressions)} regression(s) against the previous run:[/red]")
    for r in regressions:
        console.print(f"  {escape(r.model)} · {escape(r.target)}: [bold]{r.kind}[/bold]: {escape(r.detail)}")
