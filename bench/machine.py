"""What the whole machine did, for benchmarks that compare a side's work with another's; and a free
loopback port for a server a benchmark starts."""
from __future__ import annotations

import os
import socket
from pathlib import Path


CPU_TIMES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_times() -> dict[str, float]:
    """The machine's core-seconds so far in each of /proc/stat's first eight states."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return {name: v / os.sysconf("SC_CLK_TCK") for name, v in zip(CPU_TIMES, fields)}


def busy_core_seconds() -> float:
    """Core-seconds this machine has spent busy so far, every process's (/proc/stat): a jailed
    sandbox's compilers are reaped in their own pid namespace, out of RUSAGE_CHILDREN's sight,
    and a farm's work runs in Ray's processes, not the benchmark's."""
    times = cpu_times()
    return sum(times.values()) - times["idle"] - times["iowait"]


def process_core_seconds(root: int | None = None) -> dict[int, float]:
    """Core-seconds each process below `root` (this one by default; root included) has spent so
    far, its own and not its children's, by pid: two readings tell what the processes alive at both
    (an embedded Ray's daemons, which this driver started) spent between."""
    from tests.sockets import descendants, process_table

    tick, table = os.sysconf("SC_CLK_TCK"), process_table()
    return {pid: (int(table[pid][11]) + int(table[pid][12])) / tick  # utime, stime
            for pid in descendants(os.getpid() if root is None else root, table=table) if pid in table}


def free_port() -> int:
    """A TCP port nothing listens on at 127.0.0.1 now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
