"""A real two-node Ray cluster on this machine for tests: `ray start` twice, both nodes on
127.0.0.1 and listening on loopback alone (scheduler/ray_loopback.py: stock `ray start` would listen
on every interface), token auth on, different custom resources."""
from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from tests.sockets import descendants, free_port, process_table
from workers.sandbox.jail import proc_stat

HEAD_IP = NODE_IP = "127.0.0.1"  # two raylets on one IP, as Ray's own multi-node tests run


@dataclass
class RayCluster:
    address: str
    env: dict[str, str]
    head_resources: dict[str, float]
    node_resources: dict[str, float]
    dashboard: str  # the head's dashboard (Jobs API), http://HEAD_IP:PORT
    metrics: tuple[str, ...] = ()  # each node's Prometheus endpoint, http://IP:PORT/metrics

    def stop(self) -> None:
        stop_cluster(int(self.address.rsplit(":", 1)[1]))


def stop_cluster(port: int) -> None:
    """Kill this cluster's processes alone: every process whose command line names its GCS port
    (raylets, GCS, dashboard, monitors, client server) and all their descendants (workers,
    agents, sandboxes). Never `ray stop`: it kills every Ray process the machine shows, those of
    a test's own cluster in a PID namespace of its own included (tests/test_cluster_recipe.py's
    recipe died with this session's teardown)."""
    named = re.compile(rf"[:=]{port}(\D|$)")
    table, roots = process_table(), []
    for pid in table:
        with suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if named.search(cmdline) and pid != os.getpid():
                roots.append(pid)
    # the whole tree first: a worker whose raylet died is re-parented to init
    doomed = descendants(*roots, table=table)
    for pid in doomed:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while any(proc_stat(pid)[:1] not in (["Z"], []) for pid in doomed) and time.monotonic() < deadline:  # until each is gone (or a zombie)
        time.sleep(0.1)
    address_file = Path("/tmp/ray/ray_current_cluster")  # as `ray stop` does, where it names this cluster
    with suppress(OSError):
        if address_file.read_text().strip().endswith(f":{port}"):
            address_file.unlink()


def _ray_on_loopback() -> list[str]:
    return [sys.executable, "-m", "scheduler.ray_loopback"]


def start_cluster(cache_dir: Path, head_resources: dict, node_resources: dict, node_gpus: int = 0) -> RayCluster:
    """node_gpus: GPUs the second node claims to have (Ray believes it; no GPU is needed to route)."""
    port = free_port(HEAD_IP)
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": os.environ.get("RAY_AUTH_TOKEN") or secrets.token_hex(32),
        # a fresh Inductor cache: compiles in these tests really compile
        "TORCHINDUCTOR_CACHE_DIR": str(cache_dir),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_metrics_report_interval_ms": "2000",  # a metric reaches the nodes' endpoints within seconds
    }
    # agents on ports of their own: Ray's default (52365) stays free for an embedded Ray's job agent.
    # No log monitors: they push workers' output to drivers, and every farm driver here joins with
    # log_to_driver=False; each polls every log file of its node ten times a second, and as a session's
    # workers come and go (hundreds of log files) the two took 53 of the suite's 2,092 CPU-seconds
    # (2026-11-30, process accounting). The dashboard still serves each worker's log from its file.
    dashboard_port = free_port(HEAD_IP)
    metrics = (free_port(HEAD_IP), free_port(NODE_IP))
    head = [*_ray_on_loopback(), "start", "--head", f"--node-ip-address={HEAD_IP}", f"--port={port}", "--num-cpus=2",
            f"--resources={json.dumps(head_resources)}", f"--dashboard-agent-listen-port={free_port(HEAD_IP)}",
            "--include-dashboard=true", f"--dashboard-host={HEAD_IP}", f"--dashboard-port={dashboard_port}",
            "--disable-usage-stats", f"--metrics-export-port={metrics[0]}", "--include-log-monitor=false"]
    node = [*_ray_on_loopback(), "start", f"--address={HEAD_IP}:{port}", f"--node-ip-address={NODE_IP}", "--num-cpus=1",
            f"--resources={json.dumps(node_resources)}", f"--num-gpus={node_gpus}", "--disable-usage-stats",
            f"--dashboard-agent-listen-port={free_port(NODE_IP)}", f"--metrics-export-port={metrics[1]}",
            "--include-log-monitor=false"]
    for cmd in (head, node):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        if proc.returncode != 0:
            stop_cluster(port)
            raise RuntimeError(f"{' '.join(cmd[:5])} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return RayCluster(f"{HEAD_IP}:{port}", env, head_resources, node_resources, f"http://{HEAD_IP}:{dashboard_port}",
                      (f"http://{HEAD_IP}:{metrics[0]}/metrics", f"http://{NODE_IP}:{metrics[1]}/metrics"))
