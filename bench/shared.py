"""A farm shared by a team: does a person's one-graph job wait behind the nightly?

On one Ray cluster (a `ray start` head listening on loopback alone, scheduler/ray_loopback.py,
offering `farm resources`) with a farm service (`farm serve`), every unit cold (each graph a
small MLP of its own width, so no key and no Inductor cache entry repeats):

1. an interactive 1-unit job alone;
2. for each nightly size N: a nightly of N `aoti-cpu` units alone; then another nightly of N
   (other graphs), and, once its first units run, an interactive 1-unit job.

Prints interactive_during / interactive_alone for each N (goal: at most 1.5), the 64-unit case
against the 16-unit one (goal: within 1.2), and each nightly's time with the interactive job
against without it (goal: at most +10 %). The service's workers are started and warm before the
first measurement (a warm-up job), as on a farm that serves all day. The smallest nightly's pair
(alone, and with the interactive job) runs `--trials` times, each on graphs of its own, the
order swapped every other trial (one run's nightlies got faster as it went on), and
every trial's figures are printed with their median: one interactive unit is the largest share
of that nightly, and its time alone varied from 38.7 to 42.9 s between runs (2026-11-27), which
moved a single sample's +% from +6 to +15. With each nightly size it prints the floor under that
+%: the core-seconds the whole machine was busy for the interactive job alone against those of
the nightly alone. A nightly that keeps every core busy gives up at least that much to it.

Then a hit through the service: the whole `farm submit` process of an all-hit job, handed over
through the store's inbox, the store named (`--store`: no Ray in the client) and found from the
cluster (`--address`: the service's store read from Ray's KV over gRPC, no Ray imported; then
remembered on this machine, the cluster not asked), each against `python -c 'import torch'` (goal: at
most 0.6).

    .venv/bin/python bench/shared.py [--nightly 16 --nightly 64] [--workers 2] [--trials 3] [--hit-only]
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import busy_core_seconds, free_port  # noqa: E402  (the repo's root is on sys.path now)
from bench.scratch import scratch_dir  # noqa: E402
from bench.trials import in_turn  # noqa: E402


def export_graphs(dest: Path, prefix: str, widths: list[int]) -> list[Path]:
    import torch

    class MLP(torch.nn.Module):
        def __init__(self, width: int):
            super().__init__()
            self.a, self.b = torch.nn.Linear(32, width), torch.nn.Linear(width, 8)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    paths = []
    for w in widths:
        path = dest / f"{prefix}-{w}.pt2"
        torch.export.save(torch.export.export(MLP(w), (torch.randn(4, 32),)), path)
        paths.append(path)
    return paths


def job(name: str, graphs: list[Path], priority: str) -> dict:
    return {"name": name, "priority": priority, "graphs": [str(g) for g in graphs], "targets": ["aoti-cpu"],
            "benchmark": {"warmup": 1, "repeat": 3}}


def timed(spec: dict, address: str) -> float:
    from farm import client

    start = time.perf_counter()
    handle = client.submit(spec, address=address, wait=False)
    handle.wait(every=0.2)
    failed = [r.error for r in handle.outcome.results if r.status not in ("compiled", "hit")]
    assert not failed, failed
    return time.perf_counter() - start


def busy_timed(spec: dict, address: str) -> tuple[float, float]:
    """timed(), and the core-seconds the machine was busy meanwhile (every process's, Ray's too)."""
    cpu0 = busy_core_seconds()
    return timed(spec, address), busy_core_seconds() - cpu0


def during(nightly: dict, interactive: dict, address: str) -> tuple[float, float]:
    """The nightly's time, and the interactive job's, submitted once the nightly's units run."""
    from farm import client

    start = time.perf_counter()
    handle = client.submit(nightly, address=address, wait=False)
    while handle.status().get("running", 0) == 0 and not handle.done():
        time.sleep(0.2)
    alone = timed(interactive, address)
    handle.wait(every=0.2)
    return time.perf_counter() - start, alone


def nightly_pairs(n: int, trials: list[tuple[list[Path], list[Path], Path]], alone: tuple[float, float],
                  address: str) -> float:
    """Each trial: a nightly of n units alone and another with an interactive job during it
    (graphs of their own), in turn (bench/trials.py); prints each trial's +% and the interactive
    job's ratio to its time alone (`alone`: seconds, busy core-seconds), and with more than one
    trial their medians; then the floor under the +%: the interactive job's own core-seconds
    against the nightly's, which a nightly that keeps every core busy cannot avoid. Returns the
    interactive ratio (median)."""
    import statistics

    extra, ratios, busy = [], [], []
    for t, (first, second, mine) in enumerate(trials, 1):
        done = in_turn(t - 1, {"alone": partial(busy_timed, job(f"nightly{n}-{t}", first, "nightly"), address),
                               "with": partial(during, job(f"nightly{n}-{t}b", second, "nightly"),
                                               job("mine", [mine], "interactive"), address)})
        (nightly_alone, nightly_cpu), (nightly_with, during_s) = done["alone"], done["with"]
        busy.append((nightly_alone, nightly_cpu))
        extra.append(nightly_with / nightly_alone - 1)
        ratios.append(during_s / alone[0])
        label = f"nightly of {n} units" + (f", trial {t}" if len(trials) > 1 else "")
        print(f"{label}: alone {nightly_alone:.1f} s, with the interactive job {nightly_with:.1f} s "
              f"({extra[-1]:+.1%}; goal at most +10%)")
        print(f"  interactive 1-unit job during it: {during_s:.1f} s = {ratios[-1]:.2f}x alone (goal at most 1.5)",
              flush=True)
    if len(trials) > 1:
        print(f"nightly of {n} units, {len(trials)} trials: with the interactive job {statistics.median(extra):+.1%} "
              f"(median; goal at most +10%); the interactive job {statistics.median(ratios):.2f}x alone (median)")
    seconds, cpu = (statistics.median(x) for x in zip(*busy))
    print(f"  the floor under that +%: the interactive job alone kept the machine busy {alone[1]:.1f} core-s, the "
          f"nightly alone {cpu:.1f} core-s in {seconds:.1f} s ({cpu / seconds:.2f} of {os.cpu_count()} cores; medians), "
          f"so on cores the nightly keeps busy the interactive job's work alone adds about {alone[1] / cpu:+.1%} to it")
    return statistics.median(ratios)


