"""The worker pool's rules (retry, restart, give up, timeout, exactly one result per unit) on a
fake cluster: fast, no Ray. The same rules on a real Ray cluster: tests/test_ray_farm.py."""
from __future__ import annotations

import itertools
import time
import zipfile
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from scheduler import pool
from scheduler.jobs import NoEvents
from scheduler.pool import PoolConfig, WorkerPool
from scheduler.warm_workers import WarmWorkers
from storage import BlobRef
from workers.unit import Target, Unit, UnitLimits, UnitResult


@dataclass
class Future:
    value: Any = None
    error: BaseException | None = None
    done: bool = True


class FakeCluster:
    """Workers that start (or die starting) and run units (or die, or hang) as the test says."""

    def __init__(self, starts: Callable[[int], str] = lambda n: "ok", runs: Callable[[Unit, int], str] = lambda u, n: "ok"):
        self.starts, self.runs = starts, runs
        self.started, self.killed, self.stopped, self.rested = 0, [], [], []
        self.attempts: Counter = Counter()
        self.ran: list[tuple[str, str]] = []  # (worker's name, unit's target) per submission
        self.offers = {"CPU": 2.0, "farm_cpu_avx2": 2.0}
        self.node_offers: list[dict] = []  # per node; [offers] when empty
        self.placed: list[dict] = []  # each started worker's custom resources
        self.names: list[str] = []  # each started worker's name, " (beside)" for a burst worker
        self.lowers: list[bool] = []  # whether each started worker's sandbox warms the lowering as it starts
        self.asked = 0  # how often the pool asked what the cluster offers (a GCS call on Ray)
        self._ids = itertools.count()

    def start(self, name, placement, store_uri, limits, device, beside=False, lowers=False):
        self.started += 1
        self.names.append(name + (" (beside)" if beside else ""))
        self.lowers.append(lowers)
        self.placed.append(placement.resources)
        return {"id": next(self._ids), "name": name, "dies": self.starts(self.started) != "ok"}

    def ready(self, actor):
        return _died_with(ValueError("FARM_CACHE_GB='lots' is not a number")) if actor["dies"] else Future(actor["id"])

    def submit(self, actor, unit, job=None, niceness=0):
        self.attempts[unit.unit_id] += 1
        self.ran.append((actor["name"], unit.target.label))
        what = self.runs(unit, self.attempts[unit.unit_id])
        if what == "die":
            return Future(error=ActorDiedError())
        if what == "hang":
            return Future(done=False)
        return Future(value=UnitResult(unit.graph, unit.target.label, "compiled", key="k-" + unit.graph))

    def wait(self, futures, timeout):
        done = [f for f in futures if f.done]
        if not done:
            time.sleep(0.01)
        return done

    def get(self, future):
        if future.error is not None:
            raise future.error
        return future.value

    def pids(self, actors):
        return [a["id"] for a in actors]

    def kill(self, actor):
        self.killed.append(actor["id"])

    def offered(self):
        self.asked += 1
        return self.offers

    def nodes(self):
        return self.node_offers or [self.offers]

    def stop(self, actors):
        self.stopped = [a["id"] if isinstance(a, dict) else a for a in actors]  # a gang's warm rank: itself

    def rest(self, actor):
        self.rested.append(actor["id"])


def _died_with(error: BaseException) -> Future:
    """As Ray reports an actor whose constructor raised."""
    trace = f"Traceback (most recent call last):\n  File \"ray_pool.py\", line 1, in __init__\n{type(error).__name__}: {error}"
    return Future(error=ActorDiedError(RayTaskError("CompileWorker.__init__", trace, error)))


def _units(n: int, timeout_s: float = 1800.0, isa: str = "avx2") -> list[Unit]:
    return [Unit(f"g{i}", f"g{i}.pt2", Target("aoti-cpu", isa), BlobRef("0" * 64, 1), limits=UnitLimits(timeout_s=timeout_s))
            for i in range(n)]


def _run(cluster: FakeCluster, units: list[Unit], **config) -> dict[str, UnitResult]:
    runner = WorkerPool(PoolConfig(**config), job_id="fake", cluster=cluster)
    results = list(runner(units, store=_NoStore(), events=NoEvents()))
    ids = [u.unit_id for u, _ in results]
    assert sorted(ids) == sorted(u.unit_id for u in units)  # every unit reported exactly once
    return {u.unit_id: r for u, r in results}


class _NoStore:
    uri = "fake://store"


