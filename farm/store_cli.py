"""`farm gc`, `farm du`, `farm pin`, `farm unpin`, `farm pins`: keeping a store bounded."""
from __future__ import annotations

import json
import os
from typing import Any, Optional

import typer

from farm.cli_common import StoreOpt, fail, open_store

JsonOpt = typer.Option(False, "--json", help="print JSON instead of tables")
GraceOpt = typer.Option(86400.0, "--grace-s", help="unreferenced blobs younger than this stay (a publish in flight)")


def _gb(n: int) -> str:
    return f"{n / (1 << 30):.3f} GB" if n >= 1 << 26 else f"{n / (1 << 20):.2f} MB"


def _table(title: str, rows: dict[str, dict[str, int]], first: str):
    from rich.table import Table

    table = Table(title=title)
    for col, justify in ((first, "left"), ("objects", "right"), ("bytes", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for name, t in rows.items():
        table.add_row(name, str(t["count"]), _gb(t["bytes"]))
    return table


def gc(store: str = StoreOpt,
       unused_days: float = typer.Option(30.0, "--unused-days", help="collect units (and job records) not used for this "
                                                                      "many days; 0: every unit that is not pinned"),
       max_gb: Optional[float] = typer.Option(None, "--max-gb", help="then least recently used units too, until the store fits"),
       grace_s: float = GraceOpt,
       dry_run: bool = typer.Option(False, "--dry-run", help="print what would be deleted; delete nothing"),
       as_json: bool = JsonOpt,
       metrics: Optional[bool] = typer.Option(None, "--metrics/--no-metrics",
                                              help="report ray_farm_store_bytes and ray_farm_gc_deleted_total to the "
                                                   "Ray cluster (default: when RAY_ADDRESS is set, as in a RayJob)")) -> None:
    """Delete what the store no longer needs: unused unpinned units, old job records, blobs nothing
    refers to (after a grace period) and expired leases. Safe beside running jobs."""
    from farm.console import console, out
    from storage import StoreError
    from storage.gc import Policy, collect

    try:
        policy = Policy(unused_days=unused_days, grace_s=grace_s, dry_run=dry_run,
                        max_bytes=None if max_gb is None else int(max_gb * (1 << 30)))
    except ValueError as e:
        raise fail(str(e)) from e
    s = open_store(store, create=False)
    try:
        with console.status(f"collecting {s.uri}" + (" (dry run)" if dry_run else "")):
            report = collect(s, policy).to_dict()
    except StoreError as e:
        raise fail(str(e)) from e
    if metrics if metrics is not None else bool(os.environ.get("RAY_ADDRESS")):
        from scheduler.ray_observe import record_store

        record_store(report, s.uri)
    if as_json:
        typer.echo(json.dumps(report, indent=1))
        return
    verb = "would delete" if dry_run else "deleted"
    out.print(_table(f"{verb} from {s.uri}", report["deleted"], "kind"))
    out.print(_table("kept", report["kept"], "kind"))
    spared = f"; {report['spared']} chosen, then kept: used or relied on meanwhile" if report["spared"] else ""
    out.print(f"{report['objects']} objects listed{spared}")
    young = report["young_blobs"]
    if young["count"]:
        out.print(f"of the blobs kept, {young['count']} ({young['bytes'] / 1e6:.2f} MB) are named by nothing, but younger "
                  f"than --grace-s {grace_s:g} (a publish may be in flight): a later gc deletes them", soft_wrap=True)


def du(store: str = StoreOpt, grace_s: float = GraceOpt, as_json: bool = JsonOpt) -> None:
    """What the store holds: by kind, by target, by age of last use, and what `farm gc` would free."""
    from farm.console import console, out
    from storage import StoreError
    from storage.usage import usage

    s = open_store(store, create=False)
    try:
        with console.status(f"listing {s.uri}"):
            u = usage(s, grace_s=grace_s).to_dict()
    except StoreError as e:
        raise fail(str(e)) from e
    if as_json:
        typer.echo(json.dumps(u, indent=1))
        return
    out.print(_table(f"{s.uri}: {u['objects']} objects, {_gb(u['bytes'])}", u["by_kind"], "kind"))
    out.print(_table("units by target (manifest, artifact, log, trace)", u["by_target"], "target"))
    out.print(_table("units by last use", u["by_last_use"], "last used"))
    if u["by_cache_kind"]:
        out.print(_table("PyTorch's remote-cache entries by cache (index, value, kernels)", u["by_cache_kind"], "cache"))
    frees = ", ".join(f"--unused-days {n}: {_gb(b)}" for n, b in u["gc_unused_days_frees_bytes"].items())
    out.print(f"farm gc would free {frees} ({u['pinned_units']} units pinned)")


def pin(key: Optional[str] = typer.Argument(None, help="a unit key or its unique prefix"),
        job: Optional[str] = typer.Option(None, "--job", help="pin every unit of this job (and keep its record)"),
        remote_cache: Optional[list[str]] = typer.Option(None, "--remote-cache", help="keep every PyTorch "
                                                         "remote-cache entry of this kind (`farm du` lists them; all)"),
        label: Optional[str] = typer.Option(None, "--label", help="the pin's name, e.g. release-2026.11"),
        store: str = StoreOpt) -> None:
    """Keep units, and everything they need, whatever their age; or remote-cache entries by kind."""
    from farm.console import out
    from storage import StoreError, UnknownKey
    from storage.pins import pin as make_pin
    from storage.pins import pin_caches

    if [key is not None, job is not None, bool(remote_cache)].count(True) != 1:
        raise fail("name a unit KEY, --job JOB or --remote-cache KIND (one of them)")
    s = open_store(store, create=False)
    try:
        if remote_cache:
            made = pin_caches(s, remote_cache, label=label)
            out.print(f"pinned the remote-cache entries of {', '.join(made.caches)} as {made.name}")
            return
        keys = [s.resolve_key(key)] if key else _job_keys(s, job)
        made = make_pin(s, keys, label=label, job=job)
    except (StoreError, UnknownKey, ValueError) as e:
        raise fail(str(e)) from e
    out.print(f"pinned {len(made.keys)} unit(s) as {made.name}")


def _job_keys(s: Any, job: str) -> list[str]:
    from scheduler.jobs import read_keys

    rows = read_keys(s, job)
    if rows is None:
        raise ValueError(f"no job {job} in {s.uri} (or it has not finished): `farm jobs` lists them")
    return sorted({r["key"] for r in rows if r.get("key") and r.get("status") in ("compiled", "hit")})


def unpin(name: str = typer.Argument(..., help="the pin's name: its label, its key, or job-JOB"),
          store: str = StoreOpt) -> None:
    """Let the collector take a pinned unit again once it goes unused."""
    from farm.console import out
    from storage.pins import unpin as remove

    s = open_store(store, create=False)
    try:
        found = remove(s, name)
    except ValueError as e:
        raise fail(str(e)) from e
    if not found:
        raise fail(f"no pin named {name} in {s.uri}: `farm pins` lists them")
    out.print(f"unpinned {name}")


def pins(store: str = StoreOpt, as_json: bool = JsonOpt) -> None:
    """Every pin, with its label and units."""
    from rich.table import Table

    from farm.console import out
    from storage.pins import pins as every_pin

    found = every_pin(open_store(store, create=False))
    if as_json:
        typer.echo(json.dumps([{"name": p.name, "label": p.label, "keys": list(p.keys), "job": p.job,
                                "caches": list(p.caches), "created_at": p.created_at} for p in found], indent=1))
        return
    table = Table(title=f"{len(found)} pin(s)")
    for col in ("name", "label", "units", "job", "remote caches", "created"):
        table.add_column(col)
    for p in found:
        table.add_row(p.name, p.label or "", str(len(p.keys)), p.job or "", ", ".join(p.caches), p.created_at)
    out.print(table)


def register(app: typer.Typer) -> None:
    for command in (gc, du, pin, unpin, pins):
        app.command(command.__name__)(command)
