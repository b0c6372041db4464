"""Fan-out efficiency: the zoo compiled serially in one process vs. through the farm on W Ray
workers, in one run. Each side starts cold: a fresh store and a fresh Inductor cache of its own
and a fresh node dir (FARM_NODE_CACHE: each side builds its precompiled headers and asks the
host's ISA probes), and pays
one torch start-up per sandbox (the serial
process's, and each worker's: the processes around them import no torch). Ray's own start is
not counted: a farm's cluster is already up. Its node found out which ISAs it offers (Inductor's
probe builds, in the farm's cache) as it started; the serial side is timed twice, once making
those probes in its window (the headline figure, as this bench has always measured it) and once
with them made before its clock starts (like for like).

`--service` also runs the job on a farm service that has served one job (small MLPs of its own),
against a serial process whose cache holds what the same warm-up job left (probes, headers).

`--ceiling` also times, each trial, the like-for-like serial side's units run by W plain processes
at once from one queue (bench/parallel_ceiling.py): what this machine allows a W-worker farm with
nothing of its own (their ratio, measured as the farm's), what W lowerings at once cost it (the
lowering's bound), and the farm's ratio over each.

    .venv/bin/python bench/fanout.py [--workers 2] [--isa avx2 --isa x86-64] [--units] [--service] [--ceiling]
                                     [--trials 3]

Prints serial_time / (W × farm_time); the goal is ≥ 0.95 for W=2 and ≥ 8 units. Then where each
side's core-seconds went, phase by phase, and what the farm paid beyond the serial side, and the
C++ compiler's share: the same compiles on both sides, AOTInductor's wrapper (about 4.5 s of cc1plus
each) most of a unit's lowering, and each slower when two run at once on 2 cores. Then
the like-for-like ratios again, `--trials` times in all (each pair fresh), and their median: on
2 cores one run's ratio varied from 0.87 to 0.99 on the served service (2026-11-27).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

PROJECT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT))

from bench.machine import busy_core_seconds, process_core_seconds  # noqa: E402  (the repo's root is on sys.path now)
from bench.parallel_ceiling import Ceiling, lowered_s, printed_timings, run_at_once  # noqa: E402
from bench.suite_cpu import Sampler, kind  # noqa: E402

COMPILES: dict[str, tuple[float, int]] = {}  # a side's window → the C++ compiler's core-seconds and runs in it

SERIAL = """
import json, sys
from scheduler.spec import parse_job
from scheduler.jobs import execute
from storage import store_from_uri
job = parse_job({"name": "serial", "graphs": sys.argv[2:], "targets": sys.argv[1].split(",")})
out = execute(job, store_from_uri(STORE))
bad = [r.error for r in out.results if r.status != "compiled"]
assert not bad, bad
print("TIMINGS " + json.dumps([dict(r.timings, unit=f"{r.graph.rsplit('/', 1)[-1]} {r.target}") for r in out.results]))
"""
PHASES = ("fetch", "load", "lower", "verify", "benchmark", "upload")


def _split(label: str, wall_s: float, slots: int, timings: list[dict[str, float]]) -> dict[str, float]:
    """Where one side's core-seconds went: the units' phases, and what was outside any unit
    (process and actor start, torch imports, sandbox starts, planning, idle slots)."""
    inside = sum(t.get("total", 0.0) for t in timings)
    parts = {p: sum(t.get(p, 0.0) for t in timings) for p in PHASES}
    parts["other in units"] = inside - sum(parts.values())
    parts["outside units"] = slots * wall_s - inside
    print(f"{label:<22}" + "".join(f"{parts[k]:9.1f}" for k in (*PHASES, "other in units", "outside units"))
          + f"{slots * wall_s:9.1f}")
    return parts


def _per_unit(label: str, timings: list[dict]) -> None:
    print(f"{label}, unit by unit (seconds):")
    for t in timings:
        print(f"  {t['unit']:<34}" + "".join(f"{t.get(p, 0.0):9.1f}" for p in (*PHASES, "total"))
              + f"  {t.get('worker', '')}")


def _probe_host(env: dict[str, str]) -> None:
    """The host's ISA probes made in a side's Inductor cache dir and its answer kept in its node dir
    (env's), as a node makes them when its cluster starts (in a fresh process: this one keeps the
    first answer it got, for another dir)."""
    subprocess.run([sys.executable, "-c", "from workers.backends import offered_resources; offered_resources(1)"],
                   check=True, env=env, cwd=PROJECT)


def _serial(root: Path, targets: list[str], graphs: list[str], probed: bool,
            warm_up: list[str] | None = None) -> tuple[float, float, list[dict]]:
    """One fresh process compiling every unit in turn, in its own store and Inductor cache
    (`_prepared`): its wall seconds, the machine's busy core-seconds, the units' timings."""
    env = _prepared(root, targets, probed, warm_up)
    t0, cpu0 = time.perf_counter(), busy_core_seconds()
    with _compiles(root.name):
        done = subprocess.run([sys.executable, "-c", _serial_code(str(root / "store")), ",".join(targets), *graphs],
                              check=True, env=env, cwd=PROJECT, stdout=subprocess.PIPE, text=True)
    return time.perf_counter() - t0, busy_core_seconds() - cpu0, printed_timings(done.stdout)


def _ceiling(root: Path, targets: list[str], graphs: list[str], workers: int,
             warm_up: list[str] | None = None) -> Ceiling:
    """The serial side's units run by W plain processes at once from one queue, on one machine's
    caches prepared as the like-for-like serial side's (bench/parallel_ceiling.py)."""
    env = _prepared(root, targets, True, warm_up)
    return run_at_once(root, env, targets, graphs, workers)


