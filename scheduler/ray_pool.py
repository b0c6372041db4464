"""Running units on Ray: the only module that places actors on Ray (they run
scheduler/ray_actors.py and scheduler/gang_actor.py; short tasks, such as a zoo suite's exports,
are scheduler/ray_tasks.py's).

The worker pool (scheduler/pool.py) runs on Ray through `RayCluster`: one `CompileWorker`
actor per slot, asking Ray for what its backend's `Placement` says (CPUs, a share of a GPU,
its device class). Gangs get a placement group and one `GangMember` actor per rank
(`GangRunner`; in a farm service, warm ones beside the bundles: scheduler/gang_warm.py).
Joining or starting a cluster is `ray_session`'s.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from scheduler.gang_actor import GangMember
from scheduler.gang_warm import WarmRanks
from scheduler.pool import POLL_S, WORKER_GRACE_S, PoolConfig, WorkerPool, _failed
from scheduler.ray_actors import CompileWorker
from scheduler.ray_session import NAMESPACE
from scheduler.warm_workers import WarmWorkers
from storage import Store
from workers.backends import LoweringError, Placement, resolve
from workers.sandbox import tempdirs
from workers.unit import Gang, Unit, UnitLimits, UnitResult

__all__ = ["CompileWorker", "GangMember", "GangRunner", "PoolConfig", "RayCluster", "RayRunner", "close_ranks",
           "close_workers"]

CLOSE_S = 5.0  # idle actors asked to close at the end of a job answer within this; then they are killed


_RemoteWorker = ray.remote(max_restarts=0, max_concurrency=2)(CompileWorker)  # resources: per placement


_RemoteGangMember = ray.remote(max_restarts=0)(GangMember)  # its module imports no torch (scheduler/gang_actor.py)
PLACE_S = 60.0  # a gang whose bundles Ray cannot reserve by then fails, with what it asked for


class RayCluster:
    """The worker pool's calls (scheduler.pool.Cluster), made of Ray. `connect`, when given, joins
    or starts Ray the first time the pool asks the cluster anything: a job whose units are all
    answered before any worker is needed never starts one (the embedded Ray's `farm submit`)."""

    def __init__(self, connect: Callable[[], None] | None = None):
        self._connect = connect

    def up(self) -> None:
        if self._connect is not None:
            self._connect()

    def start(self, name: str, placement: Placement, store_uri: str, limits: UnitLimits, device: str,
              beside: bool = False, lowers: bool = False) -> Any:
        self.up()
        args = (store_uri, limits, device, lowers, placement.warm_imports)
        if beside:  # a burst worker (scheduler/shared_pool.py): Ray accounts none of the node's CPUs to it
            nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and
                     all(n["Resources"].get(r, 0) >= q for r, q in placement.resources.items())]
            if not nodes:
                raise RuntimeError(f"no node offers {placement.resources}")
            return _RemoteWorker.options(name=name, namespace=NAMESPACE, num_cpus=0, scheduling_strategy=(
                NodeAffinitySchedulingStrategy(nodes[0], soft=False))).remote(*args)
        return _RemoteWorker.options(name=name, namespace=NAMESPACE, num_cpus=placement.cpus, num_gpus=placement.gpus,
                                     resources=placement.resources).remote(*args)

    def ready(self, actor: Any) -> Any:
        return actor.warm.remote()

    def submit(self, actor: Any, unit: Unit, job: str | None = None, niceness: int = 0) -> Any:
        return actor.run.options(name=f"compile {unit.unit_id}").remote(unit, job, niceness)

    def wait(self, futures: list[Any], timeout: float) -> list[Any]:
        return ray.wait(futures, num_returns=1, timeout=timeout)[0]

    def get(self, future: Any) -> Any:
        return ray.get(future)

    def pids(self, actors: list[Any]) -> list[int]:
        return ray.get([a.pid.remote() for a in actors])

    def kill(self, actor: Any) -> None:
        ray.kill(actor, no_restart=True)

    def offered(self) -> dict[str, float]:
        self.up()
        return ray.cluster_resources()

    def nodes(self) -> list[dict[str, float]]:
        self.up()
        return [n["Resources"] for n in ray.nodes() if n["Alive"]]

    def stop(self, actors: list[Any]) -> None:
        _stop(actors)

    def rest(self, actor: Any) -> None:
        actor.rest.remote()


