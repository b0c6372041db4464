"""One pool of warm workers shared by every job a farm service runs (scheduler/service.py).

Unlike a job's own pool (scheduler/pool.py), it outlives jobs: workers stay up between them,
idle ones beyond `min_workers` stop after `idle_s`. Each job has its own queue; a free worker
takes its next unit from the job `scheduler.fair.FairShare` picks among those with a unit it can
build. The rules kept from the per-job pool: a worker that dies mid-unit is replaced and its
unit re-queued up to `retries` times; a class whose workers die while starting
`start_attempts` times in a row fails its queued units with the worker's error; a unit running
WORKER_GRACE_S past its timeout has its worker replaced; every unit is reported exactly once.

Between jobs a worker's sandbox child is renewed (CompileWorker.rest, called when it goes idle,
and before a unit of another job): no child serves two jobs, and the next one is warm.

A person's unit must not wait for a nightly's to end: beside a CPU class's workers the pool keeps
burst workers for interactive units (scheduler/burst.py).

A gang needs whole placement groups: the pool lends it CPUs and its device class's slots while
it places and runs (scheduler/gang_hold.py). A gang's ranks stay warm after it (`gang_ranks`,
scheduler/gang_warm.py) for later gangs of the same shape, holding no CPU of Ray's while idle,
and leave after `idle_s` as workers do.
The cluster's calls go through `scheduler.pool.Cluster` (Ray's: scheduler/ray_pool.py).
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ray.exceptions import RayTaskError

from scheduler.burst import BurstWorkers
from scheduler.fair import NICENESS, FairShare
from scheduler.gang_hold import GangHolds
from scheduler.gang_warm import WarmRanks
from scheduler import pool
from scheduler.pool import DIED, POLL_S, WORKER_GRACE_S, Cluster, _failed, _route, _worker_error, unoffered
from scheduler.service_config import ServiceConfig
from workers.backends import Placement, resolve
from workers.unit import Unit, UnitLimits, UnitResult

log = logging.getLogger(__name__)
IDLE_POLL_S = 0.05  # how often results are awaited while a worker is free for new units
ROUND_S = 1.0  # how often a round with nothing new assigns, and asks the cluster what it offers


@dataclass(eq=False)  # a slot is itself: two idle ones must never compare equal (list.remove)
class _Slot(pool._Slot):
    """A job's pool slot (scheduler/pool.py), serving units of many jobs."""
    job: str | None = None
    idle_since: float = field(default_factory=time.monotonic)
    rested: bool = True  # its child serves no job yet (renewed since its last unit)
    leaving: bool = False  # stops when its unit ends (the pool shrank under it)
    burst: bool = False  # beyond the pool's CPUs, for interactive units (scheduler/burst.py)

    @property
    def name(self) -> str:
        return f"farm-service/{'burst' if self.burst else 'worker'}/{self.resource}/{self.index}.{self.generation}"

    @property
    def free(self) -> bool:
        return self.ready is None and self.future is None and not self.leaving


@dataclass
class _Pending:
    unit: Unit
    job: str
    retries: int = 0
    queued_at: float = field(default_factory=time.monotonic)


@dataclass
class _Job:
    job_id: str
    priority: str
    outbox: queue.Queue = field(default_factory=queue.Queue)
    queued: int = 0
    running: int = 0
    done: int = 0
    total: int = 0


