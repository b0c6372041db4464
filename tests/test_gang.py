"""Multi-rank models compiled as gangs on a real Ray cluster: each rank its own actor in one
placement group, agreeing through compiler collectives over a real gloo process group."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import ray

from scheduler.gang_warm import WarmRanks
from scheduler.jobs import NoEvents, execute
from scheduler.ray_pool import PoolConfig, RayRunner, close_ranks
from scheduler.spec import parse_job
from storage import store_from_uri
from storage.tuning import record_path
from tests.gang_models import replicas, shards
from workers.autotune.share import fingerprint_of

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def warm(ray_cluster):
    """Gang ranks kept warm from one test's job to the next, as a process that runs job after job
    keeps them (RayRunner.gang_ranks): the tests that start their ranks cold say so, and why."""
    ranks = WarmRanks(idle_s=3600)
    yield ranks
    close_ranks(ranks)


def _run(tmp_path, gangs, job_id, targets=("aoti-cpu:avx2",), events=NoEvents(), warm=None, **extra):
    job = parse_job({"name": job_id, "gangs": gangs, "targets": list(targets), **extra})
    store = store_from_uri(str(tmp_path / "store"))
    return execute(job, store, RayRunner(PoolConfig(), job_id=job_id, gang_ranks=warm), events=events), store


def test_identical_data_parallel_ranks_compile_once(ray_cluster, tmp_path):
    """Cold ranks: each its own actor in the gang's bundles, the waiting ones started as rank 0 lowers."""
    pattern = replicas(tmp_path, 4)
    outcome, _ = _run(tmp_path, [{"name": "dp", "ranks": pattern, "world_size": 4}], "dp")
    results = outcome.results
    assert [r.graph for r in results] == [f"dp.rank{r}" for r in range(4)]
    assert [r.status for r in results].count("compiled") == 1, [(r.status, r.error) for r in results]
    assert [r.status for r in results].count("hit") == 3
    assert len({r.key for r in results}) == 1 and len({r.artifact.digest for r in results}) == 1
    assert {r.metrics["gang_leader"] for r in results} == {0.0}
    assert len({r.worker for r in results}) == 4  # four rank actors, on two cores
    # rank 0 compiled while the other ranks started, and published once the gang had agreed
    assert results[0].metrics["gang_compiled_early"] == 1.0 and "agree" in results[0].timings


def test_tensor_parallel_ranks_agree_on_one_range_and_verify_across_the_gang(ray_cluster, tmp_path, warm):
    paths = shards(tmp_path, "tp", 2, ranges=[(2, 32), (4, 16)], examples=[8, 6])
    outcome, store = _run(tmp_path, [{"name": "tp", "ranks": paths, "world_size": 2}], "tp", warm=warm)
    for r in outcome.results:
        assert r.status == "compiled", r.error
        assert r.metrics["max_abs_err"] <= 1e-4 and r.metrics["compiled_ms"] > 0  # ran over the real group
        manifest = store.get_manifest(r.key)
        assert manifest["agreed_shapes"]["dims"] == [["x.0", 4, 16]]  # the intersection, on both ranks
        assert manifest["agreed_shapes"]["sizes"] == {"x.0": 8}  # one example size: rank 0's
    assert len({r.key for r in outcome.results}) == 2  # different shards: two compiles


def test_an_extra_all_reduce_on_one_rank_fails_the_gang_before_compiling(ray_cluster, tmp_path, warm):
    paths = shards(tmp_path, "div", 4, ranges=[(2, 32)] * 4, examples=[4] * 4, extra_on=3)
    start = time.monotonic()
    outcome, store = _run(tmp_path, [{"name": "div", "ranks": paths, "world_size": 4}], "div", warm=warm)
    print(f"a divergent gang of 4 failed in {time.monotonic() - start:.1f}s")
    for r in outcome.results:
        assert r.status == "failed"
        assert "collective #2" in r.error and "rank 3 issue all_reduce" in r.error, r.error
        assert "ranks 0, 1, 2 issue no more collectives" in r.error
        assert "lower" not in r.timings
    assert outcome.count("compiled") == 0


def test_conflicting_dynamic_ranges_are_reported_not_guessed(ray_cluster, tmp_path, warm):
    paths = shards(tmp_path, "far", 2, ranges=[(2, 8), (16, 32)], examples=[4, 20])
    outcome, _ = _run(tmp_path, [{"name": "far", "ranks": paths, "world_size": 2}], "far", warm=warm)
    for r in outcome.results:
        assert r.status == "failed" and "x.0" in r.error and "do not overlap" in r.error, r.error


class _Finishes(NoEvents):
    def __init__(self):
        self.at: dict[str, float] = {}

    def finished(self, unit, result):
        self.at[unit.graph] = time.monotonic()