def _prepared(root: Path, targets: list[str], probed: bool, warm_up: list[str] | None) -> dict[str, str]:
    """A serial side's environment: an Inductor cache and node dir of its own. With `probed`, the
    host's ISA probes are in that cache before the clock starts, as the farm's node made them in
    its own when its cluster started (like for like); without, the serial side makes them in its
    window, as this bench has always measured it. With `warm_up`, a job of those graphs ran in
    that cache first (in another process, its own store), as on the served service."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root / "cache"), "FARM_NODE_CACHE": str(root / "node")}
    if probed:
        _probe_host(env)
    if warm_up:
        subprocess.run([sys.executable, "-c", _serial_code(str(root / "store-warm-up")), ",".join(targets), *warm_up],
                       check=True, env=env, cwd=PROJECT, stdout=subprocess.DEVNULL)
    return env


def _serial_code(store: str) -> str:
    return SERIAL.replace("STORE", repr(store))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--isa", action="append", default=None)
    ap.add_argument("--units", action="store_true", help="also print each unit's phases, and its worker")
    ap.add_argument("--trials", type=int, default=3,
                    help="runs of each like-for-like pair (the first one detailed); every ratio and the median")
    ap.add_argument("--service", action="store_true",
                    help="also the same job on a farm service that has already served one job (bench/shared.py's MLPs)")
    ap.add_argument("--ceiling", action="store_true",
                    help="also, each trial, the serial side's units shared out between W plain processes at once: "
                         "what this machine allows any W-worker farm (bench/parallel_ceiling.py)")
    args = ap.parse_args()
    isas = args.isa or ["avx2", "x86-64"]
    targets = [f"aoti-cpu:{i}" for i in isas]
    from bench.scratch import scratch_dir

    root = scratch_dir("farm-bench-")
    from farm.zoo import export_zoo

    graphs = [str(p) for p in export_zoo(root / "zoo")]
    units = len(graphs) * len(targets)

    serial_s, serial_cpu, serial_timings = _serial(root / "serial", targets, graphs, probed=False)
    probed_s, _, probed_timings = _serial(root / "serial-probed", targets, graphs, probed=True)

    farm_s, farm_cpu, outcome, runner, around = _farm(root / "farm", graphs, targets, args.workers)

    efficiency = serial_s / (args.workers * farm_s)
    print(f"compared: {units} units ({len(graphs)} zoo models x {', '.join(targets)}), all cold (fresh store, "
          f"fresh Inductor cache each; one torch start-up per sandbox, the only processes that import torch)")
    print(f"serial (1 process):                {serial_s:7.1f} s  (its own ISA probes in its window)")
    print(f"serial (1 process), host probed:   {probed_s:7.1f} s  (its ISA probes made before, as the farm's node's were)")
    print(f"farm ({args.workers} Ray workers):             {farm_s:7.1f} s  (its node probed the host as its cluster started)")
    print(f"efficiency serial/(W x farm) = {efficiency:.2f}  (goal >= 0.95)")
    print(f"like for like, host probed on both sides: {probed_s / (args.workers * farm_s):.2f}")
    print(f"the machine was busy {serial_cpu:.1f} core-seconds (every process's) during the serial side's "
          f"{serial_s:.1f} s: {serial_cpu / serial_s:.2f} of its {os.cpu_count()} cores on average; during the "
          f"farm's {farm_s:.1f} s, {farm_cpu:.1f} ({farm_cpu / farm_s:.2f} cores, Ray's own processes included)")
    print(f"of which Ray's own processes (raylet, GCS, dashboard, agents, log monitor) and this driver: {around:.1f} "
          f"core-seconds, beside the workers' units")
    busy: dict[str, float] = {}
    for r in outcome.results:
        busy[r.worker or "?"] = busy.get(r.worker or "?", 0.0) + r.timings.get("total", 0.0)
    print(f"farm: {sum(s.generation for s in runner.slots)} worker actors started for {len(runner.slots)} slots; "
          f"busy {', '.join(f'{b:.1f}' for b in busy.values())} s of {farm_s:.1f} s ({len(busy)} worker processes)")
    farm_timings = [dict(r.timings, unit=f"{r.graph.rsplit('/', 1)[-1]} {r.target}", worker=r.worker or "?")
                    for r in outcome.results]
    _compiler_cache("farm", outcome.results)
    if args.units:
        _per_unit("serial", serial_timings)
        _per_unit("serial, host probed", probed_timings)
        _per_unit("farm", farm_timings)
    print("core-seconds by phase (serial: 1 slot; farm: W slots x its wall time):")
    print(f"{'':<22}" + "".join(f"{k[:8]:>9}" for k in (*PHASES, "other", "outside", "total")))
    _split("serial", serial_s, 1, serial_timings)
    probed = _split("serial, host probed", probed_s, 1, probed_timings)
    farm = _split(f"farm ({args.workers} workers)", farm_s, args.workers, farm_timings)
    print(f"{'farm - serial probed':<22}" + "".join(f"{farm[k] - probed[k]:9.1f}" for k in probed)
          + f"{args.workers * farm_s - probed_s:9.1f}")
    _compiler_time("cold", "serial-probed", "farm")
    ceilings: dict[str, list[tuple[float, float]]] = {"cold": [], "served": []}
    if args.ceiling:
        _say_ceiling("cold", _ceiling(root / "ceiling", targets, graphs, args.workers), probed_s, probed_timings,
                     probed_s / (args.workers * farm_s), ceilings["cold"])
    if args.service:
        warm_graphs = _warm_up_graphs(root, args.workers)
        warmed_s, _, warmed_timings = _serial(root / "serial-warmed", targets, graphs, probed=True, warm_up=warm_graphs)
        service_s, service_results = _on_a_served_service(root, graphs, targets, warm_graphs, args.workers)
        service_timings = [dict(r.timings, unit=f"{r.graph.rsplit('/', 1)[-1]} {r.target}", worker=r.worker or "?")
                           for r in service_results]
        if args.units:
            _per_unit("serial, after the warm-up job", warmed_timings)
            _per_unit("farm service", service_timings)
        _compiler_cache("farm service", service_results)
        warmed = _split("serial, warmed", warmed_s, 1, warmed_timings)
        service = _split(f"service ({args.workers} workers)", service_s, args.workers, service_timings)
        print(f"{'service - serial warmed':<22}" + "".join(f"{service[k] - warmed[k]:9.1f}" for k in warmed)
              + f"{args.workers * service_s - warmed_s:9.1f}")
        _compiler_time("on the served service", "serial-warmed", f"{root.name}-service")
        print(f"farm service ({args.workers} workers), after one other job: {service_s:7.1f} s  "
              f"(fresh store and Inductor cache, its warm-up job's compiles in it: the precompiled headers and ISA "
              f"probes were built there; the like-for-like serial side is the one after the same warm-up job)")
        print(f"serial (1 process), after the same warm-up job: {warmed_s:7.1f} s  (host probed, and the warm-up "
              f"job's precompiled headers in its cache before its clock starts; its torch start-up still in its "
              f"window)")
        served_first = [warmed_s / (args.workers * service_s)]
        print(f"efficiency on the served service serial/(W x farm) = {serial_s / (args.workers * service_s):.2f}; "
              f"against the host-probed serial {probed_s / (args.workers * service_s):.2f}; like for like, against "
              f"the serial side after the same warm-up job, {warmed_s / (args.workers * service_s):.2f}  "
              f"(goal >= 0.95)")
        if args.ceiling:
            _say_ceiling("on the served service", _ceiling(root / "ceiling-warmed", targets, graphs, args.workers,
                                                           warm_up=warm_graphs),
                         warmed_s, warmed_timings, served_first[0], ceilings["served"])
    _more_trials(args, root, graphs, targets, [probed_s / (args.workers * farm_s)],
                 served_first if args.service else [], ceilings)


def _say_ceiling(label: str, ceiling: Ceiling, serial_s: float, serial_timings: list[dict], farm_ratio: float,
                 kept: list[tuple[float, float]]) -> None:
    """The machine's own figures beside the farm's like-for-like ratio, all against one serial side."""
    serial_lower_s = lowered_s(serial_timings)
    plain, bound = ceiling.plain(serial_s), ceiling.bound(serial_s, serial_lower_s)
    kept.append((plain, bound))
    print(f"this machine, {label}: {ceiling.line(serial_s, serial_lower_s)}; the farm's like for like, "
          f"{farm_ratio:.2f}, is {farm_ratio / plain:.2f} of the plain processes' and {farm_ratio / bound:.2f} of the "
          f"bound", flush=True)


@contextlib.contextmanager
def _compiles(window: str) -> Iterator[None]:
    """Every C++ compile (cc1plus) run in the block, jailed or not, into COMPILES[window]: read
    every 0.2 s, so a run shorter than that is missed (both figures are lower bounds); the reads
    cost both sides alike, a little of one core."""
    with Sampler(0.2) as sampler:
        yield
    spent = [e["user"] + e["sys"] - e["user0"] - e["sys0"] for e in sampler.seen.values()
             if kind(e, sampler.seen) == "C++ compiler"]
    COMPILES[window] = (sum(spent), sum(1 for c in spent if c > 0))


def _compiler_time(label: str, serial: str, farm: str) -> None:
    """The C++ compiler's work on both sides: the same compiles, and what each cost; on 2 cores
    two at once (the farm's W=2) take longer each than one at a time (the serial side's)."""
    (s_cpu, s_runs), (f_cpu, f_runs) = COMPILES[serial], COMPILES[farm]
    print(f"the C++ compiler (cc1plus, lower bounds), {label}: serial {s_cpu:.1f} core-s in {s_runs} runs, farm "
          f"{f_cpu:.1f} in {f_runs} ({(f_cpu / max(s_cpu, 1e-9) - 1) * 100:+.0f} %; per run {s_cpu / max(s_runs, 1):.2f} vs "
          f"{f_cpu / max(f_runs, 1):.2f} s)")


def _compiler_cache(side: str, results: list[Any]) -> None:
    """What the node's compiler cache served the farm side. Each side has a fresh one (in its
    FARM_NODE_CACHE) and every unit's code differs, so it should serve nothing: like for like."""
    hits = sum(r.metrics.get("compiler_cache_hits", 0) for r in results)
    compiles = hits + sum(r.metrics.get("compiler_cache_misses", 0) for r in results)
    print(f"{side}: the node's compiler cache served {hits:.0f} of {compiles:.0f} cacheable C++ compiles "
          f"(each side starts with an empty one)")


