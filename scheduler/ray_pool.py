"""Running units on Ray: the only module that calls Ray.

A pool of long-lived worker actors per device class (a Ray custom resource such as
`farm_cpu_avx2` or `farm_cuda_sm90`), one per slot, so a worker pays torch's start-up and
Inductor's precompiled header once, not per unit. What a worker asks of Ray (CPUs, a share
of a GPU, its device class) is its backend's `Placement`. A worker that dies mid-unit is
replaced and its unit re-queued up to `retries` times; a unit past its timeout has its worker
killed and replaced and ends as failed with reason `timeout`. Every unit is reported exactly once.
"""
from __future__ import annotations

import collections
import os
import re
import socket
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from scheduler.spec import RETRIES
from storage import CacheConfig, Store, store_from_uri
from workers import tempdirs
from workers.backends import LoweringError, Placement, offered_resources, resolve
from workers.pipeline import lookup_unit, run_unit
from workers.gang import GangComm, run_rank
from workers.rendezvous import open_store
from workers.sandbox import Sandbox
from workers.unit import Gang, Unit, UnitLimits, UnitResult

POLL_S = 0.5
# A unit's sandbox is killed at its timeout and the unit reported; the worker itself is only
# killed if it has not answered this long after that (it is stuck outside the sandbox).
WORKER_GRACE_S = 60.0
CLOSE_S = 5.0  # idle actors asked to close at the end of a job answer within this; then they are killed


@dataclass(frozen=True)
class PoolConfig:
    workers: int | None = None  # per device class; None: every slot the cluster offers
    retries: int = RETRIES
    # workers of one device class that die while starting, one after another, before its units
    # fail with the worker's own error (a bad FARM_CACHE_GB or a broken import never heals)
    start_attempts: int = 3


class CompileWorker:
    """One per slot; runs units one at a time for as long as the job lasts."""

    def __init__(self, store_uri: str, limits: UnitLimits, device: str):
        tempdirs.sweep_orphans()  # what a killed predecessor on this host left behind
        self.store = store_from_uri(store_uri, CacheConfig.from_env())  # a local disk tier per node
        self.where = f"{socket.gethostname()}/node-{ray.get_runtime_context().get_node_id()[:8]}/pid-{os.getpid()}"
        self.sandbox = Sandbox()  # warm across units; replaced after a unit that failed in it
        self.sandbox.prestart(limits, device)  # imports torch while the pool starts

    def pid(self) -> int:
        return os.getpid()

    def run(self, unit: Unit) -> UnitResult:
        result = run_unit(unit, self.store, self.sandbox)
        result.worker = self.where
        return result

    def close(self) -> None:
        self.sandbox.close()


_RemoteWorker = ray.remote(max_restarts=0, max_concurrency=2)(CompileWorker)  # resources: per placement


class GangMember:
    """One rank of a gang, started in the gang's placement group bundle for that rank; lives as
    long as the gang. Rank 0 hosts the store the gang's process group forms through."""

    def __init__(self, store_uri: str, limits: UnitLimits, device: str, rank: int, reads: bool):
        self.store = store_from_uri(store_uri, CacheConfig.from_env())
        self.rank, self.host = rank, ray.util.get_node_ip_address()
        self.rendezvous = None
        self.sandbox = Sandbox()
        if reads:  # it loads its archive first thing (Gang.reader_of); the others start theirs if they need it
            self.sandbox.prestart(limits, device)

    def host_store(self, timeout_s: float) -> tuple[str, int]:
        self.rendezvous = open_store(self.host, 0, True, timeout_s)
        return self.host, self.rendezvous.port

    def run(self, gang: Gang, address: tuple[str, int]) -> UnitResult:
        timeout = gang.collective_timeout_s
        store = self.rendezvous or open_store(address[0], address[1], False, timeout)
        comm = GangComm(store, self.rank, gang.world_size, timeout)
        try:
            with tempfile.TemporaryDirectory(prefix=tempdirs.prefix("gang")) as tmp:
                result = run_rank(comm, gang, self.store, self.sandbox, self.host, Path(tmp))
        finally:
            comm.close()
        result.worker = f"{socket.gethostname()}/pid-{os.getpid()}/rank-{self.rank}"
        return result

    def close(self) -> None:
        self.sandbox.close()


