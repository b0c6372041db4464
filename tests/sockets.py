"""The TCP sockets a process tree listens on, read from /proc (Linux), for tests that check that
what the farm starts listens on loopback alone; and, for a server a test starts, a free port and
whether it is up yet."""
from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

from workers.sandbox.jail import proc_stat


def free_port(ip: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at `ip` now (the kernel's pick), for a server a test starts."""
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def accepts(port: int, ip: str = "127.0.0.1") -> bool:
    """Whether something accepts TCP connections there now (a server a test started is up)."""
    with socket.socket() as s:
        return s.connect_ex((ip, port)) == 0


def process_table() -> dict[int, list[str]]:
    """Every process's /proc/PID/stat fields after its name (jail.proc_stat), by pid, each read once."""
    table = {int(entry.name): proc_stat(int(entry.name)) for entry in Path("/proc").glob("[0-9]*")}
    return {pid: fields for pid, fields in table.items() if fields}  # [] : it ended meanwhile


def descendants(*roots: int, table: dict[int, list[str]] | None = None) -> set[int]:
    """The roots and every process below them, in `table` (process_table's) or among the processes now."""
    parent = {pid: int(fields[1]) for pid, fields in (process_table() if table is None else table).items()}
    tree = set(roots)
    while below := {pid for pid, ppid in parent.items() if ppid in tree} - tree:
        tree |= below
    return tree


def _address(hex_ip: str) -> str:
    raw = bytes.fromhex(hex_ip)
    # the kernel prints each 32-bit word in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    return str(ip.ipv4_mapped or ip) if isinstance(ip, ipaddress.IPv6Address) else str(ip)


def listening(pids: set[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket these processes hold."""
    owner: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in os.scandir(f"/proc/{pid}/fd"):
                target = os.readlink(fd.path)
                if target.startswith("socket:["):
                    owner[target[8:-1]] = pid
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in owner:  # LISTEN
                ip, port = cols[1].split(":")
                found.append((owner[cols[9]], _address(ip), int(port, 16)))
    return found
