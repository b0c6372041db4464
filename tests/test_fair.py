"""Fair share between a farm service's jobs (scheduler/fair.py) and the shared pool's rules
(scheduler/shared_pool.py) on a fake cluster: fast, no Ray. The service on a real Ray cluster:
tests/test_service.py."""
from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from scheduler.fair import NICENESS, PRIORITY_WEIGHTS, FairShare, UnknownPriority
from scheduler.jobs import NoEvents
from scheduler.service_config import ServiceConfig
from scheduler.shared_pool import ROUND_S, SharedPool
from storage import BlobRef
from tests.test_pool import FakeCluster
from workers.unit import Target, Unit, UnitLimits, UnitResult


def _unit(graph: str) -> Unit:
    return Unit(graph, f"{graph}.pt2", Target("aoti-cpu", "avx2"), BlobRef("0" * 64, 1), limits=UnitLimits())


def _serve(fair: FairShare, wanting: dict[str, int], workers: int, rounds: int) -> list[str]:
    """Run `rounds` units on `workers` workers, each unit one tick long; which job each went to."""
    running: list[str] = []
    order = []
    for _ in range(rounds):
        while len(running) < workers:
            job = fair.pick([j for j, n in wanting.items() if n > 0])
            if job is None:
                break
            wanting[job] -= 1
            fair.started(job)
            running.append(job)
            order.append(job)
        if running:
            fair.stopped(running.pop(0))
    return order


def test_a_job_that_runs_nothing_gets_the_next_worker_whatever_its_class():
    fair = FairShare()
    fair.add("nightly", "nightly")
    fair.started("nightly")
    fair.started("nightly")
    fair.add("one-graph", "interactive")
    assert fair.pick(["nightly", "one-graph"]) == "one-graph"
    fair.add("late-nightly", "nightly")
    fair.started("one-graph")
    assert fair.pick(["nightly", "one-graph", "late-nightly"]) == "late-nightly"


def test_nothing_starves_under_a_steady_stream_of_interactive_work():
    fair = FairShare()
    fair.add("nightly", "nightly")
    fair.add("people", "interactive")
    order = _serve(fair, {"nightly": 1000, "people": 1000}, workers=1, rounds=340)
    share = Counter(order)
    assert share["nightly"] > 0
    ratio = share["people"] / share["nightly"]
    weights = PRIORITY_WEIGHTS["interactive"] / PRIORITY_WEIGHTS["nightly"]
    assert weights * 0.8 <= ratio <= weights * 1.2, share


def test_jobs_of_one_class_share_equally_and_a_cap_holds():
    fair = FairShare()
    fair.add("a", "batch")
    fair.add("b", "batch")
    share = Counter(_serve(fair, {"a": 100, "b": 100}, workers=4, rounds=40))
    assert abs(share["a"] - share["b"]) <= 1, share
    fair = FairShare()
    fair.add("capped", "interactive", cap=1)
    fair.add("other", "nightly")
    fair.started("capped")
    assert fair.pick(["capped", "other"]) == "other"
    fair.started("other")
    fair.started("other")
    assert fair.pick(["capped"]) is None


def test_an_unknown_priority_is_refused_with_the_choices():
    with pytest.raises(UnknownPriority, match="interactive, batch, nightly"):
        FairShare().add("j", "urgent")


class Outbox(NoEvents):
    def __init__(self):
        self.finished_units: list[str] = []

    def finished(self, unit, result):
        self.finished_units.append(unit.unit_id)


def _run_job(pool: SharedPool, job: str, priority: str, units, box: dict) -> threading.Thread:
    def go():
        box[job] = list(pool.run(job, priority, units, None, Outbox()))
    t = threading.Thread(target=go)
    t.start()
    return t


def _gated_pool(release: threading.Event, config: ServiceConfig, free: str | None = None):
    """A one-CPU pool whose units (but job `free`'s) run until the test sets `release`; the jobs in
    the order their units started, and each unit's niceness."""
    cluster = FakeCluster()
    cluster.offers = {"CPU": 1.0, "farm_cpu_avx2": 1.0}
    submit, nice, starts = cluster.submit, {}, []

    def gated(actor, unit, job=None, niceness=0):
        nice[unit.graph] = niceness
        future = submit(actor, unit, job, niceness)
        if job != free:
            future.done = False
            threading.Thread(target=lambda: (release.wait(), time.sleep(0.05), setattr(future, "done", True))).start()
        return future

    cluster.submit = gated
    pool = SharedPool(cluster, "mem://", config, on_start=lambda job, unit, p, w: starts.append(job))
    return cluster, pool, starts, nice


