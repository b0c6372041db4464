"""Running a whole job: plan it, run its units with some runner, keep the results.

Runners take units and report each result exactly once; the in-process runner lives here,
the Ray one in `ray_pool`. While a job runs, `jobs/<id>/status.json` in the store says how
far it got, so `farm status JOB` works from any machine."""
from __future__ import annotations

import datetime as dt
import itertools
import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

from scheduler.errors import JobInterrupted
from scheduler.kept_sandbox import warm_sandbox
from scheduler.plan import check_specializations, plan, plan_gangs
from scheduler.spec import JobSpec, SpecError, job_to_yaml
from scheduler.tuning import finish_tuning
from storage import Store, StoreError
from storage.results import write_results
from storage.stats import JobStats, write_stats
from workers.pipeline import run_unit
from workers.sandbox.process import Sandbox
from workers.unit import Gang, Unit, UnitResult

log = logging.getLogger(__name__)

STATUS_FILE = "status.json"
ENDED = ("done", "rejected", "cancelled", "failed")  # a job's states once it will change no more
WRITE_EVERY_S = 1.0  # status.json is written at most this often, and a change at most this late
BEAT_S = 60.0  # ...and at least this often while the job runs, so a reader can tell a job nobody runs any more
SILENT_S = 600.0  # a planning or running job whose record is older than this: its process has stopped
TRANSIENT_PAUSE_S = 5.0  # before the first run again of units the store failed; doubles each round
KEYS_FILE = "keys.json"  # every unit's key and its components, so `farm explain --job` can diff misses
OUTCOME_FILE = "outcome.json"  # every unit's whole result but its key components, for a client that did not run the job


class Events(Protocol):
    def planned(self, units: list[Unit]) -> None: ...
    def started(self, unit: Unit) -> None: ...
    def retried(self, unit: Unit) -> None: ...
    def finished(self, unit: Unit, result: UnitResult) -> None: ...
    def ran_again(self, unit: Unit, previous: UnitResult) -> None: ...  # a finished unit queued once more
    # a pool's load per device class: units queued, workers busy and idle
    def load(self, queued: dict[str, int], busy: dict[str, int], idle: dict[str, int]) -> None: ...


class NoEvents(Events):
    """Ignores every event (the protocol's methods do nothing)."""


Runner = Callable[[list[Unit], Store, Events], Iterable[tuple[Unit, UnitResult]]]


def run_in_process(units: list[Unit], store: Store, events: Events) -> Iterable[tuple[Unit, UnitResult]]:
    """One warm child for the whole job: the process's kept sandbox's (scheduler/kept_sandbox.py),
    or a sandbox of its own while another job (another thread) has that."""
    with warm_sandbox() as sandbox:
        yield from run_units_in(sandbox, units, store, events)


def run_units_in(sandbox: Sandbox, units: list[Unit], store: Store, events: Events) -> Iterable[tuple[Unit, UnitResult]]:
    """The units one after another in this process, their untrusted steps in `sandbox`."""
    for unit in units:
        events.started(unit)
        result = run_unit(unit, store, sandbox)
        events.finished(unit, result)
        yield unit, result


def run_gangs(runner: Runner, gangs: list[Gang], store: Store, events: Events) -> Iterable[tuple[Unit, UnitResult]]:
    """Gangs need a process per rank at once: runners that can place them have a `gangs` method."""
    place = getattr(runner, "gangs", None)
    if place is not None:
        yield from place(gangs, store, events)
        return
    for gang in gangs:
        for unit in gang.ranks:
            result = UnitResult(unit.graph, unit.target.label, "failed", retryable=True,
                                error=f"gang {gang.label}: a multi-rank model compiles as a gang of {gang.world_size} "
                                      f"processes, on Ray; run the job with `farm run` or `farm submit`")
            events.finished(unit, result)
            yield unit, result


def _again_if_transient(runner: Runner, units: list[Unit], store: Store, events: Events,
                        rounds: int) -> list[tuple[Unit, UnitResult]]:
    """Run the units; those that failed because the store could not be reached run again, after
    a pause that doubles each round (an S3 endpoint restarting, a network blip), up to `rounds`
    times. Publishing is all-or-nothing, so a unit cut off mid-publish left nothing behind."""
    done = list(runner(units, store, events)) if units else []
    for round_ in range(rounds):
        again = [i for i, (_, r) in enumerate(done) if r.status == "failed" and r.transient]
        if not again:
            break
        time.sleep(TRANSIENT_PAUSE_S * 2 ** round_)
        for i in again:
            events.ran_again(*done[i])
        where = {done[i][0].unit_id: i for i in again}
        for unit, result in runner([done[i][0] for i in again], store, events):  # in the order they finish
            i = where[unit.unit_id]
            result.retries += done[i][1].retries + 1
            done[i] = (unit, result)
    return done


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def empty_status(job_id: str, state: str) -> dict[str, Any]:
    """A status document with nothing counted yet: a job that is planning, or a farm service's job
    not started yet (its client reads this shape from either)."""
    return {"job_id": job_id, "state": state, "total": 0, "queued": 0, "running": 0, "compiled": 0, "hit": 0,
            "failed": 0, "skipped": 0, "retries": 0, "running_units": []}


