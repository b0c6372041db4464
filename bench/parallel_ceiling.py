"""What this machine allows any W-worker farm: the serial side's units shared out between W plain
processes running at once, with no Ray, no scheduler and no sandbox of the farm's, on one
machine's caches as the farm's workers share them (one Inductor cache dir, one node dir for the
precompiled headers and the ISA probes). bench/fanout.py compares the farm with it, in the same
run, against the same serial side.

Where W lowerings at once each take longer than one alone (the C++ compiler and Python share the
cores' caches and memory bandwidth), no scheduler can win that back; where they do not, the farm's
gap is its own. So:
- **the bound**: serial / (serial + what the same units' lowering took beyond the serial side's
  when W ran at once). A W-worker farm with nothing outside its units and a perfect split would
  reach it; it counts only the lowering's loss, not the other phases' (a few percent of a unit).
- **the plain processes' own ratio**: serial / (their walls added up), each paying torch's import
  and a process's first lowering, as a farm's cold workers do and a served one's do not.

The split: by target where the targets share out evenly between the W processes (the zoo's two
ISAs on W=2: each process builds one ISA's headers, as each farm worker's first unit does),
otherwise by graph, in turn."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

PROJECT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Ceiling:
    walls: list[float]  # each process's wall seconds, in the order of the split
    shares: list[str]  # what each process compiled
    lower_s: float  # the units' lowering, every process's, added up

    def bound(self, serial_s: float, serial_lower_s: float) -> float:
        return serial_s / (serial_s + self.lower_s - serial_lower_s)

    def plain(self, serial_s: float) -> float:
        return serial_s / sum(self.walls)

    def line(self, serial_s: float, serial_lower_s: float) -> str:
        w = len(self.walls)
        return (f"at most {self.bound(serial_s, serial_lower_s):.2f}: the same units lowered in {self.lower_s:.1f} "
                f"core-s by {w} plain processes at once against {serial_lower_s:.1f} one at a time "
                f"({(self.lower_s / serial_lower_s - 1) * 100:+.0f} %; {'; '.join(self.shares)}); those processes "
                f"themselves made {self.plain(serial_s):.2f} ({' + '.join(f'{x:.1f}' for x in self.walls)} s, "
                f"each importing torch)")


def shares(targets: list[str], graphs: list[str], workers: int) -> list[tuple[list[str], list[str]]]:
    """(targets, graphs) for each of the W processes."""
    if len(targets) % workers == 0:
        per = len(targets) // workers
        return [(targets[i * per:(i + 1) * per], graphs) for i in range(workers)]
    return [(targets, graphs[i::workers]) for i in range(workers) if graphs[i::workers]]


def run_at_once(root: Path, env: dict[str, str], code_for_store: Callable[[str], str], targets: list[str],
                graphs: list[str], workers: int) -> Ceiling:
    """The W processes started together in `env` (its Inductor cache and node dirs already made as
    the serial side's are: probed, warmed up), each into a store of its own, each printing its
    units' timings as the serial side does (TIMINGS and a JSON list)."""
    split = shares(targets, graphs, workers)
    began = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", code_for_store(str(root / f"store-{i}")), ",".join(t), *g],
                              env=env, cwd=PROJECT, stdout=subprocess.PIPE, text=True)
             for i, (t, g) in enumerate(split)]
    walls: dict[int, float] = {}
    outs: dict[int, str] = {}
    while len(walls) < len(procs):  # (each prints one line at its end: no pipe fills meanwhile)
        for i, p in enumerate(procs):
            if i not in walls and p.poll() is not None:
                walls[i], outs[i] = time.perf_counter() - began, p.stdout.read()
                if p.returncode != 0 or "TIMINGS " not in outs[i]:
                    raise SystemExit(f"a process of the parallel ceiling failed ({p.returncode}): {split[i]}")
        time.sleep(0.05)
    lower = sum(lowered_s(printed_timings(out)) for out in outs.values())
    return Ceiling([walls[i] for i in range(len(procs))], [f"{', '.join(t)} x {len(g)} graphs" for t, g in split],
                   lower)


def printed_timings(stdout: str) -> list[dict]:
    """The units' timings a serial process printed (bench/fanout.py's SERIAL: TIMINGS and a JSON list)."""
    return json.loads(stdout.split("TIMINGS ", 1)[1])


def lowered_s(unit_timings: list[dict]) -> float:
    """The units' lowering, added up."""
    return sum(t.get("lower", 0.0) for t in unit_timings)
