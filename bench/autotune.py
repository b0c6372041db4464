"""Autotune fan-out: the same autotune job serially in one process and on W Ray workers, in
one run. Both sides are cold the same way: a fresh store and a fresh Inductor cache each (so
every candidate compiles and benchmarks for real; the precompiled header in /tmp is shared),
and both pay one torch start-up per process. Ray's own start is not counted.

    .venv/bin/python bench/autotune.py [--workers 2] [--candidates default,max_autotune,freezing]

Prints farm_time / (serial_time / W) (goal <= 1.2) and the configuration chosen per model.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERIAL = """
import json, sys
from scheduler.spec import parse_job
from scheduler.jobs import execute
from storage import store_from_uri
job = parse_job(json.loads(sys.argv[1]))
out = execute(job, store_from_uri(sys.argv[2]))
print(json.dumps({r.graph: r.candidate for r in out.results if r.target.endswith("(autotuned)")}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--candidates", default="default,max_autotune,freezing")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from bench.scratch import scratch_dir

    root = scratch_dir("farm-autotune-")
    from farm.zoo import export_zoo

    graphs = [str(p) for p in export_zoo(root / "zoo")]
    candidates = args.candidates.split(",")
    spec = {"name": "autotune", "graphs": graphs, "targets": [{"backend": "aoti-cpu", "autotune": {"candidates": candidates}}]}
    units = len(graphs) * len(set(candidates) | {"default"})

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root / "cache-serial")}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", SERIAL, json.dumps(spec), str(root / "store-serial")],
                          check=True, env=env, cwd=REPO, capture_output=True, text=True)
    serial_s = time.perf_counter() - t0
    serial_choice = json.loads(proc.stdout.strip().splitlines()[-1])

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "cache-farm")  # inherited by the workers
    from scheduler.spec import parse_job
    from scheduler.jobs import execute
    from scheduler.ray_pool import PoolConfig, RayRunner
    from scheduler.ray_session import ray_session
    from storage import store_from_uri

    with ray_session(None, slots=args.workers):
        t0 = time.perf_counter()
        outcome = execute(parse_job(spec), store_from_uri(str(root / "store-farm")), RayRunner(PoolConfig(workers=args.workers)))
        farm_s = time.perf_counter() - t0
    failed = [(r.graph, r.target, r.error) for r in outcome.results if r.status == "failed"]
    assert not failed, failed
    farm_choice = {r.graph: r.candidate for r in outcome.results if r.target.endswith("(autotuned)")}

    print(f"compared: {units} candidate units ({len(graphs)} zoo models x {', '.join(candidates)}), both cold "
          f"(fresh store, fresh Inductor cache, one torch start-up per process)")
    print(f"serial (1 process):      {serial_s:7.1f} s   chosen: {serial_choice}")
    print(f"farm ({args.workers} Ray workers):   {farm_s:7.1f} s   chosen: {farm_choice}")
    print(f"farm_time / (serial_time / W) = {farm_s / (serial_s / args.workers):.2f}  (goal <= 1.2)")


if __name__ == "__main__":
    main()