def _until_started(starts: list) -> None:
    deadline = time.monotonic() + 10
    while not starts and time.monotonic() < deadline:
        time.sleep(0.01)


def test_the_shared_pool_starts_a_short_job_before_a_long_jobs_remaining_units():
    release = threading.Event()
    _, pool, starts, _ = _gated_pool(release, ServiceConfig(idle_s=60, burst_workers=0))  # fair share alone
    box: dict = {}
    long = _run_job(pool, "nightly", "nightly", [_unit(f"g{i}") for i in range(4)], box)
    _until_started(starts)
    short = _run_job(pool, "mine", "interactive", [_unit("mine")], box)
    time.sleep(0.2)
    release.set()
    long.join(10)
    short.join(10)
    pool.stop()
    assert starts[0] == "nightly" and starts[1] == "mine", starts
    assert len(box["nightly"]) == 4 and len(box["mine"]) == 1


def test_an_interactive_unit_starts_at_once_on_a_burst_worker_while_a_nightly_fills_the_pool():
    """One CPU, busy with a nightly's unit: the burst worker beside it (no CPU of its own, warm)
    runs the interactive unit now; a batch job's unit still waits for the pool; the burst worker
    stops with the pool's last worker."""
    release = threading.Event()
    cluster, pool, starts, nice = _gated_pool(release, ServiceConfig(idle_s=60), free="mine")
    box: dict = {}
    nightly = _run_job(pool, "nightly", "nightly", [_unit(f"n{i}") for i in range(2)], box)
    _until_started(starts)
    batch = _run_job(pool, "batch", "batch", [_unit("b")], box)
    mine = _run_job(pool, "mine", "interactive", [_unit("mine")], box)
    mine.join(10)
    assert starts == ["nightly", "mine"] and [r.status for _, r in box["mine"]] == ["compiled"], starts
    assert [n for n in cluster.names if n.endswith("(beside)")] == ["farm-service/burst/farm_cpu_avx2/1.1 (beside)"]
    assert nice == {"n0": NICENESS["nightly"], "mine": 0}
    release.set()
    nightly.join(10)
    batch.join(10)
    assert sorted(starts) == ["batch", "mine", "nightly", "nightly"]
    pool.config = ServiceConfig(idle_s=0)  # the pool's workers go idle: the burst worker goes with the last
    deadline = time.monotonic() + 10
    while pool.slots and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not pool.slots
    pool.stop()


