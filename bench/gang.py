"""A gang of 4 identical CPU ranks against one compile of the same graph, in one run; and the
time a divergent gang takes to fail.

Both sides go through the farm on an embedded Ray (its start not counted: a farm's cluster is
already up), each in a fresh process with a fresh store, a fresh Inductor cache
and a fresh node dir (FARM_NODE_CACHE: each side builds its precompiled headers and asks the
host's ISA probes), and each pays for
its actors' start: one worker for the single compile; four rank actors, their process group,
the compiler collectives, one compile and three lookups for the gang. Rank 0 of the gang compiles while the other three ranks start
(workers/gang/early.py); the bench checks that it did, and prints each side's lowering time,
which the three ranks' start slows on 2 cores.

    .venv/bin/python bench/gang.py [--model mlp] [--ranks 4] [--pairs 3] [--service]

A first compile, not counted, reads torch and the compiler from disk for both sides. One pair
swings by a third on a shared 2-core machine, so it measures --pairs pairs, the sides taking
turns to go first, and prints each pair's gang_time / single_time and their median (goal <=
1.05); then how long a gang whose last rank issues an extra all-reduce takes to fail. With
--service, also pairs on a farm service that has served one of each before, whose worker and gang
ranks are then warm.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _side(args: argparse.Namespace) -> None:
    """One side, in this fresh process: prints {"seconds": ..., "statuses": [...]} as JSON."""
    sys.path.insert(0, str(ROOT))
    from scheduler.jobs import execute
    from scheduler.ray_pool import PoolConfig, RayRunner
    from scheduler.ray_session import ray_session
    from scheduler.spec import parse_job
    from storage import store_from_uri

    spec = json.loads(args.job)
    with ray_session(None, slots=os.cpu_count()):
        t0 = time.perf_counter()
        outcome = execute(parse_job(spec), store_from_uri(args.store), RayRunner(PoolConfig(), job_id=spec["name"]))
        seconds = time.perf_counter() - t0
    compiled = [r for r in outcome.results if r.status == "compiled"]
    print(json.dumps({"seconds": seconds, "statuses": [r.status for r in outcome.results],
                      "errors": [r.error for r in outcome.results if r.error],
                      "lower_s": compiled[0].timings.get("lower") if compiled else None,
                      "early": bool(compiled and compiled[0].metrics.get("gang_compiled_early"))}))


def _run(job: dict, root: Path, name: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root / f"cache-{name}"),
           "FARM_NODE_CACHE": str(root / f"node-{name}")}
    out = subprocess.run([sys.executable, __file__, "--side", "--job", json.dumps(job), "--store", str(root / f"store-{name}")],
                         check=True, env=env, cwd=ROOT, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--service", action="store_true",
                    help="also the pairs on a farm service that has served one of each: warm workers and gang ranks")
    ap.add_argument("--side", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        _side(args)
        return
    sys.path.insert(0, str(ROOT))
    from farm.zoo import export_zoo
    from tests.gang_models import shards

    from bench.scratch import scratch_dir
    from bench.trials import in_turn

    root = scratch_dir("farm-bench-gang-")
    (graph,) = export_zoo(root / "zoo", [args.model])
    for r in range(args.ranks):
        shutil.copy(graph, root / f"rank{r}.pt2")
    target = ["aoti-cpu:avx2"]

    single_job = {"name": "single", "graphs": [str(graph)], "targets": target}
    gang_job = {"name": "gang", "targets": target, "gangs": [
        {"name": args.model, "ranks": str(root / "rank{rank}.pt2"), "world_size": args.ranks}]}
    _run(single_job, root, "warm-up")  # not counted: the machine's first torch import and g++ run
    pairs, lowering = [], []
    for i in range(args.pairs):
        sides = in_turn(i, {"single": partial(_run, single_job, root, f"single-{i}"),
                            "gang": partial(_run, gang_job, root, f"gang-{i}")})
        assert sides["single"]["statuses"] == ["compiled"], sides["single"]
        assert sorted(sides["gang"]["statuses"]) == ["compiled"] + ["hit"] * (args.ranks - 1), sides["gang"]
        assert sides["gang"]["early"], "rank 0 of identical ranks did not compile while the others started"
        pairs.append((sides["single"]["seconds"], sides["gang"]["seconds"]))
        lowering.append((sides["single"]["lower_s"], sides["gang"]["lower_s"]))

    served = _on_a_served_service(root, args.ranks, args.pairs, target) if args.service else []
    divergent = shards(root, "divergent", args.ranks, [(2, 32)] * args.ranks, [4] * args.ranks, extra_on=args.ranks - 1)
    failed = _run({"name": "divergent", "targets": target, "gangs": [
        {"name": "divergent", "ranks": divergent, "world_size": args.ranks}]}, root, "divergent")
    assert set(failed["statuses"]) == {"failed"} and "collective #2" in failed["errors"][0], failed

    print(f"compared: zoo model {args.model!r} for {target[0]}, each side cold (fresh process, store and Inductor "
          f"cache; actor start-up counted, Ray's not), on {os.cpu_count()} cores")
    for i, (single, gang) in enumerate(pairs):
        first = "single" if i % 2 == 0 else "gang"
        print(f"pair {i + 1} ({first} first): single compile (1 worker) {single:5.1f} s, gang of {args.ranks} identical "
              f"ranks (1 compile) {gang:5.1f} s, gang_time / single_time = {gang / single:.2f}  "
              f"(lowering alone: {lowering[i][0]:.1f} s and {lowering[i][1]:.1f} s)")
    if pairs:  # --pairs 0: only the divergent gang
        print(f"median gang_time / single_time over {len(pairs)} pairs = "
              f"{statistics.median(g / s for s, g in pairs):.2f}  (goal <= 1.05)")
    print(f"a divergent gang of {args.ranks} failed in {failed['seconds']:.1f} s: {failed['errors'][0]}")
    if served:
        print(f"on a farm service that has served a single compile and a gang before (its worker and the gang's "
              f"{args.ranks} ranks warm; a fresh MLP, another key, for each side):")
        for i, (single, gang) in enumerate(served):
            print(f"pair {i + 1}: single compile {single:5.1f} s, gang of {args.ranks} {gang:5.1f} s, "
                  f"gang_time / single_time = {gang / single:.2f}")
        print(f"median on the served service = {statistics.median(g / s for s, g in served):.2f}")


def _on_a_served_service(root: Path, ranks: int, pairs: int, target: list[str]) -> list[tuple[float, float]]:
    """Pairs on one farm service (a fresh embedded Ray, store and Inductor cache) that has already
    run one single compile and one gang: its worker and the gang's ranks are warm (gang ranks:
    scheduler/gang_warm.py). A gang lends the pool its CPUs, so each single side starts once the
    pool has its warm worker back; the whole job is timed from submit to its outcome."""
    from bench.shared import export_graphs
    from farm.client import JobHandle
    from farm.service_client import Service
    from scheduler.ray_service import call, find_service, start_service, stop_service
    from scheduler.ray_session import ray_session
    from scheduler.service_config import ServiceConfig

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "cache-service")
    os.environ["FARM_NODE_CACHE"] = str(root / "node-service")
    (root / "served").mkdir()
    graphs = iter(export_graphs(root / "served", "mlp", [64 + i for i in range(2 * pairs + 2)]))
    with ray_session(None, slots=os.cpu_count()):
        start_service(str(root / "store-service"), ServiceConfig(min_workers=1))
        service = Service(find_service(), call(find_service(), "ping"))
        try:
            def run(spec: dict, want: list[str]) -> float:
                t0 = time.perf_counter()
                handle = JobHandle(service.submit(spec), service.store())
                handle.wait(every=0.05)
                seconds = time.perf_counter() - t0
                statuses = sorted(r.status for r in handle.outcome.results)
                assert statuses == want, [(r.status, r.error) for r in handle.outcome.results]
                return seconds

            def single() -> float:
                deadline = time.monotonic() + 120
                while call(find_service(), "load")["workers"]["idle"] < 1:  # after a gang: the pool's worker back
                    assert time.monotonic() < deadline, "the service's pool did not get its worker back"
                    time.sleep(0.1)
                return run({"name": "single", "graphs": [str(next(graphs))], "targets": target}, ["compiled"])

            def gang() -> float:
                graph = next(graphs)
                for r in range(ranks):
                    shutil.copy(graph, graph.with_name(f"{graph.stem}-rank{r}.pt2"))
                pattern = str(graph.with_name(f"{graph.stem}-rank{{rank}}.pt2"))
                return run({"name": "gang", "targets": target, "gangs": [
                    {"name": graph.stem, "ranks": pattern, "world_size": ranks}]}, ["compiled"] + ["hit"] * (ranks - 1))

            run({"name": "warm-up", "graphs": [str(next(graphs))], "targets": target}, ["compiled"])
            gang()  # not counted, with the line above: the worker's and the ranks' start
            return [(single(), gang()) for _ in range(pairs)]
        finally:
            stop_service()


if __name__ == "__main__":
    main()
