"""`farm zoo run`: one nightly run of a zoo suite.

The suite's entries are exported on the cluster's workers (an export that fails is a result
row, not a crash), compiled through the normal job path (keys, hits, autotune, Ray), and one
row per (model, target) is appended to the store's history (storage/history.py). The run is
then compared with the previous run of the suite (farm/regressions.py)."""
from __future__ import annotations

import contextlib
import datetime as dt
import secrets
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

from farm.client import JobHandle, submit
from farm.regressions import Regression, find_regressions
from farm.service_client import find
from farm.zoo import ZooModel, export_bytes, load_suite
from scheduler.jobs import Events, NoEvents
from scheduler.ray_pool import close_workers
from scheduler.ray_tasks import TaskFailed, run_tasks
from scheduler.ray_session import ray_session
from scheduler.spec import parse_job
from scheduler.warm_workers import WarmWorkers
from storage import Store
from storage.history import append_run, history_path, read_history
from workers.keys import toolchain
from workers.unit import UnitResult

EXPORT_TIMEOUT_S = 1800.0


@dataclass
class NightlyRun:
    run_id: str
    date: str
    rows: list[dict[str, Any]]
    regressions: list[Regression]
    history: Any  # pyarrow.Table: every run so far, this one included


@dataclass(frozen=True)
class Exported:
    entry: ZooModel
    path: Path | None
    seconds: float | None
    error: str | None  # why it was not exported (skipped or failed)
    skipped: bool = False
    packages: dict[str, str] = field(default_factory=dict)  # optional packages' versions on the exporting worker


def run_suite(suite_ref: str, store: Store, address: str | None = None, date: str | None = None,
              progress: Callable[[], ContextManager[Events]] = lambda: contextlib.nullcontext(NoEvents()),
              targets: list[str] | None = None,
              follow: Callable[[JobHandle], Any] = lambda handle: handle.wait(every=0.25)) -> NightlyRun:
    """`progress` makes the events of one job run here (a live bar per job in the CLI); `follow(handle)`
    waits for one a farm service runs (the CLI prints its status as it changes); `targets` replace
    every entry's own."""
    entries = load_suite(suite_ref)
    if targets:
        entries = [replace(e, targets=tuple(targets)) for e in entries]
    run_at = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    date = date or run_at.date().isoformat()
    suite_name = Path(suite_ref).stem if suite_ref.endswith(".py") else suite_ref.replace(":", ".")
    run_id = f"zoo-{suite_name}-{run_at:%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"
    history_path(date, run_id)  # a bad --date fails now, not after the compiles
    base = {"run_id": run_id, "run_at": run_at, "suite": suite_name}
    rows: list[dict[str, Any]] = []
    with ray_session(address), tempfile.TemporaryDirectory(prefix="farm-zoo-") as tmp:
        service = find(address, store)
        if service is not None:
            service.store(store)  # a store that is not the service's is refused now, before any export
        served = service is not None  # (a farm service's warm workers may hold every CPU)
        exported = _export(suite_ref, entries, Path(tmp), beside=served)
        for e in exported:
            if e.path is None:
                rows += [_unbuilt_row(base, e, t) for t in e.entry.targets]
        jobs = _jobs(run_id, [e for e in exported if e.path is not None])
        for group, handle in _compiled(run_id, jobs, store, address, served, progress, follow):
            by_name = {e.entry.name: e for e in group}
            rows += [_row(base, by_name[r.graph], r, handle.job_id) for r in handle.outcome.results
                     if r.graph in by_name and "[" not in r.target]  # autotune's per-candidate rows stay in the job
    append_run(store, date, run_id, rows)
    history = read_history(store)
    return NightlyRun(run_id, date, rows, find_regressions(history.to_pylist(), run_id), history)


def _compiled(run_id: str, jobs: list[tuple[dict[str, Any], list[Exported]]], store: Store, address: str | None,
              served: bool, progress: Callable[[], ContextManager[Events]],
              follow: Callable[[JobHandle], Any]) -> Iterator[tuple[list[Exported], JobHandle]]:
    """Each job's group of entries, with the job once it ended. A farm service (`served`) gets every
    job of the run at once: its workers share them (at priority nightly), so that one group's last
    units do not hold the next group back. Without one, the jobs run here one after another, each
    on the workers the one before left (scheduler/warm_workers.py), which stop with the run."""
    if not served:
        warm = WarmWorkers(run_id)
        try:
            for spec, group in jobs:
                with progress() as events:  # in this session: the client's submit finds it open
                    yield group, submit(parse_job(spec, "farm zoo run"), store, address, events=events, warm=warm)
        finally:
            close_workers(warm)
        return
    handed = [(group, submit(parse_job(spec, "farm zoo run"), store, address, wait=False)) for spec, group in jobs]
    for group, handle in handed:
        follow(handle)
        yield group, handle.wait(every=0.25)  # (ended: its outcome read back from the store)


