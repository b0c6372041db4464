"""The farm as a long-lived service for a team: the body of the detached `farm-scheduler` actor
(scheduler/ray_service.py places it). It holds one pool of warm workers for every job
(scheduler/shared_pool.py), runs each job handed to it in a thread of its own (plan, run,
results: scheduler.jobs.execute, as `farm submit` does in its own process), and keeps a record
of each job in the store (storage/service_jobs.py). Jobs reach it through Ray (`submit`), or
through the store's inbox, which it lists every `inbox_poll_s` beside writing its heartbeat:
clients that see the heartbeat need no Ray at all (farm/service_client.py).

Faults: Ray restarts the actor after it dies (max_restarts=-1). Its workers die with it (they are
its children); the new one reads the records and runs every job that had not ended again under
its id. A unit whose manifest was published meanwhile is a hit there, so nothing published is
compiled again, and the job's results table, written once at its end, has one row per unit.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from dataclasses import asdict
from typing import Any, Iterator

from scheduler.fair import UnknownPriority, weight_of
from scheduler.jobs import STATUS_FILE, NoEvents, empty_status, execute, new_job_id, read_status
from scheduler.ray_session import cluster_id
from scheduler.service_config import CacheSecrets, CacheSettings, ServiceConfig
from scheduler.shared_pool import SharedPool
from scheduler.spec import JobSpec, SpecError, is_local_source, parse_job
from storage import CacheConfig, Store, StoreError, store_from_uri
from storage.service_jobs import (BEAT_S, COUNTED, ENDED_SHOWN, JOB_ID, InboxEntry, JobRecord, ServiceInbox,
                                  ServiceJobs, now)
from workers.unit import Gang, Unit, UnitResult

log = logging.getLogger(__name__)



class ServiceRunner:
    """A job's runner (scheduler.jobs.Runner) on the service's shared pool; gangs lend the pool
    their CPUs while they run (SharedPool.hold)."""

    def __init__(self, pool: SharedPool, job_id: str, priority: str, cap: int | None):
        self.pool, self.job_id, self.priority, self.cap = pool, job_id, priority, cap

    def __call__(self, units: list[Unit], store: Store, events) -> Iterator[tuple[Unit, UnitResult]]:
        yield from self.pool.run(self.job_id, self.priority, units, store, events, self.cap)

    def gangs(self, gangs: list[Gang], store: Store, events) -> Iterator[tuple[Unit, UnitResult]]:
        from scheduler.ray_pool import PLACE_S, GangRunner, gang_bundle

        for gang in gangs:
            if self.pool.cancelled(self.job_id):
                yield from self.pool.run(self.job_id, self.priority, list(gang.ranks), store, events, self.cap)
                continue
            made = gang_bundle(gang)  # (one that cannot be made: GangRunner fails the gang at once)
            slots = {} if isinstance(made, str) else {r: n * gang.world_size for r, n in made[0].items()
                                                      if r not in ("CPU", "GPU")}
            with self.pool.hold(min(gang.world_size, self.pool.cpus()), slots):
                # workers over the smaller pool leave as their unit ends: within the longest unit's limit
                place_s = PLACE_S + self.pool.longest_timeout()
                yield from GangRunner(self.job_id, place_s, self.pool.gang_ranks)([gang], store, events)


def _start_cache(store: Store, settings: CacheSettings, secrets: CacheSecrets | None):
    """The store served to PyTorch's remote caches from this actor (`farm serve --cache-port`)."""
    from storage.cache_server import CacheServer, tls_context
    from storage.cache_tokens import User, Users
    from storage.remote_cache import CacheEntries

    if secrets is None or not secrets.users:
        raise ValueError("farm serve --cache-port needs --cache-tokens: a file of 'NAME ROLE TOKEN' lines")
    tls = tls_context(secrets.tls_cert, secrets.tls_key) if secrets.tls_cert and secrets.tls_key else None
    server = CacheServer(CacheEntries(store), Users([User(*u) for u in secrets.users]), host=settings.host,
                         port=settings.port, max_value_bytes=int(settings.max_value_mb * (1 << 20)), tls=tls)
    server.start_in_thread()
    return server