def silent_for(doc: dict[str, Any], now: float | None = None) -> float | None:
    """Seconds since a planning or running job's record was written, where that is over SILENT_S:
    the process running it writes it every BEAT_S, so it has stopped (killed, its machine gone)
    without saying so. None for a job that ended, waits in an inbox or was heard from lately."""
    if doc.get("state") not in ("planning", "running") or not doc.get("updated_at"):
        return None
    try:
        quiet = (time.time() if now is None else now) - dt.datetime.fromisoformat(doc["updated_at"]).timestamp()
    except (TypeError, ValueError):
        return None
    return quiet if quiet > SILENT_S else None


def silence_note(doc: dict[str, Any]) -> str | None:
    """What a reader says of a job whose process stopped without ending it (silent_for), or None."""
    quiet = silent_for(doc)
    if quiet is None:
        return None
    return (f"nothing heard from it for {quiet / 60:.0f} min (it writes its record every {BEAT_S:.0f} s while it "
            f"runs): the process running it has stopped; run the job again, and what it published is a hit")


class StatusFile:
    """Counts the job's progress and writes it to the store (at most once a second, and at least
    every BEAT_S until it ends: silent_for)."""

    def __init__(self, store: Store, job_id: str, inner: Events):
        self.store, self.job_id, self.inner = store, job_id, inner
        self.doc: dict[str, Any] = {**empty_status(job_id, "planning"), "started_at": _now()}
        self._running: dict[str, dict[str, Any]] = {}
        self._written = 0.0
        self._lock = threading.RLock()  # events come from the job's thread, a late write from a timer's
        self._later: threading.Timer | None = None
        self._ended = threading.Event()
        self.write(force=True)
        threading.Thread(target=self._beat, name=f"farm-status-{job_id}", daemon=True).start()

    def _beat(self) -> None:
        while not self._ended.wait(BEAT_S):
            self.write(force=True)

    def write(self, force: bool = False) -> None:
        """Progress for watchers: a write the store refuses is logged and made up by the next one,
        never a reason to stop the job. A change within a second of the last write is written
        when that second is up (so a unit that starts right after another ended shows as running)."""
        with self._lock:
            wait = WRITE_EVERY_S - (time.monotonic() - self._written)
            if not force and wait > 0:
                if self._later is None:
                    self._later = threading.Timer(wait, self._write_later)
                    self._later.daemon = True
                    self._later.start()
                return
            self.doc["updated_at"] = _now()
            self.doc["running_units"] = list(self._running.values())
            try:
                self.store.put_job_file(self.job_id, STATUS_FILE, json.dumps(self.doc, indent=1).encode())
            except StoreError as e:
                log.warning("job %s: status not written (%s); the next update tries again", self.job_id, e)
                return
            self._written = time.monotonic()

    def end(self, **fields: Any) -> None:
        """The job's final state, written now; the first one said stands."""
        with self._lock:
            if self._ended.is_set():
                return
            self._ended.set()
            self.doc.update(fields)
            self.write(force=True)

    def _write_later(self) -> None:
        with self._lock:
            self._later = None
            if self.doc["state"] == "running":  # a final state was written (forced) meanwhile: nothing is late
                self.write(force=True)
    def planned(self, units: list[Unit]) -> None:
        with self._lock:
            # the programs in flight: a job record refers to them, so the store's collector keeps them
            # until the units that need them have published (storage/gc.py)
            programs = sorted({u.program.digest for u in units if u.program is not None})
            self.doc.update(state="running", total=len(units), queued=len(units), programs=programs)
            self.write(force=True)
        self.inner.planned(units)

    def started(self, unit: Unit) -> None:
        with self._lock:
            self.doc["queued"] -= 1
            self.doc["running"] += 1
            self._running[unit.unit_id] = {"graph": unit.graph, "target": unit.target.label, "since": time.time()}
            self.write()
        self.inner.started(unit)

    def retried(self, unit: Unit) -> None:
        with self._lock:
            self._running.pop(unit.unit_id, None)
            self.doc["running"] -= 1
            self.doc["queued"] += 1
            self.doc["retries"] += 1
            self.write()
        self.inner.retried(unit)

    def ran_again(self, unit: Unit, previous: UnitResult) -> None:
        with self._lock:
            self.doc[previous.status] -= 1
            self.doc["queued"] += 1
            self.doc["retries"] += 1
            self.write()
        self.inner.ran_again(unit, previous)

    def load(self, queued: dict[str, int], busy: dict[str, int], idle: dict[str, int]) -> None:
        with self._lock:
            self.doc["device_classes"] = {c: {"queued": queued.get(c, 0), "busy": busy.get(c, 0), "idle": idle.get(c, 0)}
                                          for c in sorted(set(queued) | set(busy) | set(idle))}
        self.inner.load(queued, busy, idle)

    def finished(self, unit: Unit, result: UnitResult) -> None:
        with self._lock:
            self._running.pop(unit.unit_id, None)
            if self.doc["running"] > 0:
                self.doc["running"] -= 1
            else:  # failed before it ever started (could not be placed)
                self.doc["queued"] -= 1
            self.doc[result.status] += 1
            # what the job's results will name, referred to from now on: the store's collector keeps
            # a finished unit's blobs while the job runs, before its results table is written
            self.doc.setdefault("blobs", []).extend(ref.digest for ref in (result.artifact, result.log, result.trace) if ref)
            self.write()
        self.inner.finished(unit, result)


