"""What this machine allows any W-worker farm: the serial side's units run by W plain processes at
once that take them from one queue, largest graph first, each the next as it is free (as the farm's
workers do), with no Ray, no scheduler and no worker pool of the farm's, on one machine's caches as
the farm's workers share them (one Inductor cache dir, one node dir for the precompiled headers and
the ISA probes). bench/fanout.py compares the farm with it, in the same run, against the same
serial side.

Two figures, each against that serial side:
- **the plain processes' ratio**, measured as the farm's is: serial / (W × the time until the last
  of them ended). Each pays torch's import and a process's first lowering, as a farm's cold worker
  does, and the queue's tail. A cold farm reaches it with nothing of its own beyond them: Ray's
  daemons, its scheduler and actors, its sandboxes' start.
- **the lowering's bound**: serial / (serial + what the same units' lowering took beyond the serial
  side's when W ran at once). Where W lowerings at once each take longer than one alone (the C++
  compiler and Python share the cores' caches and memory bandwidth), no scheduler wins that back;
  it counts only the lowering's loss, not the imports, the tail or the serial process's own
  parallel compiles, so it bounds a served farm best, whose workers import nothing.

Each process plans the whole job into a store of its own (the keys, a second or so) and claims a
unit by creating its file in a claims dir shared by all (O_EXCL: exactly one process wins each)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]

QUEUED = """
import json, os, sys
from scheduler.jobs import execute, run_units_in
from scheduler.kept_sandbox import warm_sandbox
from scheduler.spec import parse_job
from storage import store_from_uri

def claimed(units, store, events):
    with warm_sandbox() as sandbox:  # one child for every unit this process takes, as a worker's
        for i, unit in enumerate(sorted(units, key=lambda u: -u.compile_size)):  # the pools' order
            try:
                os.close(os.open(os.path.join(CLAIMS, str(i)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                continue  # another process took it
            yield from run_units_in(sandbox, [unit], store, events)

job = parse_job({"name": "queued", "graphs": sys.argv[2:], "targets": sys.argv[1].split(",")})
out = execute(job, store_from_uri(STORE), claimed)
bad = [r.error for r in out.results if r.status != "compiled"]
assert not bad, bad
print("TIMINGS " + json.dumps([dict(r.timings, unit=f"{r.graph.rsplit('/', 1)[-1]} {r.target}") for r in out.results]))
"""


@dataclass(frozen=True)
class Ceiling:
    walls: list[float]  # each process's wall seconds, from their common start
    units: list[int]  # how many units each took
    lower_s: float  # the units' lowering, every process's, added up

    def bound(self, serial_s: float, serial_lower_s: float) -> float:
        return serial_s / (serial_s + self.lower_s - serial_lower_s)

    def plain(self, serial_s: float) -> float:
        return serial_s / (len(self.walls) * max(self.walls))

    def line(self, serial_s: float, serial_lower_s: float) -> str:
        w = len(self.walls)
        return (f"{w} plain processes on one queue made {self.plain(serial_s):.2f} as the farm is measured "
                f"({' and '.join(f'{x:.1f} s' for x in self.walls)}, {' and '.join(map(str, self.units))} units, "
                f"each importing torch); their lowering took {self.lower_s:.1f} core-s against {serial_lower_s:.1f} "
                f"one at a time ({(self.lower_s / serial_lower_s - 1) * 100:+.0f} %): bound "
                f"{self.bound(serial_s, serial_lower_s):.2f}")


def run_at_once(root: Path, env: dict[str, str], targets: list[str], graphs: list[str], workers: int) -> Ceiling:
    """The W processes started together in `env` (its Inductor cache and node dirs already made as
    the serial side's are: probed, warmed up), each into a store of its own, each printing the
    timings of the units it took as the serial side does (TIMINGS and a JSON list). Each gets the
    OpenMP threads Ray gives the farm's 1-CPU workers (OMP_NUM_THREADS=1): with the machine's
    default (every core) the units' checks and benchmarks, run beside the other process's g++,
    took 1-3 s each where the farm's took 0.1 (2026-12-07), a cost that is the bench's, not the
    machine's."""
    env = {**env, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS") or "1"}
    claims = root / "claims"
    claims.mkdir(parents=True)
    began = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", QUEUED.replace("STORE", repr(str(root / f"store-{i}")))
                               .replace("CLAIMS", repr(str(claims))), ",".join(targets), *graphs],
                              env=env, cwd=PROJECT, stdout=subprocess.PIPE, text=True)
             for i in range(workers)]
    walls: dict[int, float] = {}
    outs: dict[int, str] = {}
    while len(walls) < len(procs):  # (each prints one line at its end: no pipe fills meanwhile)
        for i, p in enumerate(procs):
            if i not in walls and p.poll() is not None:
                walls[i], outs[i] = time.perf_counter() - began, p.stdout.read()
                if p.returncode != 0 or "TIMINGS " not in outs[i]:
                    raise SystemExit(f"a process of the parallel ceiling failed ({p.returncode})")
        time.sleep(0.05)
    taken = [printed_timings(outs[i]) for i in range(len(procs))]
    if sum(map(len, taken)) != len(targets) * len(graphs):
        raise SystemExit(f"the parallel ceiling's processes ran {sum(map(len, taken))} units, not "
                         f"{len(targets) * len(graphs)}")
    return Ceiling([walls[i] for i in range(len(procs))], [len(t) for t in taken], sum(map(lowered_s, taken)))


def printed_timings(stdout: str) -> list[dict]:
    """The units' timings a serial process printed (bench/fanout.py's SERIAL: TIMINGS and a JSON list)."""
    return json.loads(stdout.split("TIMINGS ", 1)[1])


def lowered_s(unit_timings: list[dict]) -> float:
    """The units' lowering, added up."""
    return sum(t.get("lower", 0.0) for t in unit_timings)