def local_sources(job: JobSpec) -> list[str]:
    """Graphs a spec names by a path on the submitting machine: a service cannot read them (and
    must not read its own host's files for a client); the client uploads them first."""
    paths = [g.path for g in job.graphs] + [p for g in job.gangs for p in g.paths()]
    return [p for p in paths if is_local_source(p)]


class FarmScheduler:
    def __init__(self, store_uri: str, config: ServiceConfig, cache_secrets: CacheSecrets | None = None):
        from scheduler.ray_pool import RayCluster
        from scheduler.service_metrics import ServiceMetrics

        self.store = store_from_uri(store_uri, CacheConfig.from_env())
        self.config = config
        self.records = ServiceJobs(self.store)
        self.inbox = ServiceInbox(self.store)
        self.metrics = ServiceMetrics()
        self.pool = SharedPool(RayCluster(), self.store.uri, config, on_start=self.metrics.started)
        self.started_at = now()
        self.cluster = cluster_id()  # in its heartbeat: a client that remembers the cluster's store checks it
        self._lock = threading.Lock()
        self._active: dict[str, JobRecord] = {}
        self._ended: collections.deque[JobRecord] = collections.deque(maxlen=ENDED_SHOWN)
        self._stopped = False
        self._halt = threading.Event()  # ends the inbox's watch
        self.cache, self.cache_error = None, None  # `farm serve --cache-port`: started below
        self.resumed = []
        for record in self.records.all():
            if record.active:
                record.resumed += 1
                self.resumed.append(record.job_id)
                self.records.put(record)
                self._launch(record)
            else:
                self._ended.append(record)
        self.metrics.watch(self._named_load)
        local = self.store.uri.startswith("file://")
        self._inbox_poll_s = config.inbox_poll_s if config.inbox_poll_s is not None else 0.05 if local else 0.5
        self._inbox_thread = threading.Thread(target=self._watch_inbox, name="farm inbox", daemon=True)
        self._inbox_thread.start()
        if config.cache is not None:
            try:
                self.cache = _start_cache(self.store, config.cache, cache_secrets)
            except (OSError, ValueError) as e:  # said by `ping`: `farm serve` reports it and stops the service
                self.cache_error = f"{type(e).__name__}: {e}"

    # calls from clients -------------------------------------------------------------
    def ping(self) -> dict[str, Any]:
        cache = None
        if self.cache is not None:
            scheme = "rediss" if self.cache.tls else "redis"
            cache = f"{scheme}://NAME:TOKEN@{self.cache.host}:{self.cache.port}"
        return {"store": self.store.uri, "started_at": self.started_at, "pid": os.getpid(),
                "config": asdict(self.config), "resumed": list(self.resumed), "cache": cache,
                "cache_error": self.cache_error}

    def submit(self, spec: dict[str, Any], priority: str | None = None, job_id: str | None = None) -> dict[str, Any]:
        """Accept a job (its graphs already in the store, as blob:// addresses) or say why not;
        `job_id`: the one its client chose (an inbox entry's), else a new one."""
        if self._stopped:
            return {"error": "the farm service is stopping; start it again with `farm serve`"}
        try:
            job = parse_job(spec, "the job handed to the farm service")
            if priority is not None:
                weight_of(priority)
                job = job.model_copy(update={"priority": priority})
        except (SpecError, UnknownPriority) as e:
            return {"error": str(e)}
        local = local_sources(job)
        if local:
            return {"error": f"the job names graphs by a path on the submitting machine ({', '.join(local[:3])}); "
                             f"farm.client.submit uploads them to the store first: submit through it or `farm submit`"}
        if job_id is not None and (not JOB_ID.fullmatch(job_id) or self.store.get_job_file(job_id, STATUS_FILE)):
            return {"error": f"job id {job_id!r} is not one the farm makes, or is taken; submit again", "taken": True}
        record = JobRecord(job_id or new_job_id(job.name), job.name, job.priority,
                           job.model_dump(mode="json", exclude={"base_dir"}))
        try:
            if not self.records.put(record, if_absent=True):
                return {"error": f"job {record.job_id} is recorded already", "taken": True}
        except StoreError as e:
            return {"error": f"the farm service could not record the job in {self.store.uri}: {e}; try again"}
        self._launch(record)
        return {"job_id": record.job_id, "priority": record.priority}

    def jobs(self) -> list[dict[str, Any]]:
        """Queued, running and recently ended jobs, oldest first, with progress."""
        load = self.pool.load()["jobs"]
        with self._lock:
            records = list(self._ended) + list(self._active.values())
        rows = []
        for record in sorted(records, key=lambda r: (r.submitted_at, r.job_id)):
            row = record.summary()
            status = record.counts if record.counts is not None else self._status(record.job_id)
            row.update({k: status.get(k, 0) for k in COUNTED})
            live = load.get(record.job_id)
            row["queued"] = live["queued"] if live else 0
            row["running"] = live["running"] if live else 0
            rows.append(row)
        return rows

    def cancel(self, job_id: str) -> dict[str, Any]:
        record, ended = self._known(job_id)
        if record is None and ended is None and self.inbox.waiting(job_id):
            # handed over through the store a moment ago (`farm submit --detach`, then cancel):
            # the inbox's watcher takes it within a poll, and it is cancelled like any other
            deadline = time.monotonic() + max(10.0, 20 * self._inbox_poll_s)
            while self.inbox.waiting(job_id) and time.monotonic() < deadline:
                time.sleep(self._inbox_poll_s)
        return self._cancel(job_id)

    def _cancel(self, job_id: str) -> dict[str, Any]:
        record, ended = self._known(job_id)
        if record is None and ended is None:
            return {"error": f"no job {job_id} in this farm service; `farm jobs` lists them"}
        with self._lock:  # the job's thread moves it on under the same lock (`_moved`): one of them wins
            live = record is not None and record.state in ("queued", "running")
            if live:
                record.state = "cancelled"
        if not live:
            return {"error": f"job {job_id} already ended ({(record or ended).state}); nothing to cancel"}
        self.records.put(record)
        return {"job_id": job_id, "units_stopped": self.pool.cancel(job_id)}

    def _known(self, job_id: str) -> tuple[JobRecord | None, JobRecord | None]:
        """The job, running or queued here; or recently ended."""
        with self._lock:
            return self._active.get(job_id), next((r for r in self._ended if r.job_id == job_id), None)

    def stop(self) -> dict[str, Any]:
        """End the service: every unit queued or running ends failed (retryable) and every active
        job is recorded as cancelled, so a later service does not run it again."""
        self._stopped = True
        self._halt.set()
        self._inbox_thread.join(timeout=30)
        try:
            self.inbox.stop_beating()  # clients hand their jobs over no more: they run them themselves
        except StoreError as e:
            log.warning("farm service: heartbeat not removed (%s); it goes stale in seconds", e)
        with self._lock:
            active = list(self._active.values())
        for record in active:
            record.state, record.error = "cancelled", "the farm service was stopped"
            self.records.put(record)
        counts = self.pool.stop()
        if self.cache is not None:
            self.cache.stop()
        self.metrics.close()
        return {"jobs": [r.job_id for r in active], **counts}

    def load(self) -> dict[str, Any]:
        return self._named_load()

    def _named_load(self) -> dict[str, Any]:
        load = self.pool.load()
        if self.cache is not None:
            load["remote_cache"] = self.cache.entries.stats()
        with self._lock:
            names = {j: r.name for j, r in self._active.items()}
        for job_id, job in load["jobs"].items():
            job["name"] = names.get(job_id, "job")
        return load

    def unit_starts(self) -> list[tuple[str, str, float]]:
        """(job, unit, when) for every unit this scheduler sent to a worker, in order (tests)."""
        return self.metrics.starts()

    # the store's inbox ---------------------------------------------------------------
    def _watch_inbox(self) -> None:
        next_beat = 0.0
        while not self._halt.is_set():
            try:
                if time.monotonic() >= next_beat:
                    self.inbox.beat({"store": self.store.uri, "started_at": self.started_at, "pid": os.getpid(),
                                     "cluster": self.cluster})
                    next_beat = time.monotonic() + BEAT_S
                for entry in self.inbox.entries():
                    if self._halt.is_set():
                        break
                    self._take(entry)
            except StoreError as e:  # the store is out of reach for now: the entries wait there
                log.warning("farm service: inbox not read (%s); trying again", e)
            except Exception:  # noqa: BLE001 - the watch must outlive one bad entry
                log.exception("farm service: inbox watch failed once; going on")
            self._halt.wait(self._inbox_poll_s)

    def _take(self, entry: InboxEntry) -> None:
        """Record the entry's job (or its refusal, in its status) first, then remove the entry."""
        if self._stopped:
            return  # stopping: the entry waits for the next service
        if entry.cancel:  # `farm cancel --store`: answered in the store (a job posted before it is recorded by now)
            said = self._cancel(entry.job_id) if entry.job_id is not None else {"error": entry.error}
            if entry.job_id is not None:
                self.inbox.answer_cancel(entry.job_id, said)
            log.info("farm service: cancel of %s through the store: %s", entry.job_id or entry.path, said)
            self.inbox.done(entry)
            return
        said = self.submit(entry.spec, entry.priority, entry.job_id) if entry.spec is not None else {"error": entry.error}
        if "error" in said and not said.get("taken") and entry.job_id is not None:
            doc = {**empty_status(entry.job_id, "rejected"), "updated_at": now(),
                   "error": f"the farm service refused the job: {said['error']}"}
            # never over another job's status (an entry can name any id)
            self.store.put_job_file(entry.job_id, STATUS_FILE, json.dumps(doc, indent=1).encode(), if_absent=True)
        if "error" in said:
            log.warning("farm service: inbox entry %s refused: %s", entry.path, said["error"])
        self.inbox.done(entry)

    # jobs ---------------------------------------------------------------------------
    def _status(self, job_id: str) -> dict[str, Any]:
        try:
            return read_status(self.store, job_id) or {}
        except (StoreError, ValueError):
            return {}

    def _launch(self, record: JobRecord) -> None:
        with self._lock:
            self._active[record.job_id] = record
        threading.Thread(target=self._run, args=(record,), name=f"farm job {record.job_id}", daemon=True).start()

    def _run(self, record: JobRecord) -> None:
        from scheduler.ray_observe import RayObserver

        try:
            job = parse_job(record.spec, f"the service's record of job {record.job_id}")
            if self._moved(record, "queued", "running"):
                self.records.put(record)
            runner = ServiceRunner(self.pool, record.job_id, record.priority, job.limits.workers)
            observer = RayObserver(NoEvents(), job.name, record.job_id, self.store.uri)
            # done unless a cancel came first; decided once, under the lock `_cancel` takes, so a
            # cancelled job's status never says `done`, not even for a moment
            outcome = execute(job, self.store, runner, observer, record.job_id,
                              settle=lambda: "done" if self._moved(record, "running", "done") else record.state)
            observer.done(outcome)
        except Exception as e:  # noqa: BLE001 - a job's thread has no caller: its record says what stopped it
            log.exception("farm service: job %s stopped", record.job_id)
            if self._moved(record, ("queued", "running"), "failed"):
                record.error = f"{type(e).__name__}: {e}"
        finally:
            self.pool.finish(record.job_id)
            if self._stopped:
                return
            record.ended_at = now()
            status = self._status(record.job_id)
            record.counts = {k: status.get(k, 0) for k in COUNTED}  # `farm jobs` reads no status of an ended job
            self._mark_status(record, status)
            try:
                self.records.put(record)
                with self._lock:
                    active = set(self._active)
                self.records.prune(active)
            except StoreError as e:
                log.warning("farm service: record of job %s not written (%s)", record.job_id, e)
            with self._lock:
                self._active.pop(record.job_id, None)
                self._ended.append(record)

    def _moved(self, record: JobRecord, was: str | tuple[str, ...], to: str) -> bool:
        """The job's state from `was` (one of them) to `to`, unless a cancel came first (under
        `_cancel`'s lock)."""
        with self._lock:
            if record.state not in ((was,) if isinstance(was, str) else was):
                return False
            record.state = to
            return True

    def _mark_status(self, record: JobRecord, status: dict[str, Any]) -> None:
        """A cancelled or failed job's status says so (execute wrote `done`, or nothing)."""
        if record.state == "done":
            return
        doc = {**(status or {"job_id": record.job_id}), "state": record.state,
               "error": record.error or status.get("error"), "updated_at": now()}
        try:
            self.store.put_job_file(record.job_id, STATUS_FILE, json.dumps(doc, indent=1).encode())
        except StoreError as e:
            log.warning("farm service: status of job %s not written (%s)", record.job_id, e)
