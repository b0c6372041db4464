"""Progress and tables for people. The console writes to a copy of stderr taken at start-up,
because a unit in flight sends file descriptors 1 and 2 into its own log."""
from __future__ import annotations

import atexit
import math
import os
import sys
import time

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from scheduler.jobs import NoEvents
from storage.stats import JobStats
from workers.unit import Unit, UnitResult

_err = os.fdopen(os.dup(sys.stderr.fileno()), "w", buffering=1)
_out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
atexit.register(_err.close)
atexit.register(_out.close)
console = Console(file=_err, highlight=False, soft_wrap=True)
out = Console(file=_out, highlight=False, width=160)


LOG_EVERY_S = 10.0


class ProgressEvents(NoEvents):
    """A live bar with counts per outcome and the unit in hand. Where stderr is a log (CI, a pipe),
    which a redrawn bar would fill with one truncated line at the end: a line per unit compiled,
    failed or queued again, and for hits (hundreds a second) one every LOG_EVERY_S at most."""

    def __init__(self) -> None:
        self.counts = {"compiled": 0, "hit": 0, "failed": 0, "skipped": 0}
        self.running: dict[str, float] = {}
        self.total = 0
        self.retries = 0
        self.log = not console.is_terminal
        self.said_at = time.monotonic()
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[counts]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            console=console, transient=False, disable=self.log,
        )
        self.task = None

    def __enter__(self) -> "ProgressEvents":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def _counts(self) -> str:
        c = self.counts
        queued = self.total - len(self.running) - sum(c.values())
        retries = f" · retries {self.retries}" if self.retries else ""
        return f"queued {queued} · running {len(self.running)} · compiled {c['compiled']} · hits {c['hit']} · failed {c['failed']}{retries}"

    def planned(self, units: list[Unit]) -> None:
        self.total = len(units)
        self.task = self.progress.add_task("compiling", total=len(units), counts=self._counts())

    def started(self, unit: Unit) -> None:
        self.running[unit.unit_id] = time.monotonic()
        self.progress.update(self.task, description="compiling", counts=self._counts())

    def retried(self, unit: Unit) -> None:
        self.running.pop(unit.unit_id, None)
        self.retries += 1
        self.progress.update(self.task, counts=self._counts())
        self._say(f"{unit.graph} ({unit.target}): its worker was lost, queued again")

    def ran_again(self, unit: Unit, previous: UnitResult) -> None:
        self.counts[previous.status] -= 1
        self.retries += 1
        self.progress.update(self.task, advance=-1, counts=self._counts())

    def finished(self, unit: Unit, result: UnitResult) -> None:
        self.running.pop(unit.unit_id, None)
        self.counts[result.status] = self.counts.get(result.status, 0) + 1
        self.progress.update(self.task, advance=1, description="compiling", counts=self._counts())
        if result.status in ("compiled", "failed") or time.monotonic() - self.said_at >= LOG_EVERY_S:
            took = f" in {result.timings['total']:.1f} s" if result.timings.get("total") else ""
            self._say(f"[{sum(self.counts.values())}/{self.total}] {result.graph} ({result.target}): "
                      f"{result.status}{took} · {self._counts()}")

    def _say(self, line: str) -> None:
        if self.log:
            console.print(escape(line), soft_wrap=True)
            self.said_at = time.monotonic()


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


_STYLE = {"compiled": "green", "hit": "cyan", "failed": "red", "skipped": "yellow"}