@dataclass
class RayRunner(WorkerPool):
    """The worker pool on Ray, and gangs (a placement group each) after its units."""

    cluster: RayCluster = field(default_factory=RayCluster)
    # Answer hits in this process before starting any worker. Only sound when this process
    # computes keys exactly as the workers would: the embedded Ray, whose workers share its
    # Python environment (a remote cluster's image may have another torch or compiler).
    lookup_first: bool = False
    # A process that runs job after job keeps its gangs' CPU ranks warm in these for the next
    # gangs of the same shape (as a farm service does) and stops them itself: `close_ranks`.
    gang_ranks: WarmRanks | None = None

    def gangs(self, gangs: list[Gang], store: Store, events) -> Iterator[tuple[Unit, UnitResult]]:
        """Multi-rank models, after the pool's units (whose workers have released their slots)."""
        if gangs:
            self.cluster.up()
            if self.warm is not None:  # the gangs' placement groups need the CPUs kept workers hold
                self.cluster.stop(self.warm.close())
        yield from GangRunner(self.job_id, warm=self.gang_ranks)(gangs, store, events)


def close_ranks(warm: WarmRanks) -> None:
    """Stop the idle warm ranks (those of running gangs stop with their gang)."""
    _stop(warm.close())


def close_workers(warm: WarmWorkers) -> None:
    """Stop the pool workers a driver kept between its jobs."""
    _stop(warm.close())


def gang_bundle(gang: Gang) -> tuple[dict[str, float], str] | str:
    """One rank's bundle, sharing a node's slots among the ranks (a gang of 4 fits on 2 cores),
    or why none can be made."""
    unreadable = [f"rank {r}: {u.ingest_error}" for r, u in enumerate(gang.ranks) if u.program is None]
    if unreadable:
        return "ranks that cannot take part, so the gang was not placed: " + "; ".join(unreadable)
    try:
        backend = resolve(gang.ranks[0].target)
        placement = backend.placement(gang.ranks[0].target)
    except LoweringError as e:
        return str(e)
    resource = placement.device_class
    slots = max((min(n["Resources"].get(resource, 0), n["Resources"].get("CPU", 0))
                 for n in ray.nodes() if n.get("Alive")), default=0)
    if slots <= 0:
        advice = f"; {placement.unoffered}" if placement.unoffered else ""
        return (f"no Ray node offers resource {resource!r} and a CPU, so no rank could be placed; start a node "
                f"that can with ray start --resources \"$(farm resources)\"{advice}")
    share = round(min(1.0, slots / gang.world_size), 4)
    bundle = {"CPU": share, resource: share} | ({"GPU": placement.gpus} if placement.gpus else {})
    return bundle, backend.device