class SharedPool(BurstWorkers, GangHolds):
    """Units of many jobs in; each job's events and results out through its own outbox."""

    slot_class = _Slot  # what BurstWorkers starts its slots as

    def __init__(self, cluster: Cluster, store_uri: str, config: ServiceConfig = ServiceConfig(),
                 on_start: Callable[[str, str, str, float], None] | None = None):
        self.cluster, self.store_uri, self.config = cluster, store_uri, config
        self.fair = FairShare()
        self.jobs: dict[str, _Job] = {}
        self.slots: list[_Slot] = []
        self.queues: dict[str, collections.deque[_Pending]] = collections.defaultdict(collections.deque)
        self._placements: dict[str, tuple[Placement, str, UnitLimits]] = {}
        self._covers: dict[str, set[str]] = {}  # device class → the classes its workers also build
        self._held = 0  # CPUs lent to gangs (scheduler/gang_hold.py)
        self._held_slots: collections.Counter[str] = collections.Counter()  # device class → its slots lent to gangs
        self._lent: list[str] = []  # classes of workers that left for a gang: started again, warm, after it
        self._offered: dict[str, float] = cluster.offered()
        self._asked = time.monotonic()  # when `_offered` was asked
        self._failed_starts: collections.Counter[str] = collections.Counter()
        self._next_index = 0
        self._burst_after: dict[str, float] = {}  # class -> when a burst worker may be tried again
        self._lock = threading.RLock()
        self._stopping = False
        self._cancelled: set[str] = set()  # jobs cancelled, even before their units came
        self.gang_ranks = WarmRanks(config.idle_s)  # gangs' ranks, kept warm (scheduler/gang_warm.py)
        self._on_start = on_start or (lambda job, unit, priority, wait_s: None)
        self._wake = threading.Event()  # set when units are queued, a job is cancelled, a gang holds or lets go
        self._thread = threading.Thread(target=self._loop, name="farm shared pool", daemon=True)
        self._thread.start()

    # jobs ---------------------------------------------------------------------------
    def run(self, job_id: str, priority: str, units: list[Unit], store, events, cap: int | None = None
            ) -> Iterator[tuple[Unit, UnitResult]]:
        """A runner for one job (scheduler.jobs.Runner): its units queued, its results as they end."""
        with self._lock:
            if self._stopping:
                raise RuntimeError("the farm service is stopping; submit again once it is back")
            early = job_id in self._cancelled  # cancelled while it planned: nothing of it is queued
            if not early:
                job = self._queue(job_id, priority, units, cap)
        if early:
            for unit in units:
                result = _cancelled(unit, "cancelled", running=False)
                events.finished(unit, result)
                yield unit, result
            return
        yield from self._drain(job, len(units), store, events)

    def _queue(self, job_id: str, priority: str, units: list[Unit], cap: int | None) -> _Job:
        job = self.jobs.get(job_id)
        if job is None:
            job = self.jobs[job_id] = _Job(job_id, priority)
            self.fair.add(job_id, priority, cap)
        job.total += len(units)
        # largest first: a job's small units fill the gaps at its end, not a large one alone after them
        for unit in sorted(units, key=lambda u: -u.compile_size):
            placement = _route(unit)
            if placement is None:  # cannot be placed anywhere: the pipeline says why, at once
                job.outbox.put(("unplaceable", unit, None))
                continue
            self._placements[placement.device_class] = (placement, resolve(unit.target).device, unit.limits)
            self.queues[placement.device_class].append(_Pending(unit, job_id))
            job.queued += 1
        # a job's mix of ISAs needs no worker per ISA, and none is stopped to start another
        placements = {r: placement for r, (placement, _, _) in self._placements.items()}
        self._covers = pool.covered_everywhere(placements, self.cluster.nodes())
        self._wake.set()
        return job

    def _drain(self, job: _Job, expected: int, store, events) -> Iterator[tuple[Unit, UnitResult]]:
        from workers.pipeline import run_unit  # unplaceable units fail with the pipeline's reason
        from workers.sandbox.process import Sandbox

        reported = 0
        while reported < expected:
            kind, unit, result = job.outbox.get()
            if kind == "started":
                events.started(unit)
            elif kind == "retried":
                events.retried(unit)
            else:
                if kind == "unplaceable":
                    events.started(unit)
                    with Sandbox() as sandbox:
                        result = run_unit(unit, store, sandbox)
                events.finished(unit, result)
                reported += 1
                yield unit, result

    def cancelled(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._cancelled

    def cpus(self) -> int:
        """The CPUs the pool may use now."""
        with self._lock:
            return self._capacity()

    def longest_timeout(self) -> float:
        """The longest a unit now running may still take (within its sandbox's limit)."""
        with self._lock:
            return max((s.unit.limits.timeout_s for s in self.slots if s.unit is not None), default=0.0)

    def finish(self, job_id: str) -> None:
        """The job has every result: forget it."""
        with self._lock:
            self.jobs.pop(job_id, None)
            self.fair.remove(job_id)
            self._cancelled.discard(job_id)

    def cancel(self, job_id: str, why: str = "cancelled") -> int:
        """Drop the job's queued units and stop its running ones (their workers are replaced: a
        unit cut off before publishing leaves nothing published). Returns how many units ended."""
        with self._lock:
            self._cancelled.add(job_id)
            job = self.jobs.get(job_id)
            if job is None:
                return 0
            ended = 0
            for resource, q in self.queues.items():
                for p in [p for p in q if p.job == job_id]:
                    q.remove(p)
                    job.queued -= 1
                    self._report(p, _cancelled(p.unit, why, running=False))
                    ended += 1
            for slot in self.slots:
                if slot.job == job_id and slot.future is not None:
                    p = _Pending(slot.unit, job_id, slot.retries)
                    self._restart(slot)
                    self._unit_ended(p)
                    self._report(p, _cancelled(p.unit, why, running=True))
                    ended += 1
            self._wake.set()  # the restarted workers' starts, awaited from the next round
            return ended

    def load(self) -> dict[str, Any]:
        """Per job: priority, queued, running, done; workers busy, idle and starting."""
        with self._lock:
            return {"jobs": {j.job_id: {"priority": j.priority, "queued": j.queued, "running": j.running,
                                        "done": j.done, "total": j.total} for j in self.jobs.values()},
                    "workers": {"busy": sum(s.future is not None for s in self.slots),
                                "idle": sum(s.ready is None and s.future is None for s in self.slots),
                                "starting": sum(s.ready is not None for s in self.slots)},
                    "gang_ranks": self.gang_ranks.load()}

    def stop(self, why: str = "the farm service stopped") -> dict[str, int]:
        """Stop every worker; queued and running units end as failed (retryable), each reported once."""
        with self._lock:
            self._stopping = True
            counts = {"queued": 0, "running": 0}
            for q in self.queues.values():
                while q:
                    p = q.popleft()
                    self._report(p, _failed(p.unit, f"{why} before it started; submit the job again", retryable=True))
                    counts["queued"] += 1
            for slot in self.slots:
                if slot.future is not None:
                    p = _Pending(slot.unit, slot.job, slot.retries)
                    self._report(p, _failed(p.unit, f"{why} while it compiled; nothing of it was published; submit "
                                                     f"the job again", retryable=True))
                    counts["running"] += 1
                    slot.future = slot.unit = None
            actors = [s.actor for s in self.slots] + self.gang_ranks.close()
            self.slots.clear()
        self._thread.join(timeout=10)
        self.cluster.stop(actors)
        return counts

    # the dispatcher -----------------------------------------------------------------
    def _report(self, p: _Pending, result: UnitResult) -> None:
        job = self.jobs.get(p.job)
        if job is None:
            return
        result.retries = p.retries
        job.done += 1
        job.outbox.put(("finished", p.unit, result))

    def _start(self, slot: _Slot, resource: str, lowers: bool = False) -> None:
        placement, device, limits = self._placements[resource]
        slot.resource, slot.generation = resource, slot.generation + 1
        slot.actor = self.cluster.start(slot.name, placement, self.store_uri, limits, device, beside=slot.burst,
                                        lowers=lowers)
        slot.ready = self.cluster.ready(slot.actor)
        slot.unit = slot.future = slot.job = None
        slot.rested, slot.leaving, slot.idle_since = True, False, time.monotonic()

    def _restart(self, slot: _Slot, resource: str | None = None) -> None:
        self.cluster.kill(slot.actor)
        self._start(slot, resource or slot.resource)

    def _retire(self, slot: _Slot, for_gang: bool = False) -> None:
        self.slots.remove(slot)
        self.cluster.stop([slot.actor])
        if for_gang:
            self._lent.append(slot.resource)

    def _take(self, slot: _Slot, only: str | None = None) -> _Pending | None:
        """The slot's next unit: of the job fair share picks (of priority `only`) among those with
        a unit of the slot's class or of one it covers, the largest it can take; between equal
        ones, that of the class with the fewest units running (a cold node's workers then build
        two ISAs' precompiled headers at once, not one after the other under its lock), then its own."""
        classes = [slot.resource, *sorted(self._covers.get(slot.resource, ()))]
        wanting = {p.job for c in classes for p in self.queues.get(c, ())}
        job = self.fair.pick({j for j in wanting if only is None or self._priority(j) == only})
        if job is None:
            return None
        running = collections.Counter(s.taken_from for s in self.slots if s.future is not None)
        firsts = {c: p for c in classes if (p := next((p for p in self.queues.get(c, ()) if p.job == job), None))}
        chosen = min(firsts, key=lambda c: (-firsts[c].unit.compile_size, running[c], c != slot.resource))
        self.queues[chosen].remove(firsts[chosen])
        slot.taken_from = chosen
        return firsts[chosen]

    def _starved(self) -> str | None:
        """The class whose units (queued and running, with those of the classes it covers) have
        the fewest workers each, among those the cluster offers more slots for
        (scheduler.pool.most_starved)."""
        workers = collections.Counter(s.resource for s in self.slots if not s.burst)
        running = collections.Counter(s.taken_from for s in self.slots if s.future is not None and not s.burst)
        units = {r: len(q) + running[r] for r, q in self.queues.items() if q}
        return pool.most_starved(units, workers, self._covers, self._unheld_offer())

    def _unofferable(self) -> None:
        """Units of a class no node offers fail at once, with what to do."""
        for resource in [r for r, q in self.queues.items() if q]:
            why = unoffered(self._placements[resource][0], self._offered)
            if why is None:
                continue
            q = self.queues[resource]
            while q:
                p = q.popleft()
                self.jobs[p.job].queued -= 1
                self._report(p, _failed(p.unit, why, retryable=True))

    def _assign(self, ask_cluster: bool = True) -> None:
        now = time.monotonic()
        if ask_cluster:  # what the cluster offers now: as units come in, else at most once a ROUND_S
            self._offered, self._asked = self.cluster.offered(), now
        self._unofferable()
        capacity = self._capacity()
        workers = [s for s in self.slots if not s.burst]
        self._make_room_for_gangs(workers, capacity)
        for slot in [s for s in workers if s.free]:
            p = self._take(slot)
            if p is None:
                target = self._starved()
                if target is not None and target != slot.resource:
                    self._restart(slot, target)  # nothing of its class queued: serve the class that waits
                elif not slot.rested:
                    self.cluster.rest(slot.actor)
                    slot.rested = True
                elif now - slot.idle_since > self.config.idle_s and len(workers) > self.config.min_workers:
                    self._retire(slot)
                continue
            self._dispatch(slot, p, now)
        while len([s for s in self.slots if not s.leaving and not s.burst]) < capacity:
            back = (resource := self._starved()) is None
            if back and (resource := self._owed()) is None:
                break
            slot = _Slot(resource, self._next_index)
            self._next_index += 1
            # back after a gang: it lowered before it left, and its sandbox warms the lowering as it starts
            self._start(slot, resource, lowers=back)
            self.slots.append(slot)
        self._burst(now)  # after the pool grew: a class still starting workers is not busy

    def _dispatch(self, slot: _Slot, p: _Pending, now: float) -> None:
        job = self.jobs[p.job]
        job.queued -= 1
        job.running += 1
        self.fair.started(p.job)
        slot.unit, slot.job, slot.retries, slot.started = p.unit, p.job, p.retries, now
        slot.future = self.cluster.submit(slot.actor, p.unit, p.job, NICENESS.get(job.priority, 0))
        slot.rested = False
        job.outbox.put(("started", p.unit, None))
        self._on_start(p.job, p.unit.unit_id, job.priority, now - p.queued_at)

    def _priority(self, job_id: str | None) -> str | None:
        job = self.jobs.get(job_id) if job_id is not None else None
        return job.priority if job is not None else None

    def _loop(self) -> None:
        """Rounds of: assign, wait for a result (briefly while a worker is free: a new job's units
        go out at once), collect. A round assigns only when something changed (a result or a
        start came back; units, a cancel or a gang's hold came in: `_wake`) or ROUND_S passed
        (idle workers rest and retire, a node joined): a worker free at a job's end turned the
        loop 20 times a second, each round asking the cluster's GCS what it offers, beside the
        job's last unit."""
        ready: list = []
        assigned = -ROUND_S
        while True:
            woken = self._wake.is_set()
            self._wake.clear()  # before the round reads what it was rung for: a later ring is the next round's
            with self._lock:
                if self._stopping:
                    return
                now = time.monotonic()
                if ready or woken or now - assigned >= ROUND_S:
                    try:
                        self._assign(ask_cluster=woken or now - self._asked >= ROUND_S)
                    except Exception:  # a bug here must not stop every job's dispatcher: log and go on
                        log.exception("farm shared pool: assigning units failed")
                    assigned = now
                waiting = [s.ready for s in self.slots if s.ready is not None] + \
                          [s.future for s in self.slots if s.future is not None]
                idle = any(s.free for s in self.slots)
            unused = self.gang_ranks.sweep()
            if unused:
                self.cluster.stop(unused)
            if waiting:  # a worker that waits for work looks again soon: a new job's units go out at once
                ready = self.cluster.wait(waiting, IDLE_POLL_S if idle else POLL_S)
            else:
                self._wake.wait(POLL_S)
                ready = []
            with self._lock:
                if self._stopping:
                    return
                try:
                    self._collect(ready)
                except Exception:  # as above: the next round sees the same futures again
                    log.exception("farm shared pool: collecting results failed")

    def _collect(self, ready: list) -> None:
        for slot in list(self.slots):
            if slot.ready is not None and slot.ready in ready:
                try:
                    self.cluster.get(slot.ready)
                    slot.ready, slot.idle_since = None, time.monotonic()
                    self._failed_starts[slot.resource] = 0
                except DIED as e:
                    if slot.burst:
                        self._burst_failed(slot, e)
                        continue
                    self._failed_starts[slot.resource] += 1
                    if self._failed_starts[slot.resource] < self.config.start_attempts:
                        self._restart(slot)
                    else:
                        self._give_up(slot, _worker_error(e))
        now = time.monotonic()
        for slot in list(self.slots):
            if slot.future is None:
                continue
            p = _Pending(slot.unit, slot.job, slot.retries)
            if slot.future in ready:
                try:
                    result = self.cluster.get(slot.future)
                except DIED as e:
                    self._restart(slot)
                    self._unit_ended(p)
                    if p.retries < self.config.retries and p.job in self.jobs and p.job not in self._cancelled:
                        again = _Pending(p.unit, p.job, p.retries + 1)
                        self.queues[slot.taken_from or slot.resource].appendleft(again)
                        self.jobs[p.job].queued += 1
                        self.jobs[p.job].outbox.put(("retried", p.unit, None))
                        continue
                    result = _failed(p.unit, f"its worker died {p.retries + 1} times (last: {type(e).__name__}); "
                                             f"see the Ray dashboard's logs for the node", retryable=True)
                    self._report(p, result)
                    continue
                except RayTaskError as e:
                    result = _failed(p.unit, f"worker raised {e.cause!r}")
                slot.unit = slot.future = slot.job = None
                slot.idle_since = now
            elif now - slot.started > (limit := p.unit.limits.timeout_s) + WORKER_GRACE_S:
                self._restart(slot)
                result = _failed(p.unit, f"timeout: still running {WORKER_GRACE_S:g}s after its {limit:g}s limit, "
                                         f"outside its sandbox; its worker was replaced")
            else:
                continue
            self._unit_ended(p)
            self._report(p, result)
            if slot.leaving and slot in self.slots:
                self._retire(slot, for_gang=True)

    def _unit_ended(self, p: _Pending) -> None:
        job = self.jobs.get(p.job)
        if job is not None:
            job.running -= 1
        self.fair.stopped(p.job)

    def _give_up(self, slot: _Slot, error: str) -> None:
        for other in [s for s in self.slots if s.resource == slot.resource and s.future is None]:
            self.cluster.kill(other.actor)
            self.slots.remove(other)
        q = self.queues.pop(slot.resource, collections.deque())
        for p in q:
            self.jobs[p.job].queued -= 1
            self._report(p, _failed(p.unit, f"workers for {slot.resource} died while starting "
                                             f"{self.config.start_attempts} times in a row; the last said: {error}",
                                    retryable=True))
        self._failed_starts[slot.resource] = 0


def _cancelled(unit: Unit, why: str, running: bool) -> UnitResult:
    how = "stopped while it compiled; nothing of it was published" if running else "dropped from the queue"
    return UnitResult(unit.graph, unit.target.label, "skipped", error=f"graph {unit.graph} ({unit.target.label}): "
                                                                      f"{why}: {how}")