_RemoteGangMember = ray.remote(max_restarts=0)(GangMember)
PLACE_S = 60.0  # a gang whose bundles Ray cannot reserve by then fails, with what it asked for


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

    @property
    def name(self) -> str:
        return f"farm-worker/{self.resource}/{self.index}.{self.generation}"


@dataclass
class _Pending:
    unit: Unit
    retries: int = 0


@dataclass
class RayRunner:
    config: PoolConfig = field(default_factory=PoolConfig)
    job_id: str = "job"
    slots: list[_Slot] = field(default_factory=list)
    # Answer hits in this process before starting any worker. Only sound when this process
    # computes keys exactly as the workers would: the embedded Ray, whose workers share its
    # Python environment (a remote cluster's image may have another torch or compiler).
    lookup_first: bool = False

    def _start(self, slot: _Slot, resource: str) -> None:
        slot.resource, slot.generation = resource, slot.generation + 1
        placement, device = self._placements[resource]
        slot.actor = _RemoteWorker.options(
            name=f"{self.job_id}/{slot.name}", namespace="farm",
            num_cpus=placement.cpus, num_gpus=placement.gpus, resources=placement.resources,
        ).remote(self._store_uri, self._limits, device)
        slot.ready = slot.actor.pid.remote()
        slot.unit = slot.future = None

    def _restart(self, slot: _Slot, resource: str | None = None) -> None:
        ray.kill(slot.actor, no_restart=True)
        self._start(slot, resource or slot.resource)

    def gangs(self, gangs: list[Gang], store: Store, events) -> Iterator[tuple[Unit, UnitResult]]:
        """Multi-rank models, after the pool's units (whose workers have released their slots)."""
        yield from GangRunner(self.job_id)(gangs, store, events)

    def busy_workers(self) -> dict[str, int]:
        """Unit id → PID of the worker compiling it (for operators and fault-injection tests)."""
        busy = [s for s in list(self.slots) if s.ready is None and s.unit is not None]
        return dict(zip([s.unit.unit_id for s in busy], ray.get([s.actor.pid.remote() for s in busy])))

    def __call__(self, units: list[Unit], store: Store, events) -> Iterator[tuple[Unit, UnitResult]]:
        self._store_uri = store.uri
        self._limits = units[0].limits if units else UnitLimits()
        self._placements: dict[str, tuple[Placement, str]] = {}  # device class → (placement, device)
        queues: dict[str, collections.deque[_Pending]] = collections.defaultdict(collections.deque)
        with Sandbox() as sandbox:  # graphs are loaded in a sandbox here too
            yield from self._place(units, store, events, queues, sandbox)
        self._offered = ray.cluster_resources()
        for resource in [r for r in queues if not self._can_place(r)]:
            placement = self._placements[resource][0]
            gpus = f" and {placement.gpus:g} GPU" if placement.gpus else ""
            for p in queues.pop(resource):
                result = _failed(p.unit, f"no Ray node offers resource {resource!r}{gpus}, so nothing could build it; "
                                         f"start a node that can with ray start --resources \"$(farm resources)\"",
                                 retryable=True)
                events.finished(p.unit, result)
                yield p.unit, result
        budget = min(self.config.workers or 10**6, int(self._offered.get("CPU", 1)), sum(map(len, queues.values())))
        for i in range(budget):
            resource = self._most_starved(queues)
            if resource is None:
                break
            slot = _Slot(resource, i)
            self._start(slot, resource)
            self.slots.append(slot)
        try:
            yield from self._drive(queues, events)
        finally:
            _stop([slot.actor for slot in self.slots])

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

    def _can_place(self, resource: str) -> bool:
        placement = self._placements[resource][0]
        return int(self._offered.get(resource, 0)) > 0 and self._offered.get("GPU", 0) >= placement.gpus

    def _most_starved(self, queues) -> str | None:
        """The device class with the fewest workers per queued unit, among those with fewer workers
        than both their queued units and the slots the cluster offers for them."""
        workers = collections.Counter(s.resource for s in self.slots)
        wanting = [r for r, q in queues.items() if workers[r] < min(int(self._offered.get(r, 0)), len(q))]
        return min(wanting, key=lambda r: (workers[r] / len(queues[r]), r), default=None)

    def _give_up(self, slot: _Slot, queued, error: str, events) -> Iterator[tuple[Unit, UnitResult]]:
        """A device class whose workers keep dying while they start: its queued units fail with
        the worker's error, and its workers that are still starting are stopped."""
        for other in [s for s in self.slots if s.resource == slot.resource and s.future is None]:
            ray.kill(other.actor, no_restart=True)
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
                if not queues.get(slot.resource):  # nothing left for its class: move it where work waits
                    target = self._most_starved(queues)
                    if target is not None and target != slot.resource:
                        self._restart(slot, target)
                    continue
                p = queues[slot.resource].popleft()
                slot.unit, slot.retries, slot.started = p.unit, p.retries, time.monotonic()
                slot.future = slot.actor.run.options(name=f"compile {p.unit.unit_id}").remote(p.unit)
                events.started(p.unit)
            waiting = [s.ready for s in self.slots if s.ready is not None] + [s.future for s in self.slots if s.future is not None]
            ready, _ = ray.wait(waiting, num_returns=1, timeout=POLL_S) if waiting else ([], [])
            for slot in list(self.slots):
                if slot in self.slots and slot.ready is not None and slot.ready in ready:  # not given up meanwhile
                    try:
                        ray.get(slot.ready)
                        slot.ready = None
                        failed_starts[slot.resource] = 0
                    except (ActorDiedError, ActorUnavailableError, RayActorError) as e:
                        failed_starts[slot.resource] += 1
                        if failed_starts[slot.resource] < self.config.start_attempts:
                            self._restart(slot)  # died while starting: try a fresh one
                        else:
                            yield from self._give_up(slot, queues.pop(slot.resource, ()), _worker_error(e), events)
            now = time.monotonic()
            for slot in self.slots:
                if slot.future is None:
                    continue
                unit, retries = slot.unit, slot.retries
                if slot.future in ready:
                    try:
                        result = ray.get(slot.future)
                        slot.unit = slot.future = None
                    except (ActorDiedError, ActorUnavailableError, RayActorError) as e:
                        self._restart(slot)
                        if retries < self.config.retries:
                            queues[slot.resource].appendleft(_Pending(unit, retries + 1))
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


