"""Warm vs. cold: the zoo job run cold, then again unchanged, in one run.

Cold: a fresh store and a fresh Inductor cache (TORCHINDUCTOR_CACHE_DIR, set before torch is
imported), so every unit really compiles; the precompiled header in /tmp is whatever this host
already has. Warm: the same job into the same store, so every unit must be a hit. Both runs
are in one process that has already imported torch, so neither pays torch's start-up.

    .venv/bin/python bench/warm.py                   # in-process runner (`farm run`)
    .venv/bin/python bench/warm.py --ray             # also through an embedded Ray (`farm submit`)
    .venv/bin/python bench/warm.py --store s3://bucket/prefix

Prints warm_time / cold_time; the goal is at most 0.05 for the zoo job.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def _timed(job, store, runner=None):
    from scheduler.jobs import execute, run_in_process

    t0 = time.perf_counter()
    outcome = execute(job, store, runner or run_in_process)
    return time.perf_counter() - t0, outcome


def _check(outcome, status: str) -> None:
    wrong = [(r.graph, r.status, r.error) for r in outcome.results if r.status != status]
    assert not wrong, f"expected every unit to be {status}: {wrong}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", help="store URI (default: a fresh local directory)")
    ap.add_argument("--ray", action="store_true", help="also run cold and warm through an embedded Ray")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.scratch import scratch_dir

    root = scratch_dir("farm-warm-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")  # before torch is imported

    from scheduler.spec import parse_job
    from farm.zoo import export_zoo
    from storage import CacheConfig, store_from_uri

    graphs = [str(p) for p in export_zoo(root / "zoo")]
    job = parse_job({"name": "warm", "graphs": graphs, "targets": ["aoti-cpu"]})
    store = store_from_uri(args.store or str(root / "store"), CacheConfig(root / "disk-cache"))

    cold_s, cold = _timed(job, store)
    _check(cold, "compiled")
    warm_s, warm = _timed(job, store)
    _check(warm, "hit")
    print(f"compared: the zoo job ({len(graphs)} models x aoti-cpu) into {store.uri}, in one process")
    print(f"cold (fresh store, fresh Inductor cache): {cold_s:7.2f} s  ({cold.stats.compile_s:.1f} s compiling)")
    print(f"warm (same job again, all hits):          {warm_s:7.2f} s  (saved {warm.stats.saved_s:.1f} s of compiles)")
    print(f"warm / cold = {warm_s / cold_s:.3f}  (goal <= 0.05)")

    if args.ray:
        from scheduler.ray_pool import PoolConfig, RayRunner
        from scheduler.ray_session import ray_session

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor-ray")  # inherited by the workers
        ray_store = store_from_uri(str(root / "store-ray") if not args.store else args.store.rstrip("/") + "-ray")
        with ray_session(None) as session:  # embedded, so hits are answered before any worker starts
            cold_s, cold = _timed(job, ray_store, RayRunner(PoolConfig(), lookup_first=session.embedded))
            _check(cold, "compiled")
            warm_s, warm = _timed(job, ray_store, RayRunner(PoolConfig(), lookup_first=session.embedded))
            _check(warm, "hit")
        print(f"through Ray (embedded, its start not counted; hits answered before workers start): "
              f"cold {cold_s:.2f} s, warm {warm_s:.2f} s, warm / cold = {warm_s / cold_s:.3f}")


if __name__ == "__main__":
    main()