def test_cancel_drops_queued_units_and_stops_running_ones_each_reported_once():
    cluster = FakeCluster(runs=lambda u, n: "hang")
    cluster.offers = {"CPU": 1.0, "farm_cpu_avx2": 1.0}
    pool = SharedPool(cluster, "mem://", ServiceConfig())
    box: dict = {}
    t = _run_job(pool, "j", "batch", [_unit(f"g{i}") for i in range(3)], box)
    deadline = time.monotonic() + 10
    while pool.load()["jobs"].get("j", {}).get("running", 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.cancel("j") == 3
    t.join(10)
    results = box["j"]
    assert sorted(u.graph for u, _ in results) == ["g0", "g1", "g2"]
    assert all(r.status == "skipped" and "cancelled" in r.error for _, r in results)
    assert any("nothing of it was published" in r.error for _, r in results)
    assert cluster.killed, "the running unit's worker was not stopped"
    pool.stop()


def test_a_free_worker_beside_a_busy_one_does_not_have_the_pool_ask_the_cluster_every_round():
    """A job's last unit runs while the other worker is free: the pool looks for new units every
    IDLE_POLL_S, but asks what the cluster offers (on Ray, a call to its GCS) only as units come in
    or once a ROUND_S; a job that comes then still runs."""
    cluster = FakeCluster(runs=lambda u, n: "hang" if u.graph == "last" else "ok")
    pool = SharedPool(cluster, "mem://", ServiceConfig(idle_s=60))
    box: dict = {}
    _run_job(pool, "long", "batch", [_unit("last")], box)
    deadline = time.monotonic() + 10
    while pool.load()["jobs"].get("long", {}).get("running", 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    _run_job(pool, "short", "batch", [_unit("short")], box).join(10)
    assert [r.status for _, r in box["short"]] == ["compiled"] and pool.load()["workers"]["idle"] >= 1
    asked, began = cluster.asked, time.monotonic()
    time.sleep(2.0)
    asked, spent = cluster.asked - asked, time.monotonic() - began
    assert asked <= spent / ROUND_S + 2, f"asked the cluster {asked} times in {spent:.1f} s with nothing new"
    _run_job(pool, "next", "interactive", [_unit("next")], box).join(10)
    assert [r.status for _, r in box["next"]] == ["compiled"]
    pool.stop()


def test_idle_workers_rest_then_stop_and_a_job_cancelled_while_planning_queues_nothing():
    cluster = FakeCluster()
    pool = SharedPool(cluster, "mem://", ServiceConfig(idle_s=0.3))
    box: dict = {}
    _run_job(pool, "j", "batch", [_unit("a"), _unit("b")], box).join(10)
    deadline = time.monotonic() + 10
    while pool.slots and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pool.slots, "idle workers did not stop after idle_s"
    assert cluster.rested, "an idle worker's sandbox child was not renewed"
    pool.cancel("later")
    _run_job(pool, "later", "batch", [_unit("c")], box).join(10)
    assert [r.status for _, r in box["later"]] == ["skipped"]
    pool.stop()


def _workers(pool: SharedPool) -> list:
    return [s for s in pool.slots if not s.burst]


def test_a_gang_holding_cpus_shrinks_the_pool_as_units_end_and_it_grows_back_after():
    cluster = FakeCluster(runs=lambda u, n: "hang")
    pool = SharedPool(cluster, "mem://", ServiceConfig())
    box: dict = {}
    _run_job(pool, "j", "batch", [_unit(f"g{i}") for i in range(4)], box)
    deadline = time.monotonic() + 10
    while pool.load()["workers"]["busy"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    with pool.hold(1):
        time.sleep(0.2)
        assert [s.leaving for s in _workers(pool)].count(True) == 1  # busy: it leaves when its unit ends
        busy = next(s for s in pool.slots if s.leaving)
        busy.future.value = UnitResult(busy.unit.graph, busy.unit.target.label, "compiled")
        busy.future.done = True  # its unit ends
        while busy in pool.slots and time.monotonic() < deadline:
            time.sleep(0.01)
        assert busy not in pool.slots and len(_workers(pool)) == 1 and pool.load()["jobs"]["j"]["queued"] == 2
    while len(_workers(pool)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(_workers(pool)) == 2  # the gang is done: the pool takes its CPU back
    pool.stop()



def test_workers_that_left_for_a_gang_start_again_after_it_with_nothing_queued():
    cluster = FakeCluster()
    pool = SharedPool(cluster, "mem://", ServiceConfig())
    box: dict = {}
    _run_job(pool, "j", "batch", [_unit(f"g{i}") for i in range(4)], box).join(timeout=10)
    assert len(box["j"]) == 4 and len(_workers(pool)) == 2  # a result per unit, on two workers
    deadline = time.monotonic() + 10
    with pool.hold(2):
        while _workers(pool) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not _workers(pool)  # idle: they left at once, for the gang's bundles
    while len([s for s in _workers(pool) if s.free]) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len([s for s in _workers(pool) if s.free]) == 2  # back, warm, for the next job
    # they lowered before they left: their sandboxes warm the lowering as they start, not in the next unit
    assert [lowers for name, lowers in zip(cluster.names, cluster.lowers) if "(beside)" not in name] == \
        [False, False, True, True]
    pool.stop()

def test_a_gang_takes_its_classs_slots_from_idle_workers_of_that_class_though_cpus_are_left():
    """The test cluster's shape: x86-64 has one slot, on a node of its own. A gang of x86-64 ranks
    needs that slot, though the pool has CPUs enough without it: the idle x86-64 worker leaves and
    none starts while the gang holds it, even for a queued x86-64 unit, which runs after. (Its
    bundles waited 60 s and failed: 'Ray could not reserve 2 bundles', when no avx2 worker happened
    to be there to leave instead.)"""
    cluster = FakeCluster()
    cluster.offers = {"CPU": 3.0, "farm_cpu_avx2": 2.0, "farm_cpu_x86_64": 1.0}
    cluster.node_offers = [{"CPU": 2.0, "farm_cpu_avx2": 2.0}, {"CPU": 1.0, "farm_cpu_x86_64": 1.0}]
    pool = SharedPool(cluster, "mem://", ServiceConfig())
    x86 = lambda g: Unit(g, f"{g}.pt2", Target("aoti-cpu", "x86-64"), BlobRef("0" * 64, 1), limits=UnitLimits())  # noqa: E731
    box: dict = {}
    _run_job(pool, "j", "batch", [x86("g0")], box).join(timeout=10)
    assert [s.resource for s in _workers(pool)] == ["farm_cpu_x86_64"]
    deadline = time.monotonic() + 10
    with pool.hold(2, {"farm_cpu_x86_64": 1.0}):
        while _workers(pool) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not _workers(pool)  # idle: it left at once, for the gang's bundles
        late = _run_job(pool, "k", "batch", [x86("g1")], box)
        time.sleep(0.3)
        assert not _workers(pool) and "k" not in box  # no x86-64 worker while the gang holds its slot
    late.join(timeout=10)
    assert [r.status for _, r in box["k"]] == ["compiled"]  # after the gang: a worker again, and the unit ran
    pool.stop()


class _Rank:
    def __init__(self, n: int):
        self._actor_id, self.rests = n, 0
        self.rest = self  # the actor's method: `rest.remote()`

    def remote(self) -> None:
        self.rests += 1


def test_warm_gang_ranks_serve_only_their_shape_are_renewed_between_gangs_and_leave_when_idle():
    cluster = FakeCluster(runs=lambda u, n: "hang")
    pool = SharedPool(cluster, "mem://", ServiceConfig(idle_s=0.3))
    warm = pool.gang_ranks
    reader, waiter, failed = _Rank(1), _Rank(2), _Rank(3)
    for actor, shape in ((reader, ("node-a", "cpu", True)), (waiter, ("node-a", "cpu", False)),
                         (failed, ("node-a", "cpu", True))):
        warm.lend(actor, shape)
    assert warm.back([reader, waiter], kept=True) == []  # their gang returned
    assert warm.back([failed], kept=False) == [failed]  # its gang failed: stopped, never kept
    assert (reader.rests, waiter.rests) == (1, 1)  # a fresh sandbox child before any other gang
    assert warm.take(("node-b", "cpu", True)) is None and warm.take(("node-a", "cuda", True)) is None
    assert warm.take(("node-a", "cpu", False)) is waiter  # a waiting rank (niced for life) waits again
    warm.lend(waiter, ("node-a", "cpu", False))
    assert pool.load()["gang_ranks"] == {"idle": 1, "running": 1, "started": 0, "reused": 1}
    deadline = time.monotonic() + 10
    while reader not in cluster.stopped and time.monotonic() < deadline:
        time.sleep(0.02)
    assert reader in cluster.stopped and waiter not in cluster.stopped  # idle past idle_s; lent ones stay
    assert warm.take(("node-a", "cpu", True)) is None
    pool.stop()


def _sized(graph: str, isa: str, size: int) -> Unit:
    return Unit(graph, f"{graph}.pt2", Target("aoti-cpu", isa), BlobRef("0" * 64, size), limits=UnitLimits())


def test_a_jobs_isas_share_the_services_workers_and_its_largest_units_go_first():
    """A nightly of avx2 and x86-64 units on a host that builds both: the service's avx2 workers
    build the x86-64 units too, so no worker stops for another ISA's to start (each start is a
    torch import), and each job's largest units start first, the small ones filling the end."""
    cluster = FakeCluster()
    cluster.offers = {"CPU": 2.0, "farm_cpu_avx2": 2.0, "farm_cpu_x86_64": 2.0}
    pool = SharedPool(cluster, "mem://", ServiceConfig())
    units = [_sized(f"{isa}-{size}", isa, size) for isa in ("avx2", "x86-64") for size in (1, 5, 3)]
    box: dict = {}
    _run_job(pool, "nightly", "nightly", units, box).join(timeout=10)
    assert sorted(r.status for _, r in box["nightly"]) == ["compiled"] * 6
    assert all("/farm_cpu_avx2/" in name for name in cluster.names), cluster.names  # burst workers too
    assert len([name for name in cluster.names if "/worker/" in name]) == 2, cluster.names
    x86_by = Counter(name for name, label in cluster.ran if label == "aoti-cpu:x86-64")
    assert sum(x86_by.values()) == 3 and all("/farm_cpu_avx2/" in name for name in x86_by), x86_by
    order = [u.graph for u, _ in box["nightly"]]
    for isa in ("avx2", "x86-64"):
        assert [g for g in order if g.startswith(isa)] == [f"{isa}-5", f"{isa}-3", f"{isa}-1"]
    pool.stop()