def test_a_unit_whose_worker_dies_is_requeued_then_fails_after_its_retries():
    cluster = FakeCluster(runs=lambda unit, n: "die" if unit.graph == "g0" else "ok")
    results = _run(cluster, _units(3), retries=2)
    assert results["g0@aoti-cpu:avx2"].status == "failed" and results["g0@aoti-cpu:avx2"].retries == 2
    assert "its worker died 3 times" in results["g0@aoti-cpu:avx2"].error
    assert cluster.attempts["g0@aoti-cpu:avx2"] == 3 and len(cluster.killed) == 3  # each dead worker replaced
    assert [results[f"g{i}@aoti-cpu:avx2"].status for i in (1, 2)] == ["compiled", "compiled"]


def test_a_unit_that_dies_once_succeeds_on_its_retry():
    cluster = FakeCluster(runs=lambda unit, n: "die" if n == 1 else "ok")
    results = _run(cluster, _units(2), retries=1)
    assert all(r.status == "compiled" and r.retries == 1 for r in results.values())


def test_workers_dying_while_starting_are_restarted_a_bounded_number_of_times():
    cluster = FakeCluster(starts=lambda n: "die")
    results = _run(cluster, _units(4), start_attempts=3)
    assert cluster.started == 3 + 1  # two slots started; one restarted until the third failure in a row
    for r in results.values():
        assert r.status == "failed" and "died while starting 3 times in a row" in r.error
        assert "ValueError: FARM_CACHE_GB='lots' is not a number" in r.error


def test_a_worker_that_starts_after_failures_resets_the_count():
    cluster = FakeCluster(starts=lambda n: "die" if n in (1, 3) else "ok")  # never two in a row
    results = _run(cluster, _units(3), start_attempts=2)
    assert all(r.status == "compiled" for r in results.values())


def test_a_unit_stuck_past_its_timeout_fails_and_its_worker_is_replaced(monkeypatch):
    monkeypatch.setattr(pool, "WORKER_GRACE_S", 0.0)
    cluster = FakeCluster(runs=lambda unit, n: "hang" if unit.graph == "g1" else "ok")
    results = _run(cluster, _units(3, timeout_s=0.2))
    stuck = results["g1@aoti-cpu:avx2"]
    assert stuck.status == "failed" and stuck.error.startswith("graph g1 (aoti-cpu:avx2): timeout")
    assert cluster.killed and all(results[f"g{i}@aoti-cpu:avx2"].status == "compiled" for i in (0, 2))


@pytest.mark.parametrize("workers", [1, 2])
def test_every_unit_is_reported_once_and_the_workers_are_stopped(workers):
    cluster = FakeCluster()
    results = _run(cluster, _units(5), workers=workers)
    assert len(results) == 5 and cluster.started == workers and len(cluster.stopped) == workers


def test_a_mix_of_isas_shares_its_workers_instead_of_one_worker_per_isa():
    """avx2 and x86-64 units on a host that builds both: an avx2 worker builds x86-64 code too, so
    both workers are avx2 ones and both take x86-64 units (one worker per ISA idled while the other
    ISA's longer units ran on); the two run different ISAs side by side, so that a cold node
    builds both ISAs' compile headers at once instead of one worker waiting on the other's."""
    cluster = FakeCluster()
    cluster.offers = {"CPU": 2.0, "farm_cpu_avx2": 2.0, "farm_cpu_x86_64": 2.0}
    results = _run(cluster, _units(2, isa="avx2") + _units(6, isa="x86-64"))
    assert all(r.status == "compiled" for r in results.values()) and cluster.started == 2 and not cluster.killed
    assert {name.split("/")[2] for name, _ in cluster.ran} == {"farm_cpu_avx2"}
    assert cluster.placed == [{"farm_cpu_avx2": 1.0, "farm_cpu_x86_64": 1.0}] * 2  # each holds an x86-64 slot too
    x86_by = Counter(name for name, label in cluster.ran if label == "aoti-cpu:x86-64")
    assert len(x86_by) == 2 and sum(x86_by.values()) == 6  # both workers took some
    # own class first, the other ISA beside it while both have units, then x86-64 on both
    assert [label for _, label in cluster.ran] == ["aoti-cpu:avx2", "aoti-cpu:x86-64"] * 2 + ["aoti-cpu:x86-64"] * 4


