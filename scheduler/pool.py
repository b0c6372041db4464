"""A pool of long-lived workers per device class (a cluster resource such as `farm_cpu_avx2` or
`farm_cuda_sm90`), one per slot, so a worker pays torch's start-up and Inductor's precompiled
header once, not per unit; what a worker asks of the cluster is its backend's `Placement`.

The rules, and their tests without a cluster (tests/test_pool.py):
- a worker that dies mid-unit is replaced and its unit re-queued up to `retries` times;
- workers of a device class that die while starting, `start_attempts` times in a row, fail
  that class's queued units with the worker's own error;
- a unit still running WORKER_GRACE_S past its timeout has its worker killed and replaced and
  ends as failed with reason `timeout` (its sandbox normally ends it at the timeout itself);
- a worker whose class covers another's (an avx2 worker builds x86-64 code: `Placement.covers`)
  takes that class's units when its own queue is empty, and such classes get workers of the
  covering class, so a job's mix of ISAs shares its workers instead of idling one per class;
- a worker takes from its own class and those it covers the one with the fewest units running
  (a cold node's compile headers, one per ISA, are then built side by side, not in turn);
- a class's units go out largest graph first (a rough proxy for the longest compile: its
  serialized graphs' bytes, not its weights; Unit.compile_size), so what is left at the end are
  small units that fill the gaps instead of one long one;
- every unit is reported exactly once;
- a driver that runs jobs one after another may keep their idle workers for the next
  (`WorkerPool.warm`, scheduler/warm_workers.py): a worker that died or was busy is never kept.
The cluster's calls go through `Cluster` (scheduler/ray_pool.py has Ray's).
"""
from __future__ import annotations

import collections
import re
import time
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Protocol

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

from scheduler.kept_sandbox import warm_sandbox
from scheduler.spec import RETRIES
from scheduler.warm_workers import Shape, WarmWorkers
from storage import Store
from workers.backends import LoweringError, Placement, resolve
from workers.errors import summary
from workers.lookup import lookup_unit
from workers.pipeline import run_unit
from workers.sandbox.process import Sandbox
from workers.unit import Unit, UnitLimits, UnitResult

POLL_S = 0.5
# A unit's sandbox is killed at its timeout and the unit reported; the worker itself is only
# killed if it has not answered this long after that (it is stuck outside the sandbox).
WORKER_GRACE_S = 60.0


DIED = (ActorDiedError, ActorUnavailableError, RayActorError)  # what `Cluster.get` raises for a dead actor


@dataclass(frozen=True)
class PoolConfig:
    workers: int | None = None  # per device class; None: every slot the cluster offers
    retries: int = RETRIES
    # workers of one device class that die while starting, one after another, before its units
    # fail with the worker's own error (a bad FARM_CACHE_GB or a broken import never heals)
    start_attempts: int = 3


@dataclass
class _Slot:
    resource: str
    index: int
    generation: int = 0
    actor: object = None
    ready: object = None  # future of the actor's first call: set while the actor starts
    unit: Unit | None = None
    retries: int = 0
    future: object = None
    started: float = 0.0
    done_at: float = 0.0  # when its last unit ended (0: it ran none this job)
    taken_from: str | None = None  # the class whose queue its unit came from (its own, or one it covers)

    @property
    def name(self) -> str:
        return f"farm-worker/{self.resource}/{self.index}.{self.generation}"


@dataclass
class _Pending:
    unit: Unit
    retries: int = 0


class Cluster(Protocol):
    """The calls the pool makes of its cluster (scheduler/ray_pool.py: Ray's; tests: a fake).
    Futures are opaque; `get` raises one of DIED when the actor behind it is gone."""

    # `beside`: with no CPU or class resource of its own, on a node that offers the class (a burst worker);
    # `lowers`: its units will lower, so its sandbox warms the lowering as it starts (workers/sandbox/process.py)
    def start(self, name: str, placement: Placement, store_uri: str, limits: UnitLimits, device: str,
              beside: bool = False, lowers: bool = False) -> Any: ...
    def ready(self, actor: Any) -> Any: ...  # a future that resolves once the actor and its sandbox child have started
    # a future of the unit's UnitResult; `niceness`: its sandbox child's (a farm service's job's class)
    def submit(self, actor: Any, unit: Unit, job: str | None = None, niceness: int = 0) -> Any: ...
    def wait(self, futures: list[Any], timeout: float) -> list[Any]: ...  # those of futures that are done
    def get(self, future: Any) -> Any: ...
    def pids(self, actors: list[Any]) -> list[int]: ...
    def kill(self, actor: Any) -> None: ...
    def offered(self) -> dict[str, float]: ...  # resources the cluster offers, e.g. {"CPU": 2, "farm_cpu_avx2": 2}
    def nodes(self) -> list[dict[str, float]]: ...  # what each live node offers
    def stop(self, actors: list[Any]) -> None: ...  # at the end of a job
    def rest(self, actor: Any) -> None: ...  # an idle worker renews its sandbox child for whichever job comes next