def _farm(root: Path, graphs: list[str], targets: list[str], workers: int) -> tuple[float, float, Any, Any, float]:
    """The job on W long-lived workers of an embedded Ray (its start-up not counted), in a fresh
    store and Inductor cache: wall seconds, busy core-seconds, the outcome, the runner, and the
    core-seconds of the processes alive from its start to its end (Ray's daemons, this driver:
    not the job's workers, which start and stop with it)."""
    from scheduler.jobs import execute
    from scheduler.ray_pool import PoolConfig, RayRunner
    from scheduler.ray_session import ray_session
    from scheduler.spec import parse_job
    from storage import store_from_uri

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "cache")  # inherited by the workers
    os.environ["FARM_NODE_CACHE"] = str(root / "node")
    _probe_host(dict(os.environ))  # (a second Ray session of this process would not: see _probe_host)
    job = parse_job({"name": "fanout", "graphs": graphs, "targets": targets})
    with ray_session(None, slots=workers):
        t0, cpu0, before = time.perf_counter(), busy_core_seconds(), process_core_seconds()
        runner = RayRunner(PoolConfig(workers=workers))
        with _compiles(root.name):
            outcome = execute(job, store_from_uri(str(root / "store")), runner)
        wall_s, cpu_s, after = time.perf_counter() - t0, busy_core_seconds() - cpu0, process_core_seconds()
    bad = [r.error for r in outcome.results if r.status != "compiled"]
    assert not bad, bad
    return wall_s, cpu_s, outcome, runner, sum(after[p] - before[p] for p in before.keys() & after.keys())