def _export(suite_ref: str, entries: list[ZooModel], dest: Path, beside: bool) -> list[Exported]:
    """Every entry's program, exported on a worker; entries whose optional packages are missing here
    are skipped. `beside`: beside a farm service's workers, which may hold every CPU while warm
    (scheduler.ray_tasks.run_tasks); the export would otherwise wait for them to stop."""
    out: dict[str, Exported] = {}
    wanted = []
    for entry in entries:
        missing = entry.missing()
        if missing:
            out[entry.name] = Exported(entry, None, None, f"needs {', '.join(missing)} (pip install -e '.[hf]')", True)
        else:
            wanted.append(entry)
    replies = run_tasks(export_bytes, [(suite_ref, e.name) for e in wanted], "zoo export", EXPORT_TIMEOUT_S,
                        beside=beside)
    for entry, reply in zip(wanted, replies):
        if isinstance(reply, TaskFailed):
            out[entry.name] = Exported(entry, None, None, f"export failed: {reply.error}")
            continue
        data, seconds, packages = reply
        path = dest / f"{entry.name}.pt2"
        path.write_bytes(data)
        out[entry.name] = Exported(entry, path, seconds, None, packages=packages)
    return [out[e.name] for e in entries]


def _jobs(run_id: str, ready: list[Exported]) -> list[tuple[dict[str, Any], list[Exported]]]:
    """One job per (targets, tolerances, modules): a job's verification settings apply to all its graphs."""
    groups: dict[tuple, list[Exported]] = defaultdict(list)
    for e in ready:
        m = e.entry
        groups[(m.targets, m.atol, m.rtol, m.modules)].append(e)
    return [({"name": f"{run_id}-{i}", "priority": "nightly", "targets": list(targets), "modules": list(modules),
              "verify": {"atol": atol, "rtol": rtol},
              "graphs": [{"path": str(e.path), "name": e.entry.name} for e in group]}, group)
            for i, ((targets, atol, rtol, modules), group) in enumerate(groups.items())]


def _toolchain(e: Exported, components: dict[str, Any] | None) -> dict[str, Any]:
    """The worker's toolchain from the unit's key components; this host's for a unit that never had a key."""
    tools = (components or {}).get("toolchain") or toolchain()
    return {"torch": tools.get("torch"), "torch_git": tools.get("torch_git"), "python": tools.get("python"),
            "cxx": tools.get("cxx"), "transformers": e.packages.get("transformers")}


def _row(base: dict[str, Any], e: Exported, r: UnitResult, job_id: str) -> dict[str, Any]:
    table = r.to_row(job_id)
    m = r.metrics
    return {**base, "model": e.entry.name, "family": e.entry.family, "target": r.target, "status": r.status,
            "failed_phase": (r.failed_in or "gang") if r.status == "failed" else None, "error": r.error,
            "hit": r.status == "hit", "export_s": e.seconds,
            "compile_s": table["compile_s"] if r.status == "compiled" else r.saved_s,
            "max_abs_err": m.get("max_abs_err"), "max_rel_err": m.get("max_rel_err"),
            "atol": e.entry.atol, "rtol": e.entry.rtol, "eager_ms": m.get("eager_ms"),
            "compiled_ms": m.get("compiled_ms"), "speedup": m.get("speedup"), "mode": _mode(r.target),
            "saved_activation_bytes": int(m["saved_activation_bytes"]) if m.get("saved_activation_bytes") is not None else None,
            "artifact_bytes": r.artifact.size if r.artifact else None, "key": r.key, "job_id": job_id,
            **_toolchain(e, r.components)}


def _mode(target: str) -> str:
    return "train" if target.endswith("+train") else "inference"


def _unbuilt_row(base: dict[str, Any], e: Exported, target: str) -> dict[str, Any]:
    return {**base, "model": e.entry.name, "family": e.entry.family, "target": target,
            "status": "skipped" if e.skipped else "failed", "failed_phase": None if e.skipped else "export", "mode": _mode(target),
            "error": e.error, "hit": False, "atol": e.entry.atol, "rtol": e.entry.rtol, **_toolchain(e, None)}