@dataclass
class WorkerPool:
    """A runner (scheduler.jobs.Runner): units in, each unit's result out, as they finish."""

    config: PoolConfig = field(default_factory=PoolConfig)
    job_id: str = "job"
    slots: list[_Slot] = field(default_factory=list)
    cluster: Cluster | None = None
    lookup_first: bool = False  # answer hits in this process before starting workers (see RayRunner)
    warm: WarmWorkers | None = None  # workers kept from this driver's earlier jobs, and for its next

    def _shape(self, resource: str) -> Shape:
        placement, device = self._placements[resource]
        placement = replace(placement, holding=tuple(sorted(self._covers.get(resource, ()))))  # what it will take
        return Shape(resource, placement, device, self._store_uri)

    def _start(self, slot: _Slot, resource: str) -> None:
        slot.resource, slot.generation = resource, slot.generation + 1
        shape = self._shape(resource)
        slot.actor = self.warm.take(shape) if self.warm is not None else None
        if slot.actor is None:
            name = self.warm.new_name(resource) if self.warm is not None else f"{self.job_id}/{slot.name}"
            slot.actor = self.cluster.start(name, shape.placement, self._store_uri, self._limits, shape.device)
        slot.ready = self.cluster.ready(slot.actor)  # (a kept worker answers at once)
        slot.unit = slot.future = None

    def _restart(self, slot: _Slot, resource: str | None = None) -> None:
        self.cluster.kill(slot.actor)
        self._start(slot, resource or slot.resource)

    def busy_workers(self) -> dict[str, int]:
        """Unit id → PID of the worker compiling it (for operators and fault-injection tests)."""
        busy = [s for s in list(self.slots) if s.ready is None and s.unit is not None]
        return dict(zip([s.unit.unit_id for s in busy], self.cluster.pids([s.actor for s in busy])))

    def __call__(self, units: list[Unit], store: Store, events) -> Iterator[tuple[Unit, UnitResult]]:
        self.slots = []  # a job's units run again (scheduler.jobs: a store that was down) on workers of their own
        self._store_uri = store.uri
        self._limits = units[0].limits if units else UnitLimits()
        self._placements: dict[str, tuple[Placement, str]] = {}  # device class → (placement, device)
        self._covers: dict[str, set[str]] = {}  # device class → the queued classes its workers also build
        queues: dict[str, collections.deque[_Pending]] = collections.defaultdict(collections.deque)
        with warm_sandbox() as sandbox:  # graphs are loaded in a sandbox here too: the process's warm one
            yield from self._place(units, store, events, queues, sandbox)
        if not any(queues.values()):
            return  # every unit was answered here (hits) or failed here: no worker, no cluster needed
        self._offered = self.cluster.offered()
        for resource in list(queues):
            why = unoffered(self._placements[resource][0], self._offered)
            for p in queues.pop(resource) if why else ():
                result = _failed(p.unit, why, retryable=True)
                events.finished(p.unit, result)
                yield p.unit, result
        for resource, queued in queues.items():  # largest first: the small ones left fill the gaps at the end
            queues[resource] = collections.deque(sorted(queued, key=lambda p: -p.unit.compile_size))
        nodes = self.cluster.nodes()  # a worker takes a class it covers only where a node offers both
        self._covers = {r: {c for c in self._placements[r][0].covers if c in queues and any(r in n and c in n for n in nodes)}
                        for r in queues}
        budget = min(self.config.workers or 10**6, int(self._offered.get("CPU", 1)), sum(map(len, queues.values())))
        for i in range(budget):
            resource = self._most_starved(queues)
            if resource is None:
                break
            slot = _Slot(resource, i)
            self._start(slot, resource)
            self.slots.append(slot)
        if self.warm is not None:  # kept workers this job did not take: their resources go back to Ray
            self.cluster.stop(self.warm.close())
        ended = False
        try:
            yield from self._drive(queues, events)
            ended = True
        finally:
            self._end(ended)

    def _end(self, ended: bool) -> None:
        """Stop the job's workers; with `warm`, keep those idle and healthy after a job that ran
        to its end, their sandbox children replaced for the next job."""
        kept = [s for s in self.slots if ended and self.warm is not None and s.ready is None and s.future is None]
        for slot in sorted(kept, key=lambda s: -s.done_at):  # the next job takes the last busy first (WarmWorkers.take)
            self.cluster.rest(slot.actor)
            self.warm.keep(slot.actor, self._shape(slot.resource))
        self.cluster.stop([slot.actor for slot in self.slots if slot not in kept])

    def _place(self, units, store: Store, events, queues, sandbox: Sandbox) -> Iterator[tuple[Unit, UnitResult]]:
        """Queue each unit for its device class, after failing what cannot be placed and answering
        hits here when lookup_first is on."""
        for unit in units:
            placement = _route(unit)
            resource = placement.device_class if placement else None
            if placement is not None:
                self._placements[resource] = (placement, resolve(unit.target).device)
            if resource is None:  # cannot be placed anywhere: fail it here, quickly, with the reason
                events.started(unit)
                result = run_unit(unit, store, sandbox)
                events.finished(unit, result)
                yield unit, result
            elif self.lookup_first and (hit := lookup_unit(unit, store, sandbox)) is not None:
                events.finished(unit, hit)
                yield unit, hit
            else:
                queues[resource].append(_Pending(unit))

    def _most_starved(self, queues) -> str | None:
        return most_starved({r: len(q) for r, q in queues.items()}, collections.Counter(s.resource for s in self.slots),
                            self._covers, self._offered)

    def _next(self, slot: _Slot, queues) -> _Pending | None:
        """The slot's next unit, of the class with the fewest units running now among its own and
        those it covers (on a tie its own, then the covered one with the most queued). A cold
        node builds Inductor's precompiled header once per ISA, under a lock (its cache is the
        node's): two workers that start on one ISA take turns at that build, one of them idle,
        while two on different ISAs build both at once."""
        running = collections.Counter(s.taken_from for s in self.slots if s.future is not None)
        classes = [slot.resource] + sorted(self._covers.get(slot.resource, ()), key=lambda c: -len(queues.get(c, ())))
        chosen = min((c for c in classes if queues.get(c)), key=lambda c: running[c], default=None)
        if chosen is None:
            return None
        slot.taken_from = chosen
        return queues[chosen].popleft()

    def _report_load(self, queues, events) -> None:
        """Queue depth and busy and idle workers per device class, for metrics and `farm status`."""
        busy = collections.Counter(s.resource for s in self.slots if s.future is not None)
        idle = collections.Counter(s.resource for s in self.slots if s.future is None and s.ready is None)
        events.load({r: len(q) for r, q in queues.items()}, dict(busy), dict(idle))

    def _orphaned(self, slot: _Slot, queues) -> list[_Pending]:
        """What is queued for the slot's class, and for the classes it covers that no worker of
        another class would take: they fail with the class that gave up."""
        others = {s.resource for s in self.slots if s.resource != slot.resource}
        gone = [slot.resource] + [c for c in self._covers.get(slot.resource, ())
                                  if not any(c == o or c in self._covers.get(o, ()) for o in others)]
        return [p for c in gone for p in queues.pop(c, ())]

    def _give_up(self, slot: _Slot, queued, error: str, events) -> Iterator[tuple[Unit, UnitResult]]:
        """A device class whose workers keep dying while they start: its queued units fail with
        the worker's error, and its workers that are still starting are stopped."""
        for other in [s for s in self.slots if s.resource == slot.resource and s.future is None]:
            self.cluster.kill(other.actor)
            self.slots.remove(other)
        for p in queued:
            result = _failed(p.unit, f"workers for {slot.resource} died while starting {self.config.start_attempts} "
                                     f"times in a row; the last said: {error}", retryable=True)
            result.retries = p.retries
            events.finished(p.unit, result)
            yield p.unit, result

    def _drive(self, queues, events) -> Iterator[tuple[Unit, UnitResult]]:
        failed_starts: collections.Counter[str] = collections.Counter()  # per device class, in a row
        while any(queues.values()) or any(s.future is not None for s in self.slots):
            for slot in self.slots:
                if slot.ready is not None or slot.future is not None:
                    continue
                p = self._next(slot, queues)
                if p is None:  # nothing left it can build: move it where work waits
                    target = self._most_starved(queues)
                    if target is not None and target != slot.resource:
                        self._restart(slot, target)
                    continue
                slot.unit, slot.retries, slot.started = p.unit, p.retries, time.monotonic()
                slot.future = self.cluster.submit(slot.actor, p.unit, self.job_id)  # (a kept worker renews its child)
                events.started(p.unit)
            self._report_load(queues, events)
            waiting = [s.ready for s in self.slots if s.ready is not None] + [s.future for s in self.slots if s.future is not None]
            ready = self.cluster.wait(waiting, POLL_S) if waiting else []
            for slot in list(self.slots):
                if slot in self.slots and slot.ready is not None and slot.ready in ready:  # not given up meanwhile
                    try:
                        self.cluster.get(slot.ready)
                        slot.ready = None
                        failed_starts[slot.resource] = 0
                    except DIED as e:
                        failed_starts[slot.resource] += 1
                        if failed_starts[slot.resource] < self.config.start_attempts:
                            self._restart(slot)  # died while starting: try a fresh one
                        else:
                            yield from self._give_up(slot, self._orphaned(slot, queues), _worker_error(e), events)
            now = time.monotonic()
            for slot in self.slots:
                if slot.future is None:
                    continue
                unit, retries = slot.unit, slot.retries
                if slot.future in ready:
                    try:
                        result = self.cluster.get(slot.future)
                        slot.unit = slot.future = None
                        slot.done_at = now
                    except DIED as e:
                        self._restart(slot)
                        if retries < self.config.retries:
                            queues[slot.taken_from or slot.resource].appendleft(_Pending(unit, retries + 1))
                            events.retried(unit)
                            continue
                        result = _failed(unit, f"its worker died {retries + 1} times (last: {type(e).__name__}); "
                                               f"see the Ray dashboard's logs for the node", retryable=True)
                    except RayTaskError as e:  # a bug in the pipeline, not in the unit
                        slot.unit = slot.future = None
                        result = _failed(unit, f"worker raised {e.cause!r}")
                elif now - slot.started > (limit := unit.limits.timeout_s) + WORKER_GRACE_S:
                    self._restart(slot)
                    result = _failed(unit, f"timeout: still running {WORKER_GRACE_S:g}s after its {limit:g}s limit, "
                                           f"outside its sandbox; its worker was replaced")
                else:
                    continue
                result.retries = retries
                events.finished(unit, result)
                yield unit, result