def test_a_class_s_largest_programs_go_out_first():
    cluster = FakeCluster()
    units = [Unit(f"g{i}", f"g{i}.pt2", Target("aoti-cpu", "avx2"), BlobRef(str(i) * 64, size)) for i, size in enumerate([5, 90, 40])]
    results = _run(cluster, units)
    assert all(r.status == "compiled" for r in results.values())
    assert list(cluster.attempts) == ["g1@aoti-cpu:avx2", "g2@aoti-cpu:avx2", "g0@aoti-cpu:avx2"]  # submission order


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_zoo_jobs_units_go_out_largest_graph_first_not_largest_archive(zoo_dir, where, request, tmp_path):
    """Planned from real exports into a real store (SeaweedFS too, through the planner's read of a
    blob's end): the mlp's archive is larger than the cnn's (its weights), its graph smaller, and
    it lowers faster; the pool goes by the graphs' bytes that each archive's directory declares,
    for a graph named by path and for one a client uploaded first (blob://, a service's jobs)."""
    from scheduler.plan import plan
    from scheduler.spec import parse_job
    from storage import store_from_uri

    store = store_from_uri(request.getfixturevalue(f"{where}_uri"))
    models = ("mlp", "cnn", "encoder_block", "gpt")
    declared = {m: sum(i.file_size for i in zipfile.ZipFile(zoo_dir / f"{m}.pt2").infolist()
                       if i.filename.endswith(".json") and "/models/" in i.filename) for m in models}
    for named in ({m: str(zoo_dir / f"{m}.pt2") for m in models},
                  {m: f"blob://sha256/{store.put_file(zoo_dir / f'{m}.pt2').digest}" for m in models}):
        units = plan(parse_job({"name": "zoo", "graphs": [{"path": named[m], "name": m} for m in models],
                                "targets": ["aoti-cpu:avx2"]}), store)
        by = {u.graph: u for u in units}
        assert {m: by[m].graph_bytes for m in models} == declared
        assert by["mlp"].program.size > by["cnn"].program.size and by["mlp"].compile_size < by["cnn"].compile_size
        cluster = FakeCluster()
        _run(cluster, units)
        assert [a.split("@")[0] for a in cluster.attempts] == ["gpt", "encoder_block", "cnn", "mlp"]


def test_an_archive_whose_directory_cannot_be_read_from_its_end_gets_no_estimate(zoo_dir):
    """Junk, a cut archive, or a directory larger than the reads: no estimate (the pool then
    goes by the program's size), and nothing raised."""
    from scheduler.compile_size import graph_bytes

    whole = (zoo_dir / "gpt.pt2").read_bytes()
    assert graph_bytes(lambda n: whole[-n:], len(whole)) > 0
    assert graph_bytes(lambda n: whole[:-100][-n:], len(whole) - 100) is None  # its end cut off
    assert graph_bytes(lambda n: whole[-min(n, 50):], len(whole)) is None  # the reads hold no directory
    assert graph_bytes(lambda n: b"not a zip" * 100, 900) is None
    assert graph_bytes(lambda n: None, len(whole)) is None  # gone from the store
    assert graph_bytes(lambda n: b"", 0) is None


def test_a_worker_takes_a_covered_isa_only_where_its_node_offers_it():
    """Units route by what a node offers: where the avx2 node offers no x86-64 slots, the x86-64
    units get x86-64 workers (on the node that offers them), and avx2 workers hold only avx2."""
    cluster = FakeCluster()
    cluster.offers = {"CPU": 2.0, "farm_cpu_avx2": 1.0, "farm_cpu_x86_64": 1.0}
    cluster.node_offers = [{"CPU": 1.0, "farm_cpu_avx2": 1.0}, {"CPU": 1.0, "farm_cpu_x86_64": 1.0}]
    results = _run(cluster, _units(2, isa="avx2") + _units(2, isa="x86-64"))
    assert all(r.status == "compiled" for r in results.values())
    assert {(name.split("/")[2], label) for name, label in cluster.ran} == {
        ("farm_cpu_avx2", "aoti-cpu:avx2"), ("farm_cpu_x86_64", "aoti-cpu:x86-64")}
    assert sorted(cluster.placed, key=str) == [{"farm_cpu_avx2": 1.0}, {"farm_cpu_x86_64": 1.0}]


def test_an_isa_no_worker_covers_still_gets_its_own_workers():
    """x86-64 workers never take avx2 units: a job of both on a host without AVX2 slots fails the
    avx2 units it cannot place and builds the rest on x86-64 workers."""
    cluster = FakeCluster()
    cluster.offers = {"CPU": 2.0, "farm_cpu_x86_64": 2.0}
    results = _run(cluster, _units(2, isa="avx2") + _units(2, isa="x86-64"))
    assert [results[f"g{i}@aoti-cpu:avx2"].status for i in (0, 1)] == ["failed", "failed"]
    assert "farm_cpu_avx2" in results["g0@aoti-cpu:avx2"].error
    assert [results[f"g{i}@aoti-cpu:x86-64"].status for i in (0, 1)] == ["compiled", "compiled"]
    assert {name.split("/")[2] for name, _ in cluster.ran} == {"farm_cpu_x86_64"}


def _jobs_on(cluster: FakeCluster, warm: WarmWorkers, *jobs: list[Unit]) -> list[dict[str, UnitResult]]:
    """Jobs one after another on one cluster, as a zoo run without a service runs its groups."""
    out = []
    for i, units in enumerate(jobs):
        runner = WorkerPool(PoolConfig(), job_id=f"job{i}", cluster=cluster, warm=warm)
        out.append({u.unit_id: r for u, r in runner(units, store=_NoStore(), events=NoEvents())})
    return out


