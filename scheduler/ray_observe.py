"""The farm where Ray's operators already look (issue 14).

- Metrics through `ray.util.metrics`, exported by each node's metrics agent with Ray's own
  (Prometheus names get Ray's `ray_` prefix: `farm_units` is scraped as `ray_farm_units_total`).
  Labels stay low-cardinality: target (backend:isa), device class and job *name*, never a key
  or a job id.
- When the farm runs as a Ray Job, its progress, final stats and where its results are go into
  the job's metadata and status message, which the dashboard's job view and `ray job status`
  show. Ray's job supervisor owns that record: it is read and written back whole, and a lost
  write is made up by the next one.

`RayObserver` is an Events (scheduler.jobs) that records both and forwards to the events it wraps.
"""
from __future__ import annotations

import json
import logging
import os
import re
import time
from typing import Any

from ray.util.metrics import Counter, Gauge, Histogram

from scheduler.jobs import Events, JobOutcome
from workers.backends import LoweringError, resolve
from workers.unit import Unit, UnitResult

log = logging.getLogger(__name__)

PHASE_BOUNDS_S = [0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800]
# the pipeline's timing names → the phases operators know; "load" loads the program and computes its key
PHASES = {"fetch": "fetch", "load": "key", "lease_wait": "lease_wait", "lower": "lower", "verify": "verify",
          "benchmark": "benchmark", "upload": "upload"}
JOB_INFO_EVERY_S = 2.0
_METRICS: dict[str, Any] = {}


def metrics() -> dict[str, Any]:
    """The farm's metrics, defined once per process (Ray registers a name once)."""
    if not _METRICS:
        unit_tags = ("target", "device_class", "job")
        _METRICS.update(
            units=Counter("farm_units", "units that ended, by status (compiled, hit, failed, skipped, timeout), "
                                        "and units sent round again (retried)", tag_keys=("status", *unit_tags)),
            phase=Histogram("farm_phase_seconds", "seconds a unit spent in each phase", boundaries=PHASE_BOUNDS_S,
                            tag_keys=("phase", *unit_tags)),
            queue=Gauge("farm_queue_depth", "units waiting for a worker, per device class", tag_keys=("device_class", "job")),
            workers=Gauge("farm_workers", "compile workers, busy or idle, per device class",
                          tag_keys=("device_class", "state", "job")),
            bytes=Counter("farm_bytes", "blob bytes moved: up to the store, down from it, or served by a worker's "
                                        "local disk tier", tag_keys=("direction", *unit_tags)),
            hit_rate=Gauge("farm_hit_rate", "hits / units that got a key, in the job so far", tag_keys=("job",)),
            saved=Counter("farm_compile_seconds_saved", "compile seconds that hits did not spend again", tag_keys=unit_tags),
            spent=Counter("farm_compile_seconds", "seconds spent compiling units that missed", tag_keys=unit_tags),
            store_bytes=Gauge("farm_store_bytes", "bytes the store holds, by kind, after the last `farm gc`",
                              tag_keys=("kind", "store")),
            gc_deleted=Counter("farm_gc_deleted", "objects `farm gc` deleted, by kind", tag_keys=("kind", "store")),
        )
    return _METRICS


METRICS_FLUSH_S = 11.0  # Ray's agents export every 10 s: a short-lived driver waits that long for its last numbers


def record_store(report: dict[str, Any], store: str, flush_s: float = METRICS_FLUSH_S) -> None:
    """A collection's numbers (storage/gc.py Report.to_dict()) as Ray metrics, from `farm gc`
    run as a RayJob (RAY_ADDRESS set) or inside a session that already joined a cluster."""
    import ray

    if not ray.is_initialized():
        from scheduler.ray_session import join

        join(os.environ.get("RAY_ADDRESS", "auto"), logging_level=logging.WARNING, log_to_driver=False)
    m = metrics()
    kinds = set(report["kept"]) | set(report["deleted"])
    for kind in kinds:
        kept = report["kept"].get(kind, {}).get("bytes", 0)
        m["store_bytes"].set(kept, tags={"kind": kind, "store": store})
        count = report["deleted"].get(kind, {}).get("count", 0)
        if count and not report["dry_run"]:
            m["gc_deleted"].inc(count, tags={"kind": kind, "store": store})
    time.sleep(flush_s)


def device_class(unit: Unit) -> str:
    try:
        return resolve(unit.target).placement(unit.target).device_class
    except LoweringError:
        return "none"


def outcome_label(result: UnitResult) -> str:
    """A failed unit's `timeout` (its sandbox or worker ran past the unit's limit) counts apart."""
    if result.status == "failed" and re.search(r"(^|: )timeout: ", result.error or ""):
        return "timeout"
    return result.status


def submission_id() -> str | None:
    """The Ray Job this process is the entrypoint of, from the job config Ray's supervisor gave it."""
    try:
        config = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}"))
    except json.JSONDecodeError:
        return None
    return (config.get("metadata") or {}).get("job_submission_id")


