"""Chaos soak: overlapping jobs on an embedded Ray while workers are SIGKILLed at random and the
S3 store misbehaves.

Three jobs of --graphs units each (the same tiny programs, so they race for the same keys)
start a few seconds apart against a real S3 server (SeaweedFS) behind a fault proxy that
resets, cuts, fails (500/503) or stalls --fault-rate of requests for the first --fault-s
seconds. A killer SIGKILLs a busy worker every 6-18 s while the jobs run. It prints units,
kills, retries, and the four figures whose goal is 0: duplicate compiles beyond lease
takeovers, leaked leases, orphaned temp dirs, units without exactly one result.

    .venv/bin/python bench/chaos.py [--graphs 20] [--fault-rate 0.05] [--fault-s 60] [--seed 1]
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scratch import scratch_dir  # noqa: E402  (the repo's root is on sys.path now)

TARGET = "aoti-cpu"


def export_graphs(out: Path, n: int) -> list[str]:
    """n tiny MLPs of different widths: n different keys that compile in seconds."""
    import torch
    from torch.export import Dim

    paths = []
    for i in range(n):
        torch.manual_seed(i)
        model = torch.nn.Sequential(torch.nn.Linear(16, 8 + i), torch.nn.ReLU(), torch.nn.Linear(8 + i, 4))
        ep = torch.export.export(model, (torch.randn(4, 16),), dynamic_shapes=({0: Dim("batch", min=2, max=64)},))
        path = out / f"mlp{8 + i}.pt2"
        torch.export.save(ep, str(path))
        paths.append(str(path))
    return paths


def farm_dirs() -> set[Path]:
    from workers.sandbox.tempdirs import _OWNED

    return {p for p in Path(tempfile.gettempdir()).glob("farm-*") if _OWNED.match(p.name) and p.is_dir()}


class Killer(threading.Thread):
    """SIGKILLs the worker of a random running unit every 6-18 s until stopped."""

    def __init__(self, runners, rng: random.Random):
        super().__init__(daemon=True)
        self.runners, self.rng, self.kills, self.stop = runners, rng, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.rng.uniform(6, 18)):
            busy = {}
            for runner in self.runners:
                try:
                    busy.update(runner.busy_workers())
                except Exception as e:  # a worker died between listing and asking: nothing to kill this round
                    print(f"  (killer skipped a round: {type(e).__name__})")
            if busy:
                unit, pid = self.rng.choice(sorted(busy.items()))
                try:
                    os.kill(pid, signal.SIGKILL)
                    self.kills += 1
                    print(f"  killed worker pid {pid} compiling {unit}")
                except ProcessLookupError:
                    pass  # it finished and exited meanwhile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--graphs", type=int, default=20)
    ap.add_argument("--jobs", type=int, default=3)
    ap.add_argument("--fault-rate", type=float, default=0.05)
    ap.add_argument("--fault-s", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ.setdefault("RAY_AUTH_TOKEN", os.urandom(16).hex())

    from scheduler.jobs import execute
    from scheduler.ray_pool import PoolConfig, RayRunner
    from scheduler.ray_session import ray_session
    from scheduler.spec import parse_job
    from storage import store_from_uri
    from tests.faulty_proxy import FaultyProxy
    from tests.seaweed import start_seaweed

    work = scratch_dir("chaos-")
    graphs = export_graphs(work, args.graphs)
    server = start_seaweed(work / "weed")
    server.create_bucket("chaos")
    upstream = urlparse(server.endpoint)
    rng = random.Random(args.seed)
    before = farm_dirs()
    with FaultyProxy((upstream.hostname, upstream.port), rate=args.fault_rate, seed=args.seed) as proxy:
        os.environ.update({**server.env(), "AWS_ENDPOINT_URL": proxy.endpoint})  # workers inherit it from Ray
        uri = "s3://chaos/store"
        spec = {"graphs": graphs, "targets": [TARGET], "limits": {"lease_s": 10, "retries": 3, "workers": 1}}
        runners = [RayRunner(PoolConfig(workers=1, retries=3), job_id=f"chaos-{j}") for j in range(args.jobs)]
        outcomes: dict[int, object] = {}
        failures: dict[int, BaseException] = {}

        def job(j: int) -> None:
            time.sleep(4 * j)  # overlapping, not simultaneous
            try:
                outcomes[j] = execute(parse_job({**spec, "name": f"chaos-{j}"}), store_from_uri(uri), runners[j])
            except BaseException as e:  # reported below: a job that crashed is the worst outcome of all
                failures[j] = e

        start = time.monotonic()
        with ray_session(None, slots=args.jobs):
            killer = Killer(runners, rng)
            threads = [threading.Thread(target=job, args=(j,)) for j in range(args.jobs)]
            [t.start() for t in threads]
            killer.start()
            while any(t.is_alive() for t in threads):
                if proxy.rate and time.monotonic() - start > args.fault_s:
                    proxy.rate = 0.0
                    print(f"  S3 faults off after {args.fault_s:g}s")
                time.sleep(1)
            killer.stop.set()
        wall = time.monotonic() - start
        faults = sum(n for k, n in proxy.counts.items() if k != "requests")
        requests = proxy.counts["requests"]

    os.environ["AWS_ENDPOINT_URL"] = server.endpoint  # the proxy is gone: read back directly
    store = store_from_uri(uri)
    results = [r for o in outcomes.values() for r in o.results]
    compiled = collections.defaultdict(list)
    for r in results:
        if r.status == "compiled":
            compiled[r.key].append(r)
    takeovers = duplicates = 0
    for key, rows in compiled.items():
        took_over = sum("took over the lease" in store.get_bytes(r.log.digest).decode(errors="replace")
                        for r in rows if r.log)
        takeovers += took_over
        duplicates += max(0, len(rows) - 1 - took_over)
    leaked = list(store.backend.list("leases/"))
    orphaned = sorted(farm_dirs() - before)
    per_job = [collections.Counter(f"{r.graph}@{r.target}" for r in o.results) for o in outcomes.values()]
    expected = {f"{Path(g).stem}@{TARGET}" for g in graphs}
    not_one = sum(sum(c[u] != 1 for u in expected) + sum(u not in expected for u in c) for c in per_job)
    not_one += len(expected) * len(failures)
    server.stop()

    print(f"\nchaos soak: {args.jobs} overlapping jobs x {args.graphs} units on an embedded Ray, {wall:.0f}s, "
          f"{os.cpu_count()} cores")
    print(f"units:                          {len(results)} ({collections.Counter(r.status for r in results)})")
    print(f"kills (SIGKILL, busy workers):  {killer.kills}")
    print(f"retries:                        {sum(r.retries for r in results)}")
    print(f"S3 requests / faults injected:  {requests} / {faults} ({dict(proxy.counts)}), for the first {args.fault_s:g}s")
    print(f"lease takeovers:                {takeovers}")
    print(f"duplicate compiles beyond lease takeovers: {duplicates}   (goal 0)")
    print(f"leaked leases:                  {len(leaked)}   (goal 0) {leaked[:5]}")
    print(f"orphaned temp dirs:             {len(orphaned)}   (goal 0) {[str(p) for p in orphaned[:5]]}")
    print(f"units without exactly one result: {not_one}   (goal 0)")
    for j, e in failures.items():
        print(f"job chaos-{j} crashed: {type(e).__name__}: {e}")
    failed = [r for r in results if r.status == "failed"]
    for r in failed[:10]:
        print(f"failed: {r.graph}: {r.error[:300]}")


if __name__ == "__main__":
    main()
