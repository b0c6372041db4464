"""A farm service's metrics, through `ray.util.metrics` like the rest (scheduler/ray_observe.py):
queue wait per unit by priority, queued and running units per job (by name) and priority, the
shared pool's workers by state, and what its PyTorch remote caches served, by cache kind. The Grafana panel: infra/grafana/farm-service.json."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from ray.util.metrics import Gauge, Histogram

WAIT_BOUNDS_S = [0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600]
EVERY_S = 2.0
SHOWN_AFTER_S = 300.0  # a job's series stays at 0 this long after its units are gone
_METRICS: dict[str, Any] = {}


def _metrics() -> dict[str, Any]:
    if not _METRICS:
        _METRICS.update(
            wait=Histogram("farm_queue_wait_seconds", "seconds a unit waited in a farm service's queue for a worker",
                           boundaries=WAIT_BOUNDS_S, tag_keys=("priority",)),
            units=Gauge("farm_service_units", "a farm service's units queued or running, per job name and priority",
                        tag_keys=("state", "job", "priority")),
            workers=Gauge("farm_service_workers", "a farm service's shared workers: busy, idle or starting",
                          tag_keys=("state",)),
            cache=Gauge("farm_remote_cache", "a farm service's PyTorch remote caches (farm serve --cache-port), since "
                        "it started: hits, misses, refused, writes, bytes_read, bytes_written, by cache kind",
                        tag_keys=("kind", "what")),
        )
    return _METRICS


class ServiceMetrics:
    def __init__(self) -> None:
        self._starts: list[tuple[str, str, float]] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._shown: dict[tuple[str, str], float] = {}  # (job name, priority) → when it last had units

    def started(self, job: str, unit: str, priority: str, wait_s: float) -> None:
        _metrics()["wait"].observe(wait_s, tags={"priority": priority})
        with self._lock:
            self._starts.append((job, unit, time.time()))
            del self._starts[:-10_000]

    def starts(self) -> list[tuple[str, str, float]]:
        with self._lock:
            return list(self._starts)

    def watch(self, load: Callable[[], dict[str, Any]]) -> None:
        """Sample the pool's load every EVERY_S seconds until close()."""
        def loop() -> None:
            while not self._closed.wait(EVERY_S):
                self.record(load())

        threading.Thread(target=loop, name="farm service metrics", daemon=True).start()

    def record(self, load: dict[str, Any]) -> None:
        """Set every gauge again (Ray drops a series not set for two export intervals): a job that
        ended shows 0 for SHOWN_AFTER_S, then goes."""
        m = _metrics()
        for state, n in load["workers"].items():
            m["workers"].set(n, tags={"state": state})
        for kind, counts in load.get("remote_cache", {}).items():
            for what, n in counts.items():
                m["cache"].set(n, tags={"kind": kind, "what": what})
        now = time.monotonic()
        counts: dict[tuple[str, str], dict[str, int]] = {}
        for job in load["jobs"].values():
            c = counts.setdefault((job["name"], job["priority"]), {"queued": 0, "running": 0})
            c["queued"] += job["queued"]
            c["running"] += job["running"]
            self._shown[(job["name"], job["priority"])] = now
        for pair, seen in list(self._shown.items()):
            if now - seen > SHOWN_AFTER_S:
                del self._shown[pair]
                continue
            for state, n in counts.get(pair, {"queued": 0, "running": 0}).items():
                m["units"].set(n, tags={"state": state, "job": pair[0], "priority": pair[1]})

    def close(self) -> None:
        self._closed.set()