def _more_trials(args: argparse.Namespace, root: Path, graphs: list[str], targets: list[str],
                 first: list[float], first_served: list[float], ceilings: dict[str, list[tuple[float, float]]]) -> None:
    """Trials 2..N of the like-for-like ratios (cold; served with --service), each side fresh, in
    turn; every ratio and their median (one run's figure varies by 0.05 or more on 2 cores); with
    --ceiling, the machine's own (bench/parallel_ceiling.py) beside each."""
    cold, served = list(first), list(first_served)
    for trial in range(2, args.trials + 1):
        probed_s, _, probed_timings = _serial(root / f"serial-probed-{trial}", targets, graphs, probed=True)
        farm_s = _farm(root / f"farm-{trial}", graphs, targets, args.workers)[0]
        cold.append(probed_s / (args.workers * farm_s))
        print(f"trial {trial}: serial, host probed {probed_s:.1f} s, farm {farm_s:.1f} s", flush=True)
        _compiler_time(f"trial {trial}, cold", f"serial-probed-{trial}", f"farm-{trial}")
        if args.ceiling:
            _say_ceiling(f"cold, trial {trial}", _ceiling(root / f"ceiling-{trial}", targets, graphs, args.workers),
                         probed_s, probed_timings, cold[-1], ceilings["cold"])
        if args.service:
            warm_graphs = _warm_up_graphs(root / f"warm-{trial}", args.workers)
            warmed_s, _, warmed_timings = _serial(root / f"serial-warmed-{trial}", targets, graphs, probed=True,
                                                  warm_up=warm_graphs)
            service_s = _on_a_served_service(root / f"served-{trial}", graphs, targets, warm_graphs, args.workers)[0]
            served.append(warmed_s / (args.workers * service_s))
            print(f"trial {trial}: serial after the warm-up job {warmed_s:.1f} s, served service {service_s:.1f} s",
                  flush=True)
            _compiler_time(f"trial {trial}, served", f"serial-warmed-{trial}", f"served-{trial}-service")
            if args.ceiling:
                _say_ceiling(f"on the served service, trial {trial}",
                             _ceiling(root / f"ceiling-warmed-{trial}", targets, graphs, args.workers,
                                      warm_up=warm_graphs), warmed_s, warmed_timings, served[-1], ceilings["served"])
    for label, ratios, goal, ceiling in (("cold, host probed on both sides", cold, 0.90, ceilings["cold"]),
                                         ("on the served service", served, 0.95, ceilings["served"])):
        if ratios:
            print(f"like for like {label}, {len(ratios)} trials: {', '.join(f'{r:.2f}' for r in ratios)}; "
                  f"median {statistics.median(ratios):.2f}  (goal >= {goal})")
        for i, name in enumerate((f"{args.workers} plain processes on one queue", "the lowering's bound")):
            if ratios and ceiling:
                own = [c[i] for c in ceiling]
                print(f"  {name} (bench/parallel_ceiling.py), the same trials: {', '.join(f'{c:.2f}' for c in own)}; "
                      f"median {statistics.median(own):.2f}; the farm's ratio over it: "
                      f"{', '.join(f'{r / c:.2f}' for r, c in zip(ratios, own))}")