class GangRunner:
    """Places each gang with a placement group (one bundle per rank, all or nothing) and runs it;
    any rank's failure or death fails the whole gang, whose actors and bundles are then freed."""

    def __init__(self, job_id: str, place_s: float = PLACE_S, warm: WarmRanks | None = None):
        self.job_id, self.place_s, self.warm = job_id, place_s, warm  # warm: a farm service's (gang_warm.py)

    def __call__(self, gangs: list[Gang], store: Store, events) -> Iterator[tuple[Unit, UnitResult]]:
        for gang in gangs:
            results = self._run(gang, store.uri, events)
            for unit, result in zip(gang.ranks, results):
                events.finished(unit, result)
                yield unit, result

    def _run(self, gang: Gang, store_uri: str, events) -> list[UnitResult]:
        made = gang_bundle(gang)
        if isinstance(made, str):
            return [_failed(u, f"gang {gang.label}: {made}", retryable=True) for u in gang.ranks]
        bundle, device = made
        pg = placement_group([bundle] * gang.world_size, strategy="PACK", name=f"{self.job_id}/gang/{gang.label}")
        actors: list = []
        warm: WarmRanks | None = None
        self._returned = False
        try:
            if not pg.wait(timeout_seconds=self.place_s):
                return [_failed(u, f"gang {gang.label}: Ray could not reserve {gang.world_size} bundles of {bundle} "
                                   f"within {self.place_s:g}s; free or add nodes", retryable=True) for u in gang.ranks]

            def start(r: int) -> Any:
                if warm:
                    return self._warm_rank(warm, gang, r, nodes[r], device, store_uri)
                return _RemoteGangMember.options(
                    name=f"{self.job_id}/gang/{gang.label}/rank{r}", namespace=NAMESPACE, num_cpus=bundle["CPU"],
                    num_gpus=bundle.get("GPU", 0), resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r),
                ).remote(store_uri, gang.ranks[r].target, gang.ranks[r].limits, device, r, gang.reader_of(r) == r,
                         gang.identical)

            warm = self.warm if self.warm is not None and self.warm.keeps(bundle) else None
            nodes = placement_group_table(pg)["bundles_to_node_id"] if warm else {}  # where Ray placed each bundle
            actors.extend(start(r) for r in range(gang.world_size) if gang.reader_of(r) == r)
            for unit in gang.ranks:
                events.started(unit)
            return self._await(gang, actors, start)
        finally:
            if warm:  # ranks of a gang that returned stay warm; the others are stopped below
                actors = warm.back(actors, kept=self._returned)
            _stop(actors, close=self._returned)  # ranks still in a collective cannot answer a close
            remove_placement_group(pg)

    @staticmethod
    def _warm_rank(warm: WarmRanks, gang: Gang, r: int, node_id: str, device: str, store_uri: str) -> Any:
        """Rank r's actor in a farm service: a warm one of its shape, readied for it, or a new one
        beside its bundle, on that bundle's node (scheduler/gang_warm.py)."""
        unit, reads = gang.ranks[r], gang.reader_of(r) == r
        shape = (node_id, device, reads)
        actor = warm.take(shape)
        if actor is not None:
            actor.begin.remote(store_uri, unit.target, unit.limits, r, gang.identical)
        else:
            actor = _RemoteGangMember.options(
                name=warm.new_name(), namespace=NAMESPACE, num_cpus=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(store_uri, unit.target, unit.limits, device, r, reads, gang.identical)
        warm.lend(actor, shape)
        return actor

    def _await(self, gang: Gang, actors: list, start: Callable[[int], Any]) -> list[UnitResult]:
        """Every rank's result; the first rank to die or fail to answer stops the gang at once."""
        limit = max(u.limits.timeout_s for u in gang.ranks) + gang.collective_timeout_s + WORKER_GRACE_S
        readers = [r for r in range(gang.world_size) if gang.reader_of(r) == r]
        waiting = [r for r in range(gang.world_size) if r not in readers]
        member = dict(zip(readers, actors))
        hosting = member[0].host_store.remote(gang.collective_timeout_s)
        reads = {r: member[r].read.options(name=f"gang {gang.label} rank {r} reads").remote(gang) for r in readers}
        runs = {0: member[0].run.options(name=f"gang {gang.label} rank 0").remote(gang, None)}  # it hosts the store
        try:
            address = ray.get(hosting, timeout=limit)
            if waiting:
                ray.get(reads[0], timeout=limit)
        except (ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError, GetTimeoutError) as e:
            return [_failed(u, f"gang {gang.label}: rank 0's worker did not start or read its graph "
                               f"({type(e).__name__})", retryable=True) for u in gang.ranks]
        # Ranks that only wait for rank 0's graph start once it has read it and, compiling early, has
        # the host check's answer (scheduler/gang_actor.py): where cores are few, their start then
        # overlaps rank 0's lowering instead of slowing its start, load and probe.
        for r in waiting:
            member[r] = start(r)
            actors.append(member[r])
            member[r].read.options(name=f"gang {gang.label} rank {r} reads").remote(gang)
        runs.update((r, member[r].run.options(name=f"gang {gang.label} rank {r}").remote(gang, address))
                    for r in range(1, gang.world_size))
        futures = [runs[r] for r in range(gang.world_size)]
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