class RayJobInfo:
    """The farm's lines in a Ray Job's record (metadata and status message)."""

    def __init__(self, submission: str):
        from ray._private.ray_constants import KV_NAMESPACE_JOB
        from ray.dashboard.modules.job.common import JobInfoStorageClient

        self.key = JobInfoStorageClient.JOB_DATA_KEY.format(job_id=submission)
        self.namespace = KV_NAMESPACE_JOB
        self.missing = False

    def update(self, message: str, metadata: dict[str, str]) -> None:
        from ray.experimental import internal_kv

        try:
            raw = internal_kv._internal_kv_get(self.key, namespace=self.namespace)
            if raw is None:  # Ray's supervisor gave this process another cluster's address than its own
                if not self.missing:
                    log.warning("the Ray Job's record is not in the cluster this process joined (%s); its progress is "
                                "not shown there", os.environ.get("RAY_ADDRESS"))
                self.missing = True
                return
            info = json.loads(raw)
            info["message"] = message
            info["metadata"] = {**(info.get("metadata") or {}), **metadata}
            internal_kv._internal_kv_put(self.key, json.dumps(info), overwrite=True, namespace=self.namespace)
        except (ConnectionError, RuntimeError, json.JSONDecodeError) as e:  # progress is a courtesy: never stop the job
            log.warning("could not update the Ray Job's record: %s", e)


class RayObserver(Events):
    def __init__(self, inner: Events, job_name: str, job_id: str, store_uri: str):
        self.inner, self.job_name, self.job_id, self.store_uri = inner, job_name, job_id, store_uri
        self.m = metrics()
        self.counts = {"total": 0, "compiled": 0, "hit": 0, "failed": 0, "skipped": 0, "retried": 0}
        self.looked_up = 0
        self.classes: set[str] = set()
        sub = submission_id()
        self.job_info = RayJobInfo(sub) if sub else None
        self._told = 0.0
        self._device_class: dict[str, str] = {}  # by target label: resolving a backend per event is wasted work

    def _tags(self, unit: Unit) -> dict[str, str]:
        label = unit.target.label
        if label not in self._device_class:
            self._device_class[label] = device_class(unit)
        return {"target": unit.target.base_label, "device_class": self._device_class[label], "job": self.job_name}

    def planned(self, units: list[Unit]) -> None:
        self.counts["total"] = len(units)
        self._tell()
        self.inner.planned(units)

    def started(self, unit: Unit) -> None:
        self.inner.started(unit)

    def retried(self, unit: Unit) -> None:
        self.m["units"].inc(1, {"status": "retried", **self._tags(unit)})
        self.counts["retried"] += 1
        self.inner.retried(unit)

    def ran_again(self, unit: Unit, previous: UnitResult) -> None:
        self.m["units"].inc(1, {"status": "retried", **self._tags(unit)})
        self.counts[previous.status] -= 1
        self.counts["retried"] += 1
        self.inner.ran_again(unit, previous)

    def finished(self, unit: Unit, result: UnitResult) -> None:
        tags = self._tags(unit)
        self.m["units"].inc(1, {"status": outcome_label(result), **tags})
        for name, phase in PHASES.items():
            if result.timings.get(name):
                self.m["phase"].observe(result.timings[name], {"phase": phase, **tags})
        for direction, n in (("up", result.transfer.uploaded), ("down", result.transfer.downloaded),
                             ("local", result.transfer.cached)):
            if n:
                self.m["bytes"].inc(n, {"direction": direction, **tags})
        row = result.to_row(self.job_id)
        if row["saved_s"]:
            self.m["saved"].inc(row["saved_s"], tags)
        if row["compile_s"]:
            self.m["spent"].inc(row["compile_s"], tags)
        self.counts[result.status] = self.counts.get(result.status, 0) + 1
        self.looked_up += result.key is not None
        if self.looked_up:
            self.m["hit_rate"].set(self.counts["hit"] / self.looked_up, {"job": self.job_name})
        self._tell()
        self.inner.finished(unit, result)

    def load(self, queued: dict[str, int], busy: dict[str, int], idle: dict[str, int]) -> None:
        self.classes |= set(queued) | set(busy) | set(idle)
        for c in self.classes:
            self.m["queue"].set(queued.get(c, 0), {"device_class": c, "job": self.job_name})
            self.m["workers"].set(busy.get(c, 0), {"device_class": c, "state": "busy", "job": self.job_name})
            self.m["workers"].set(idle.get(c, 0), {"device_class": c, "state": "idle", "job": self.job_name})
        self.inner.load(queued, busy, idle)

    def progress(self) -> str:
        c = self.counts
        done = c["compiled"] + c["hit"] + c["failed"] + c["skipped"]
        return (f"farm: {done}/{c['total']} units · compiled {c['compiled']} · hits {c['hit']} · failed {c['failed']}"
                + (f" · retried {c['retried']}" if c["retried"] else ""))

    def _tell(self, final: dict[str, str] | None = None) -> None:
        if self.job_info is None or (final is None and time.monotonic() - self._told < JOB_INFO_EVERY_S):
            return
        self._told = time.monotonic()
        self.job_info.update(self.progress(), {
            "farm_job_id": self.job_id, "farm_progress": self.progress(),
            "farm_results": f"{self.store_uri.rstrip('/')}/jobs/{self.job_id}/results.parquet",
            "farm_status": f"farm status {self.job_id} --store {self.store_uri}", **(final or {})})

    def done(self, outcome: JobOutcome) -> None:
        """The job ended: queues are empty, and a Ray Job's record gets the final stats."""
        self.load({}, {}, {})
        s = outcome.stats
        rate = "-" if s.hit_rate is None else f"{s.hit_rate:.0%}"
        self._tell({"farm_stats": f"hit rate {rate} · compile time saved {s.saved_s:.1f} s · spent compiling "
                                  f"{s.compile_s:.1f} s · wall {outcome.wall_s:.1f} s"})