def cli_hit(graphs: list[Path], address: str, store: Path, env: dict, tmp: Path) -> dict[str, float]:
    """The median wall time (of 5, interleaved, each in a fresh process) of `farm submit` of an
    all-hit job handed to the service with its store named (`--store`), of the same with only the
    cluster named (`--address`: on a machine that has not seen the cluster, which reads the
    service's store from Ray's KV, and on one that remembers it), and of `python -c 'import torch'`."""
    import statistics

    spec = tmp / "hit.yaml"
    spec.write_text(json.dumps(job("hit", graphs, "interactive")))
    farm = [sys.executable, "-m", "farm", "submit", str(spec)]
    known = Path(env["FARM_KNOWN_SERVICES"])  # where a client remembers each cluster's service (farm/service_client.py)
    commands = {"--store": [*farm, "--store", str(store)],
                "--address, first on this machine (the cluster's KV read)": [*farm, "--address", address],
                "--address, remembered": [*farm, "--address", address],
                "import torch": [sys.executable, "-c", "import torch"]}
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(5):
        for name, cmd in commands.items():
            if "first" in name:
                known.unlink(missing_ok=True)
            start = time.perf_counter()
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
            times[name].append(time.perf_counter() - start)
            if done.returncode != 0 or (name != "import torch" and " hit" not in done.stdout):
                raise SystemExit(f"{name}: {done.stdout[-1500:]}{done.stderr[-1500:]}")
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nightly", type=int, action="append", help="nightly sizes (default: 16 and 64)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--trials", type=int, default=3, help="pairs of the smallest nightly (alone, with); the median is shown")
    parser.add_argument("--hit-only", action="store_true", help="only the CLI hit through the service")
    args = parser.parse_args()
    sizes = [] if args.hit_only else args.nightly or [16, 64]
    tmp = scratch_dir("farm-bench-shared-")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"), "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": os.environ.get("RAY_AUTH_TOKEN") or secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0",
           "FARM_KNOWN_SERVICES": str(tmp / "known-services.json")}
    os.environ.update({k: env[k] for k in ("TORCHINDUCTOR_CACHE_DIR", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN",
                                           "FARM_KNOWN_SERVICES")})
    ray = str(Path(sys.executable).parent / "ray")
    farm = [sys.executable, "-m", "farm"]
    resources = subprocess.run([*farm, "resources", "--slots", str(args.workers)], env=env, capture_output=True,
                               text=True, check=True).stdout.strip()
    port = free_port()
    address = f"127.0.0.1:{port}"
    graphs = tmp / "graphs"
    graphs.mkdir()
    widths = iter(range(64, 100_000))
    trials = {n: args.trials if n == min(sizes) else 1 for n in sizes}
    interactive = export_graphs(graphs, "interactive", [next(widths)])  # alone; each trial gets one of its own
    nightlies = {n: [[export_graphs(graphs, f"nightly{n}-{t}-{k}", [next(widths) for _ in range(n)]) for k in range(2)]
                     + export_graphs(graphs, f"interactive{n}-{t}", [next(widths)]) for t in range(trials[n])]
                 for n in sizes}
    warm = export_graphs(graphs, "warmup", [next(widths) for _ in range(args.workers)])
    subprocess.run([sys.executable, "-m", "scheduler.ray_loopback", "start", "--head", f"--port={port}",
                    "--node-ip-address=127.0.0.1", f"--num-cpus={args.workers}",
                    f"--resources={resources}", "--include-dashboard=false", "--disable-usage-stats"],
                   env=env, check=True, capture_output=True)
    try:
        subprocess.run([*farm, "serve", "--address", address, "--store", str(tmp / "store"), "--min-workers",
                        str(args.workers)], env=env, check=True)
        print(f"warm-up ({args.workers} units, workers start): {timed(job('warmup', warm, 'batch'), address):.1f} s")
        alone = busy_timed(job("mine", interactive, "interactive"), address)
        print(f"interactive 1-unit job alone: {alone[0]:.1f} s, the machine busy {alone[1]:.1f} core-s")
        ratios = {n: nightly_pairs(n, nightlies[n], alone, address) for n in sizes}
        if len(sizes) > 1:
            big, small = max(sizes), min(sizes)
            print(f"interactive during {big} vs during {small}: {ratios[big] / ratios[small]:.2f} (goal within 1.2)")
        hit = cli_hit(interactive, address, tmp / "store", {k: v for k, v in env.items() if k != "RAY_ADDRESS"}, tmp)
        torch_s = hit.pop("import torch")
        for how, seconds in hit.items():
            print(f"a hit through the service ({how}), the whole `farm submit` process: {seconds:.2f} s (median of 5); "
                  f"`python -c 'import torch'`: {torch_s:.2f} s; ratio {seconds / torch_s:.2f} (goal at most 0.6)")
        print(json.dumps({"alone_s": alone[0], "ratios": ratios, "cli_hit_s": hit, "import_torch_s": torch_s}))
    finally:
        subprocess.run([*farm, "serve", "--address", address, "--stop"], env=env, capture_output=True)
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True)


if __name__ == "__main__":
    main()