def _warm_up_graphs(root: Path, workers: int) -> list[str]:
    """The job a served service served first: W small MLPs of their own (bench/shared.py's)."""
    from bench.shared import export_graphs

    warm = root / "warm-graphs"
    warm.mkdir(parents=True)
    return [str(g) for g in export_graphs(warm, "warm", [64 + i for i in range(workers)])]


def _on_a_served_service(root: Path, graphs: list[str], targets: list[str], warm_graphs: list[str],
                         workers: int) -> tuple[float, list]:
    """The job on a farm service (a fresh embedded Ray, store and Inductor cache) whose workers
    have already served one job: `warm_graphs`, for the same targets."""
    from farm.client import JobHandle
    from farm.service_client import Service
    from scheduler.ray_service import call, find_service, start_service, stop_service
    from scheduler.ray_session import ray_session
    from scheduler.service_config import ServiceConfig

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "cache-service")
    os.environ["FARM_NODE_CACHE"] = str(root / "node-service")
    with ray_session(None, slots=workers):
        start_service(str(root / "store-service"), ServiceConfig(min_workers=workers))
        service = Service(find_service(), call(find_service(), "ping"))
        try:
            def run(spec: dict) -> tuple[float, list]:
                t0 = time.perf_counter()
                handle = JobHandle(service.submit(spec), service.store())
                handle.wait(every=0.1)
                bad = [r.error for r in handle.outcome.results if r.status != "compiled"]
                assert not bad, bad
                return time.perf_counter() - t0, handle.outcome.results

            run({"name": "warm-up", "graphs": warm_graphs, "targets": targets})
            with _compiles(f"{root.name}-service"):
                return run({"name": "fanout", "graphs": graphs, "targets": targets})
        finally:
            stop_service()


if __name__ == "__main__":
    main()