@dataclass
class JobOutcome:
    job_id: str
    store_uri: str
    results: list[UnitResult] = field(default_factory=list)
    wall_s: float = 0.0
    stats: JobStats = field(default_factory=JobStats)

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def retries(self) -> int:
        return sum(r.retries for r in self.results)


def new_job_id(name: str) -> str:
    return f"{name}-{dt.datetime.now(dt.timezone.utc):%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def execute(job: JobSpec, store: Store, runner: Runner = run_in_process, events: Events = NoEvents(),
            job_id: str | None = None, settle: Callable[[], str] = lambda: "done") -> JobOutcome:
    """Run the job; its record ends `done`, or what `settle` says once its units ended (a farm
    service's job cancelled while units ran ends `cancelled`: its status never says `done` first)."""
    start = time.perf_counter()
    outcome = JobOutcome(job_id or new_job_id(job.name), store.uri)
    store.put_job_file(outcome.job_id, "job.yaml", job_to_yaml(job).encode())
    status = StatusFile(store, outcome.job_id, events)
    try:  # whatever stops it, the record must not say it still runs (`farm jobs`, `farm status`)
        return _execute(job, store, runner, status, outcome, start, settle)
    except KeyboardInterrupt:
        status.end(state="cancelled", error="interrupted (Ctrl-C) in the process that ran it")
        raise JobInterrupted(outcome.job_id) from None
    except SpecError as e:
        status.end(state="rejected", error=str(e))
        raise
    except BaseException as e:
        status.end(state="failed", error=f"{type(e).__name__}: {e}")
        raise


def _execute(job: JobSpec, store: Store, runner: Runner, status: StatusFile, outcome: JobOutcome,
             start: float, settle: Callable[[], str]) -> JobOutcome:
    units = plan(job, store)
    gangs = plan_gangs(job, store)
    check_specializations(job, store, units)
    status.planned(units + [u for gang in gangs for u in gang.ranks])
    done = _again_if_transient(runner, units, store, status, job.limits.retries) + list(run_gangs(runner, gangs, store, status))
    outcome.results = [result for _, result in done] + finish_tuning(done, store)
    outcome.wall_s = time.perf_counter() - start
    rows = [r.to_row(outcome.job_id) for r in outcome.results]
    outcome.stats = JobStats.from_rows(rows)
    try:
        _write_outcome(store, outcome, rows)
    except StoreError as e:  # what published stays published; the job's record must not say it still runs
        status.end(state="failed", error=f"its results were not written: {e}")
        raise
    status.end(state=settle(), wall_s=round(outcome.wall_s, 3))
    return outcome


def _write_outcome(store: Store, outcome: JobOutcome, rows: list[dict[str, Any]]) -> None:
    write_results(store, outcome.job_id, rows)
    store.flush_journal()  # what this process published, for the collector (storage/unit_refs.py)
    write_stats(store, outcome.job_id, outcome.stats)
    store.put_job_file(outcome.job_id, KEYS_FILE, json.dumps(_keys(outcome.results), indent=1).encode())
    store.put_job_file(outcome.job_id, OUTCOME_FILE, json.dumps(  # the key components are keys.json's alone
        {"wall_s": outcome.wall_s, "results": [{**r.to_dict(), "components": None} for r in outcome.results]},
        default=str).encode())


def _keys(results: list[UnitResult]) -> list[dict[str, Any]]:
    return [{"graph": r.graph, "target": r.target, "status": r.status, "key": r.key, "error": r.error,
             "note": r.note, "components": r.components} for r in results]


def read_keys(store: Store, job_id: str) -> list[dict[str, Any]] | None:
    data = store.get_job_file(job_id, KEYS_FILE)
    return None if data is None else json.loads(data)


def read_outcome(store: Store, job_id: str) -> JobOutcome | None:
    """A finished job's outcome as its runner wrote it (a farm service's job, read by its client)."""
    data = store.get_job_file(job_id, OUTCOME_FILE)
    if data is None:
        return None
    doc = json.loads(data)
    keys = read_keys(store, job_id) or []  # written beside it, in the same order
    results = [UnitResult.from_dict({**r, "components": k.get("components") if k else None})
               for r, k in itertools.zip_longest(doc["results"], keys[: len(doc["results"])])]
    rows = [r.to_row(job_id) for r in results]
    return JobOutcome(job_id, store.uri, results, doc["wall_s"], JobStats.from_rows(rows))


def read_status(store: Store, job_id: str) -> dict[str, Any] | None:
    data = store.get_job_file(job_id, STATUS_FILE)
    return None if data is None else json.loads(data)