class GangRunner:
    """Places each gang with a placement group (one bundle per rank, all or nothing) and runs it;
    any rank's failure or death fails the whole gang, whose actors and bundles are then freed."""

    def __init__(self, job_id: str):
        self.job_id = job_id

    def __call__(self, gangs: list[Gang], store: Store, events) -> Iterator[tuple[Unit, UnitResult]]:
        for gang in gangs:
            results = self._run(gang, store.uri, events)
            for unit, result in zip(gang.ranks, results):
                events.finished(unit, result)
                yield unit, result

    def _bundle(self, gang: Gang) -> tuple[dict[str, float], str] | str:
        """One rank's bundle, sharing a node's slots among the ranks (a gang of 4 fits on 2 cores),
        or why none can be made."""
        unreadable = [f"rank {r}: {u.ingest_error}" for r, u in enumerate(gang.ranks) if u.program is None]
        if unreadable:
            return "ranks that cannot take part, so the gang was not placed: " + "; ".join(unreadable)
        try:
            placement = resolve(gang.ranks[0].target).placement(gang.ranks[0].target)
        except LoweringError as e:
            return str(e)
        resource = placement.device_class
        slots = max((min(n["Resources"].get(resource, 0), n["Resources"].get("CPU", 0))
                     for n in ray.nodes() if n.get("Alive")), default=0)
        if slots <= 0:
            return (f"no Ray node offers resource {resource!r} and a CPU, so no rank could be placed; start a node "
                    f"that can with ray start --resources \"$(farm resources)\"")
        share = round(min(1.0, slots / gang.world_size), 4)
        bundle = {"CPU": share, resource: share} | ({"GPU": placement.gpus} if placement.gpus else {})
        return bundle, resolve(gang.ranks[0].target).device

    def _run(self, gang: Gang, store_uri: str, events) -> list[UnitResult]:
        made = self._bundle(gang)
        if isinstance(made, str):
            return [_failed(u, f"gang {gang.label}: {made}", retryable=True) for u in gang.ranks]
        bundle, device = made
        pg = placement_group([bundle] * gang.world_size, strategy="PACK", name=f"{self.job_id}/gang/{gang.label}")
        actors: list = []
        self._returned = False
        try:
            if not pg.wait(timeout_seconds=PLACE_S):
                return [_failed(u, f"gang {gang.label}: Ray could not reserve {gang.world_size} bundles of {bundle} "
                                   f"within {PLACE_S:g}s; free or add nodes", retryable=True) for u in gang.ranks]
            actors = [_RemoteGangMember.options(
                name=f"{self.job_id}/gang/{gang.label}/rank{r}", namespace="farm", num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0), resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r),
            ).remote(store_uri, gang.ranks[r].limits, device, r, gang.reader_of(r) == r) for r in range(gang.world_size)]
            for unit in gang.ranks:
                events.started(unit)
            return self._await(gang, actors)
        finally:
            _stop(actors, close=self._returned)  # ranks still in a collective cannot answer a close
            remove_placement_group(pg)

    def _await(self, gang: Gang, actors: list) -> list[UnitResult]:
        """Every rank's result; the first rank to die or fail to answer stops the gang at once."""
        limit = max(u.limits.timeout_s for u in gang.ranks) + gang.collective_timeout_s + WORKER_GRACE_S
        try:
            address = ray.get(actors[0].host_store.remote(gang.collective_timeout_s), timeout=limit)
        except (ActorDiedError, ActorUnavailableError, RayActorError, GetTimeoutError) as e:
            return [_failed(u, f"gang {gang.label}: rank 0's worker did not start ({type(e).__name__})",
                            retryable=True) for u in gang.ranks]
        futures = [actor.run.options(name=f"gang {gang.label} rank {r}").remote(gang, address)
                   for r, actor in enumerate(actors)]
        results: dict[int, UnitResult] = {}
        deadline = time.monotonic() + limit
        while len(results) < len(futures):
            pending = [f for r, f in enumerate(futures) if r not in results]
            ready, _ = ray.wait(pending, num_returns=1, timeout=POLL_S)
            for future in ready:
                rank = futures.index(future)
                try:
                    results[rank] = ray.get(future)
                except (ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError) as e:
                    return self._stopped(gang, rank, f"its worker died ({type(e).__name__})")
            if time.monotonic() > deadline:
                late = min(r for r in range(len(futures)) if r not in results)
                return self._stopped(gang, late, f"still running {limit:g}s after the gang started")
        self._returned = True
        return [results[r] for r in range(len(futures))]

    def _stopped(self, gang: Gang, rank: int, why: str) -> list[UnitResult]:
        return [_failed(u, f"gang {gang.label}: rank {rank} {why}; the gang was stopped", retryable=True)
                for u in gang.ranks]


