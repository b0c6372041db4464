"""What a farm service (scheduler/service.py) keeps in the store about the jobs handed to it, so
a restarted scheduler resumes them and `farm jobs` lists them:

    service/jobs/<job-id>.json   one record per job: spec, priority, state, times

A record is written when the job is accepted, again when it starts, ends or is cancelled.
Records of jobs that ended are kept for `farm jobs` (the most recent ones) and removed by the
service itself after RECORDS_KEPT newer ones have ended; the job's own files stay under jobs/.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from storage.backend import StoreError
from storage.store import Store

log = logging.getLogger(__name__)

PREFIX = "service/jobs/"
RECORDS_KEPT = 200  # ended jobs' records kept for `farm jobs`
ACTIVE = ("queued", "running")


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


@dataclass
class JobRecord:
    job_id: str
    name: str
    priority: str
    spec: dict[str, Any]  # the job spec as the service accepted it (graphs already in the store)
    state: str = "queued"  # queued | running | done | cancelled | failed
    submitted_at: str = field(default_factory=now)
    ended_at: str | None = None
    error: str | None = None
    resumed: int = 0  # times a restarted scheduler took it up again
    counts: dict[str, int] | None = None  # its units by outcome, once it ended

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    def summary(self) -> dict[str, Any]:
        """What `farm jobs` shows of it (everything but the spec and the counts, which it shows apart)."""
        return {k: v for k, v in asdict(self).items() if k not in ("spec", "counts")}


class ServiceJobs:
    def __init__(self, store: Store):
        self.store = store

    def put(self, record: JobRecord) -> None:
        self.store.backend.write(f"{PREFIX}{record.job_id}.json", json.dumps(asdict(record), indent=1).encode())

    def get(self, job_id: str) -> JobRecord | None:
        data = self.store.backend.read(f"{PREFIX}{job_id}.json")
        return None if data is None else _record(job_id, data)

    def all(self) -> list[JobRecord]:
        """Every record, oldest first; one that cannot be read is logged and left out."""
        records = []
        for path in self.store.backend.list(PREFIX):
            job_id = path[len(PREFIX):].removesuffix(".json")
            data = self.store.backend.read(path)
            record = None if data is None else _record(job_id, data)
            if record is not None:
                records.append(record)
        return sorted(records, key=lambda r: (r.submitted_at, r.job_id))

    def prune(self, active: set[str], keep: int = RECORDS_KEPT) -> None:
        """Remove the records of ended jobs (those not in `active`) but the `keep` last written, from
        a listing alone: a record is last written when its job ends."""
        ended = sorted((i for i in self.store.backend.list_info(PREFIX)
                        if i.path[len(PREFIX):].removesuffix(".json") not in active), key=lambda i: i.mtime)
        for info in ended[: max(0, len(ended) - keep)]:
            try:
                self.store.backend.delete(info.path)
            except StoreError as e:
                log.warning("service record %s not removed (%s); the next prune tries again", info.path, e)


def _record(job_id: str, data: bytes) -> JobRecord | None:
    try:
        doc = json.loads(data)
        return JobRecord(**doc)
    except (ValueError, TypeError) as e:
        log.warning("service record %s%s.json is unreadable (%s); skipped", PREFIX, job_id, e)
        return None