def most_starved(units: dict[str, int], workers: collections.Counter, covers: dict[str, set[str]],
                 offered: dict[str, float]) -> str | None:
    """The device class with the fewest workers per unit it could take, among those with fewer
    workers than the slots the cluster offers for them and than those units. A class's units
    include those of the classes it covers, and its workers those of the classes covering it;
    on a tie the class that could take the most units wins (a covering one)."""
    demand = {r: n + sum(units.get(c, 0) for c in covers.get(r, ())) for r, n in units.items()}
    serving = {r: sum(n for c, n in workers.items() if c == r or r in covers.get(c, ())) for r in units}
    wanting = [r for r in units if demand[r] and workers[r] < int(offered.get(r, 0)) and serving[r] < demand[r]]
    return min(wanting, key=lambda r: (serving[r] / demand[r], -demand[r], r), default=None)


def covered_everywhere(placements: dict[str, Placement], nodes: list[dict[str, float]]) -> dict[str, set[str]]:
    """Device class → the classes among `placements` its workers also build (an avx2 worker builds
    x86-64 code: `Placement.covers`) wherever they run: every node that offers the class offers
    those too, so a worker needs to hold no slot of theirs (unlike a job's own pool's, `holding`)."""
    covers = {}
    for resource, placement in placements.items():
        offering = [n for n in nodes if resource in n]
        covers[resource] = {c for c in placement.covers if c in placements and offering and all(c in n for n in offering)}
    return covers