def test_a_drivers_next_job_runs_on_the_workers_its_last_job_left_and_renews_their_children():
    cluster, warm = FakeCluster(), WarmWorkers("zoo-run")
    first, second = _jobs_on(cluster, warm, _units(4), _units(3))
    assert all(r.status == "compiled" for r in [*first.values(), *second.values()])
    assert cluster.started == 2 and warm.reused == 2  # the second job started none
    assert sorted(cluster.rested) == [0, 0, 1, 1]  # each job's children replaced before the next job's units
    assert cluster.stopped == [] and len(warm) == 2  # kept for the next job: the owner stops them
    assert all(name.startswith("zoo-run/farm-worker/farm_cpu_avx2/") for name in cluster.names)
    assert len(set(cluster.names)) == 2  # Ray's names are unique while a kept worker lives


class _StartsLate:
    """A worker's start that ends once `when()` holds (Future's fields, `done` asked each time)."""

    def __init__(self, value: Any, when: Callable[[], bool]):
        self.value, self.error, self._when = value, None, when

    @property
    def done(self) -> bool:
        return self._when()


def test_a_smaller_next_job_takes_the_worker_that_ran_the_last_jobs_units_and_stops_the_idle_one():
    """Worker 0 starts only after worker 1 took both units: it ends the job idle. The next job,
    of one unit, runs on worker 1 (the one the last job's results name), and worker 0 is stopped."""
    cluster, warm = FakeCluster(), WarmWorkers("zoo-run")
    fake_ready = cluster.ready
    cluster.ready = lambda actor: (_StartsLate(actor["id"], lambda: len(cluster.ran) >= 2) if actor["id"] == 0
                                   else fake_ready(actor))
    stops = []
    cluster.stop = lambda actors: stops.append(sorted(a["id"] for a in actors))
    _jobs_on(cluster, warm, _units(2), _units(1))
    first, second = cluster.ran[:2], cluster.ran[2:]
    assert {name for name, _ in first} == {"zoo-run/farm-worker/farm_cpu_avx2/1"}, cluster.ran
    assert [name for name, _ in second] == ["zoo-run/farm-worker/farm_cpu_avx2/1"], cluster.ran
    assert cluster.started == 2 and warm.reused == 1
    assert stops == [[], [], [0], []]  # per job: what it did not take as it started, what it did not keep


def test_kept_workers_the_next_job_cannot_use_are_stopped_as_it_starts_its_own():
    """Another device class (or placement, device or store): never given a unit of the wrong
    kind, and not left holding Ray's resources while the new job's workers wait for them."""
    cluster, warm = FakeCluster(), WarmWorkers("zoo-run")
    cluster.offers = {"CPU": 2.0, "farm_cpu_avx2": 2.0, "farm_cpu_x86_64": 2.0}
    stops = []
    cluster.stop = lambda actors: stops.append(sorted(a["id"] for a in actors))
    _jobs_on(cluster, warm, _units(2, isa="avx2"), _units(2, isa="x86-64"))
    assert cluster.started == 4 and warm.reused == 0
    assert stops[:2] == [[], []] and stops[2] == [0, 1]  # the avx2 pair, once the x86-64 pair was asked for
    assert {name.split("/")[2] for name, label in cluster.ran if label == "aoti-cpu:x86-64"} == {"farm_cpu_x86_64"}


def test_a_worker_that_died_or_a_job_broken_off_leaves_nothing_kept():
    cluster, warm = FakeCluster(runs=lambda unit, n: "die" if unit.graph == "g0" and n == 1 else "ok"), WarmWorkers("r")
    _jobs_on(cluster, warm, _units(2))
    assert cluster.killed == [0] or cluster.killed == [1]  # the worker that died was replaced, not kept
    assert len(warm) == 2 and cluster.killed[0] not in [a["id"] for a in warm.close()]
    runner = WorkerPool(PoolConfig(), job_id="broken-off", cluster=cluster, warm=warm)
    results = runner(_units(2), store=_NoStore(), events=NoEvents())
    next(results)
    results.close()  # the driver stopped following it (Ctrl-C, an error of its own)
    assert len(warm) == 0 and len(cluster.stopped) == 2


def test_run_tasks_refuses_a_function_its_workers_cannot_import_by_name():
    """A Ray task imports its function by `module:name` (with the heap frozen after the import):
    a lambda or a local function is refused before anything is placed, saying what to do."""
    from scheduler.ray_tasks import run_tasks

    def local() -> None:
        pass

    for fn in (lambda: None, local):
        with pytest.raises(ValueError, match="is a lambda or a local function: define it at a module's top level"):
            run_tasks(fn, [()], "export", 1.0)
