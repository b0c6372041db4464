"""Where a command's CPU goes, by kind of process: run it (the suite, say) and read every process
from /proc while it runs, then print the machine's core-seconds for the window (busy, idle, user,
nice, system) and each kind's (zygotes, their children, Ray's workers, the C++ compiler, ...).

    python bench/suite_cpu.py [--every 0.5] [--json OUT] -- CI=true ./.ci/run

The suite is CPU-bound on 2 cores (its idle share says so); this says which processes to make
fewer or cheaper. A process is read every `--every` seconds, so one that lives shorter than that is
missed and the kinds' sums are lower bounds; the machine's line is exact (/proc/stat). Processes
without a command line are the kernel's threads (on some VMs, DAMON's kdamond is a few %).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import CPU_TIMES, cpu_times  # noqa: E402  (the repo's root is on sys.path now)
from tests.sockets import process_table  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
# the compilers, by program name: binutils' command lines may or may not hold their path
PROGRAMS = {"cc1plus": "C++ compiler", "as": "linker and assembler", "ld": "linker and assembler",
            "collect2": "linker and assembler"}

# (kind, what its command line holds), first match wins; a zygote's children carry its command line,
# and a Ray worker's names its raylet
KINDS = (("zygote", ("workers.sandbox.zygote",)), ("Ray worker", ("default_worker.py",)),
         ("Ray daemons", ("ray::DashboardAgent", "ray::RuntimeEnvAgent", "raylet", "gcs_server", "dashboard",
                          "log_monitor", "monitor.py", "runtime_env")),
         ("Ray worker", ("ray::",)), ("jail (bwrap)", ("bwrap",)), ("ccache and g++ drivers", ("ccache", "g++")),
         ("SeaweedFS", ("weed ",)), ("pytest workers", ("exec(eval(sys.stdin",)), ("pytest's main process", ("-m pytest",)),
         ("farm CLI", ("-m farm", "bin/farm ")), ("the tests' own scripts", ("/tests/",)), ("python -c", (" -c ",)))


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:400]
    except OSError:
        return ""


class Sampler:
    """Every process seen while it runs: its command line (as first seen), parent, and CPU."""

    def __init__(self, every: float):
        self.every, self.seen, self._stop = every, {}, threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "Sampler":
        self._scan(already=True)  # what runs before the command counts from now on, not from its start
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self._scan(already=False)

    def _scan(self, already: bool) -> None:
        for number, fields in process_table().items():
            pid, ppid, user, sys_ = str(number), int(fields[1]), int(fields[11]) / TICK, int(fields[12]) / TICK
            entry = self.seen.get(pid)
            if entry is None or entry["ppid"] != ppid:  # new, or the pid was reused
                entry = self.seen[pid] = {"ppid": ppid, "cmd": _cmdline(pid), "user0": user if already else 0.0,
                                          "sys0": sys_ if already else 0.0}
            entry["user"], entry["sys"] = user, sys_


def kind(entry: dict, seen: dict) -> str:
    cmd = entry["cmd"]
    if not cmd:
        return "kernel threads, and processes gone before their command line was read"
    program = PROGRAMS.get(Path(cmd.split(" ", 1)[0]).name)
    if program is not None:
        return program
    for name, marks in KINDS:
        if any(m in cmd for m in marks):
            if name == "zygote" and "workers.sandbox.zygote" in seen.get(str(entry["ppid"]), {}).get("cmd", ""):
                return "zygote's children (the units' work)"
            return name
    return "other: " + Path(cmd.split()[0]).name


def report(seen: dict, began: dict, ended: dict, wall: float) -> dict:
    window = {k: ended[k] - began[k] for k in CPU_TIMES}
    busy = sum(v for k, v in window.items() if k not in ("idle", "iowait"))
    kinds: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"processes": 0, "user": 0.0, "sys": 0.0})
    for entry in seen.values():
        if entry["user"] + entry["sys"] - entry["user0"] - entry["sys0"] <= 0:
            continue  # ran before the command and was idle through it
        k = kinds[kind(entry, seen)]
        k["processes"] += 1
        k["user"] += entry["user"] - entry["user0"]
        k["sys"] += entry["sys"] - entry["sys0"]
    return {"wall_s": wall, "machine": {**window, "busy": busy}, "kinds": dict(kinds)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=0.5, help="seconds between reads of /proc")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- and the command to run")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    began, t0 = cpu_times(), time.monotonic()
    with Sampler(args.every) as sampler:
        status = subprocess.call(" ".join(command), shell=True)
    figures = report(sampler.seen, began, cpu_times(), time.monotonic() - t0)
    m = figures["machine"]
    print(f"{' '.join(command)}: exit {status}, {figures['wall_s']:.0f} s; the machine: busy {m['busy']:.0f} core-s, "
          f"idle {m['idle'] + m['iowait']:.0f} (user {m['user']:.0f}, nice {m['nice']:.0f}, system {m['system']:.0f})")
    print(f"{'core-s':>8} {'user':>7} {'system':>7} {'processes':>9}  kind (lower bounds: read every {args.every:g} s)")
    for name, k in sorted(figures["kinds"].items(), key=lambda kv: -(kv[1]["user"] + kv[1]["sys"])):
        if k["user"] + k["sys"] < 0.05:
            break  # the rest are rounding
        print(f"{k['user'] + k['sys']:8.1f} {k['user']:7.1f} {k['sys']:7.1f} {k['processes']:9d}  {name}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