def unoffered(placement: Placement, offered: dict[str, float]) -> str | None:
    """Why no worker of the placement's class can start on a cluster that offers `offered`, with
    what to do; None if one can."""
    resource = placement.device_class
    if int(offered.get(resource, 0)) > 0 and offered.get("GPU", 0) >= placement.gpus:
        return None
    gpus = f" and {placement.gpus:g} GPU" if placement.gpus else ""
    advice = f"; {placement.unoffered}" if placement.unoffered else ""
    return (f"no Ray node offers resource {resource!r}{gpus}, so nothing could build it; start a node that can "
            f"with ray start --resources \"$(farm resources)\"{advice}")


def _route(unit: Unit) -> Placement | None:
    if unit.program is None:
        return None
    try:
        return resolve(unit.target).placement(unit.target)
    except LoweringError:
        return None


def _worker_error(e: Exception) -> str:
    """What a worker that died while starting raised (the last `SomeError: ...` line Ray quotes),
    or Ray's own account of its death."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b:?", line)]
    return summary((raised or lines or [type(e).__name__])[-1])


def _failed(unit: Unit, message: str, retryable: bool = False) -> UnitResult:
    if message.startswith("gang "):
        return UnitResult(unit.graph, unit.target.label, "failed", error=message, retryable=retryable)
    return UnitResult(unit.graph, unit.target.label, "failed", error=f"graph {unit.graph} ({unit.target.label}): {message}",
                      retryable=retryable)