def results_table(rows: list[dict], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col, kw in [("graph", {}), ("target", {}), ("status", {}), ("max abs err", {"justify": "right"}),
                    ("eager ms", {"justify": "right"}), ("compiled ms", {"justify": "right"}),
                    ("speedup", {"justify": "right"}), ("time s", {"justify": "right"}), ("key / error", {"overflow": "fold"})]:
        table.add_column(col, **kw)
    for r in rows:
        key = r["key"][:16] + "…" if r.get("key") else ""
        if r.get("candidate") and r["target"].endswith("(autotuned)"):
            key = f"winner {r['candidate']} · {key}"
        table.add_row(
            escape(r["graph"]), escape(r["target"]), f"[{_STYLE.get(r['status'], '')}]{r['status']}",
            _fmt(r.get("max_abs_err"), ".2g"), _fmt(r.get("eager_ms"), ".3f"), _fmt(r.get("compiled_ms"), ".3f"),
            _fmt(r.get("speedup"), ".2f") + ("x" if r.get("speedup") else ""), _fmt(r.get("total_s"), ".1f"),
            escape(r.get("error") or key),
        )
    return table


SUMMARY_OVER = 40  # a job of more units prints a summary by target and status, and every failed unit


def job_tables(rows: list[dict], title: str) -> list[Table]:
    """What a finished job prints: every row for a small job; for a big one, counts, compile time
    and geomean speedup by target and status, then each failed unit with its error (`farm results
    JOB` still prints every row)."""
    if len(rows) <= SUMMARY_OVER:
        return [results_table(rows, title)]
    tables = [summary_table(rows, f"{title} · {len(rows)} units, by target and status")]
    failed = [r for r in rows if r["status"] == "failed"]
    if failed:
        table = Table(title=f"{len(failed)} failed", title_justify="left")
        for col in ("graph", "target", "error"):
            table.add_column(col, overflow="fold")
        for r in failed:
            table.add_row(escape(r["graph"]), escape(r["target"]), escape(r.get("error") or "-"))
        tables.append(table)
    return tables


def summary_table(rows: list[dict], title: str) -> Table:
    table = Table(title=title, title_justify="left", min_width=90)
    for col, kw in [("target", {}), ("status", {}), ("units", {"justify": "right"}),
                    ("compile s", {"justify": "right"}), ("geomean speedup", {"justify": "right"})]:
        table.add_column(col, **kw)
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["target"], r["status"]), []).append(r)
    for (target, status), group in sorted(groups.items()):
        compile_s = sum(r.get("compile_s") or 0.0 for r in group)
        speedups = [r["speedup"] for r in group if r.get("speedup")]
        geomean = math.exp(sum(map(math.log, speedups)) / len(speedups)) if speedups else None
        table.add_row(escape(target), f"[{_STYLE.get(status, '')}]{status}", str(len(group)),
                      f"{compile_s:.1f}" if compile_s else "-", _fmt(geomean, ".2f") + ("x" if geomean else ""))
    return table


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def stats_line(stats: JobStats) -> str:
    rate = "-" if stats.hit_rate is None else f"{stats.hit_rate:.0%}"
    wait = f" · waited {stats.lease_wait_s:.1f} s for other workers' compiles" if stats.lease_wait_s >= 0.05 else ""
    return (f"hit rate {rate} ({stats.hits}/{stats.looked_up}) · compile time saved {stats.saved_s:.1f} s · "
            f"spent compiling {stats.compile_s:.1f} s{wait} · moved {_bytes(stats.bytes_uploaded)} up, "
            f"{_bytes(stats.bytes_downloaded)} down, {_bytes(stats.bytes_cached)} from local disk caches")


def diff_table(diffs: list[tuple[str, object, object]], a: str, b: str) -> Table:
    table = Table(title_justify="left")
    table.add_column("component")
    table.add_column(a[:16] + ("…" if len(a) > 16 else ""), overflow="fold")
    table.add_column(b[:16] + ("…" if len(b) > 16 else ""), overflow="fold")
    for path, va, vb in diffs:
        table.add_row(escape(path), "-" if va is None else escape(str(va)), "-" if vb is None else escape(str(vb)))
    return table


def failure_logs(rows: list[dict], store_arg: str) -> list[str]:
    """One line per failed unit telling how to read its log."""
    return [f"  {escape(r['graph'])} ({escape(r['target'])}): farm log {r['log_digest']} --store {store_arg}"
            for r in rows if r["status"] == "failed" and r.get("log_digest")]


_COUNTS = ("total", "queued", "running", "compiled", "hit", "failed", "retries")


def status_line(doc: dict) -> str:
    from scheduler.jobs import silence_note

    counts = " · ".join(f"{k} {doc.get(k, 0)}" for k in _COUNTS)
    updated = f" · updated {doc['updated_at']}" if doc.get("updated_at") else ""  # none while the job waits in an inbox
    silent = silence_note(doc)
    return escape(f"{doc['job_id']}: {doc['state']} · {counts}{updated}" + (f" · {silent}" if silent else ""))


def status_table(doc: dict) -> Table:
    """A job's status document as a table: the counts, then the units in flight and for how long."""
    table = Table(title=status_line(doc), title_justify="left")
    for col in ("graph", "target", "running for"):
        table.add_column(col)
    now = time.time()
    for u in doc.get("running_units", []):
        table.add_row(escape(u["graph"]), escape(u["target"]), f"{now - u['since']:.0f} s")
    return table


def watch_status(read, every: float, to: Console = out) -> dict:
    """Follow the job's status document in the store until the job ends, or is found to have no
    process running it any more (scheduler.jobs.silent_for): read soon at first (a job of hits
    ends in a fraction of a second), then every `every` seconds. On a terminal, a live table of
    the counts and the units in flight, which gives way to the final status line; in a log (CI, a
    pipe), a status line each time the counts change, the last one the final state."""
    from rich.live import Live

    from scheduler.jobs import ENDED, silent_for

    doc = read()
    soon = time.monotonic() + 2.0

    def follow(show) -> dict:
        current = doc
        while current["state"] not in ENDED and silent_for(current) is None:
            time.sleep(min(every, 0.05) if time.monotonic() < soon else every)
            current = read()
            show(current)
        return current

    if to.is_terminal:
        with Live(status_table(doc), console=to, auto_refresh=False, transient=True) as live:
            doc = follow(lambda d: live.update(status_table(d), refresh=True))
        to.print(status_line(doc), soft_wrap=True)
        return doc
    said: list[tuple] = []

    def say(d: dict) -> None:
        if not said or _progress(d) != said[-1]:
            said.append(_progress(d))
            to.print(status_line(d), soft_wrap=True)

    say(doc)
    return follow(say)


def _progress(doc: dict) -> tuple:
    return doc["state"], *(doc.get(k, 0) for k in _COUNTS)