def test_killing_one_ranks_actor_fails_its_gang_quickly_and_the_job_goes_on(ray_cluster, tmp_path):
    paths = shards(tmp_path, "tpk", 2, ranges=[(2, 32)] * 2, examples=[4] * 2)
    killed: dict[str, float] = {}

    def kill_rank_1():
        name = "kill/gang/tpk@aoti-cpu:avx2/rank1"  # cold ranks: only a gang's own actors bear such names
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                actor = ray.get_actor(name, namespace="farm")
            except ValueError:
                time.sleep(0.2)
                continue
            time.sleep(8)  # started, and into its compile
            ray.kill(actor, no_restart=True)
            killed["at"] = time.monotonic()
            return

    killer = threading.Thread(target=kill_rank_1, daemon=True)
    killer.start()
    events = _Finishes()
    outcome, _ = _run(tmp_path, [{"name": "tpk", "ranks": paths, "world_size": 2, "collective_timeout_s": 30},
                                 {"name": "dp", "ranks": replicas(tmp_path, 2), "world_size": 2}], "kill", events=events)
    killer.join()
    by_graph = {r.graph: r for r in outcome.results}
    for r in range(2):
        failed = by_graph[f"tpk.rank{r}"]
        assert failed.status == "failed" and "rank 1" in failed.error and "died" in failed.error, failed.error
    assert events.at["tpk.rank0"] - killed["at"] < 30  # within the collective timeout, never a hang
    assert {by_graph["dp.rank0"].status, by_graph["dp.rank1"].status} == {"compiled", "hit"}
    assert not ray.util.placement_group_table() or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


def test_inductor_cache_ranks_mark_the_same_dimensions_dynamic(ray_cluster, tmp_path, warm):
    paths = shards(tmp_path, "ic", 2, ranges=[(2, 32)] * 2, examples=[4, 6])
    outcome, store = _run(tmp_path, [{"name": "ic", "ranks": paths, "world_size": 2}], "ic", warm=warm,
                          targets=("inductor-cache:avx2",))
    facts = []
    for r in outcome.results:
        assert r.status == "compiled", r.error
        facts.append(store.get_manifest(r.key)["artifact"])
    assert facts[0]["mark_dynamic"] == facts[1]["mark_dynamic"] == ["x.0"]
    assert facts[0]["graphs_compiled"] == facts[1]["graphs_compiled"] == 1  # dynamic from the first call


def test_autotune_candidates_are_split_across_ranks_and_one_winner_applies_to_all(ray_cluster, tmp_path, warm):
    pattern = replicas(tmp_path, 2)
    broken = {"name": "broken", "options": {"no_such_inductor_setting": 1}}
    target = {"backend": "aoti-cpu", "isa": "avx2", "autotune": {"candidates": ["default", "single_thread", broken]}}
    outcome, store = _run(tmp_path, [{"name": "dpt", "ranks": pattern, "world_size": 2}], "tune", targets=(target,),
                          warm=warm)
    results = outcome.results
    assert len(results) == 2 and all(r.status in ("compiled", "hit") for r in results), [r.error for r in results]
    # the leader keeps the tuning record: every candidate's outcome, a failed one with its error
    record = json.loads(store.backend.read(record_path(results[0].components["program"]["graph"],
                                                       fingerprint_of(results[0].device))))
    candidates = {c["name"]: c for c in record["candidates"]}
    assert list(candidates) == ["default", "single_thread", "broken"]  # in the space's order
    failed = candidates.pop("broken")
    assert failed["status"] == "failed" and "no_such_inductor_setting" in failed["error"], failed
    assert all(c["status"] in ("compiled", "hit") for c in candidates.values()), candidates
    assert [r.metrics["autotune_compiled_here"] for r in results] == [1.0, 1.0]  # default+broken, single_thread
    assert record["measured_by_ranks"] == {"default": [0], "single_thread": [1], "broken": [0]}
    assert record["gang"] == "dpt@aoti-cpu:avx2" and [r.metrics["autotune_failed"] for r in results] == [1.0, 1.0]
    measured = {k: v for k, v in results[0].metrics.items() if k.startswith("autotune_ms[")}
    assert measured == {f"autotune_ms[{n}]": c["median_ms"] for n, c in candidates.items()}
    assert measured == {k: v for k, v in results[1].metrics.items() if k.startswith("autotune_ms[")}
    assert {r.candidate for r in results} == {record["winner"]} and {r.target for r in results} == {"aoti-cpu:avx2"}
    assert len({r.artifact.digest for r in results}) == 1
    # both ranks lowered the same code at once: each wrote its generated files in its own
    # directory, not in the shared Inductor cache where they packaged each other's half-written files
    assert not list(Path(ray_cluster.env["TORCHINDUCTOR_CACHE_DIR"]).rglob("*.wrapper.so"))


def test_data_parallel_training_ranks_compile_the_step_once(ray_cluster, tmp_path, warm):
    pattern = replicas(tmp_path, 4)
    outcome, store = _run(tmp_path, [{"name": "dpt", "ranks": pattern, "world_size": 4}], "dpt", warm=warm,
                          targets=("inductor-cache:avx2+train",))
    statuses = [r.status for r in outcome.results]
    assert statuses.count("compiled") == 1 and statuses.count("hit") == 3, [(r.status, r.error) for r in outcome.results]
    assert len({r.key for r in outcome.results}) == 1
    facts = store.get_manifest(outcome.results[0].key)["artifact"]
    assert facts["mode"] == "train" and facts["graphs"]["backward"] >= 1


def test_tensor_parallel_training_through_all_reduce_compiles_and_verifies_its_gradients(ray_cluster, tmp_path, warm):
    paths = shards(tmp_path, "tpt", 2, ranges=[(2, 32)] * 2, examples=[4, 6])
    outcome, store = _run(tmp_path, [{"name": "tpt", "ranks": paths, "world_size": 2}], "tpt", warm=warm,
                          targets=("inductor-cache:avx2+train",))
    for r in outcome.results:  # autograd differentiates _c10d_functional.all_reduce in torch 2.13
        assert r.status == "compiled", r.error
        assert r.metrics["max_abs_err"] < 1e-4  # outputs and gradients against eager, across the gang
        assert store.get_manifest(r.key)["artifact"]["mark_dynamic"] == ["x.0"]  # the ranks' agreement