def _stop(actors: list, close: bool = True) -> None:
    """Let idle actors remove their sandboxes, then kill them all; then remove what workers
    killed during the job left in this host's temp dir."""
    if close and actors:
        try:
            ray.wait([a.close.remote() for a in actors], num_returns=len(actors), timeout=CLOSE_S)
        except (RayActorError, ActorUnavailableError):
            pass  # a dead actor has nothing to close; the sweep below cleans up after it
    for actor in actors:
        ray.kill(actor, no_restart=True)
    tempdirs.sweep_orphans()


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
    return (raised or lines or [type(e).__name__])[-1][:500]


def _failed(unit: Unit, message: str, retryable: bool = False) -> UnitResult:
    if message.startswith("gang "):
        return UnitResult(unit.graph, unit.target.label, "failed", error=message, retryable=retryable)
    return UnitResult(unit.graph, unit.target.label, "failed", error=f"graph {unit.graph} ({unit.target.label}): {message}",
                      retryable=retryable)


@dataclass(frozen=True)
class RaySession:
    dashboard: str | None  # URL, when this process started Ray with its dashboard
    embedded: bool  # this process started Ray: its workers share this Python environment


@contextmanager
def ray_session(address: str | None, slots: int | None = None) -> Iterator[RaySession]:
    """Join a cluster (address, or RAY_ADDRESS; token auth from RAY_AUTH_TOKEN or ~/.ray/auth_token)
    or start an embedded local Ray on loopback."""
    if ray.is_initialized():
        yield RaySession(None, embedded=False)
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ctx = ray.init(address=address, namespace="farm", log_to_driver=False)
    else:
        slots = slots or os.cpu_count() or 1
        ctx = ray.init(num_cpus=slots, resources=offered_resources(slots), namespace="farm", include_dashboard=True,
                       dashboard_host="127.0.0.1", _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        url = ctx.dashboard_url
        yield RaySession(f"http://{url}" if url and not url.startswith("http") else url, embedded=not address)
    finally:
        if not address:
            ray.shutdown()
