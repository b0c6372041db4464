"""What a farm service (scheduler/service.py) keeps in the store about the jobs handed to it, so
a restarted scheduler resumes them and `farm jobs` lists them:

    service/jobs/<job-id>.json   one record per job: spec, priority, state, times
    service/inbox/<job-id>.json  a job handed over through the store alone, until the service takes it
    service/alive.json           the service's heartbeat: a client that sees a fresh one hands its
                                 jobs over through the inbox, with no Ray (ServiceInbox)

A record is written when the job is accepted, again when it starts, ends or is cancelled.
Records of jobs that ended are kept for `farm jobs` (the most recent ones) and removed by the
service itself after RECORDS_KEPT newer ones have ended; the job's own files stay under jobs/.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from storage.backend import StoreError
from storage.store import Store

log = logging.getLogger(__name__)

PREFIX = "service/jobs/"
INBOX = "service/inbox/"
CANCELS = "service/inbox/cancel/"  # `farm cancel --store`: a job to cancel, listed with the inbox's jobs
ANSWERS = "service/answers/"  # what the service said to such a request, read (and removed) by its client
ALIVE = "service/alive.json"
BEAT_S = 2.0  # how often a service writes its heartbeat
STALE_S = 15.0  # a heartbeat older than this (by the reader's clock) means no service watches the store
INBOX_MAX_BYTES = 1 << 20  # a job spec larger than this is refused unread
TAKEN_PER_POLL = 64  # inbox entries one poll takes; the rest wait for the next
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,159}")
RECORDS_KEPT = 200  # ended jobs' records kept
ANSWERS_KEPT_S = 3600.0  # an answer no client read (it died, or gave up after its 30 s) goes after this
ENDED_SHOWN = 50  # ended jobs `farm jobs` lists
COUNTED = ("total", "compiled", "hit", "failed", "skipped", "retries")  # of a job's status, in `farm jobs`
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

    def put(self, record: JobRecord, if_absent: bool = False) -> bool:
        """Write the record; with if_absent, only a new one (False if the job is recorded already)."""
        return self.store.backend.write(f"{PREFIX}{record.job_id}.json", json.dumps(asdict(record), indent=1).encode(),
                                        if_absent=if_absent)

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


@dataclass(frozen=True)
class InboxEntry:
    path: str
    job_id: str | None  # None: the entry's name is no job id the farm makes
    spec: dict[str, Any] | None  # None: unreadable, and `error` says why
    priority: str | None = None
    error: str | None = None
    cancel: bool = False  # a request to cancel job `job_id`, not a job


class ServiceInbox:
    """Jobs handed to a farm service through its store, by clients that need no Ray: whoever may
    write to the store may submit. The service takes entries in order of their ids' times, records
    each job (or refuses it, in its status) and only then removes the entry, so nothing is lost
    between the two; a job recorded already (a second service on the same store) is not run again."""

    def __init__(self, store: Store):
        self.store = store

    def post(self, job_id: str, spec: dict[str, Any], priority: str | None) -> None:
        if not JOB_ID.fullmatch(job_id):
            raise ValueError(f"{job_id!r} is not a job id the farm makes")
        doc = {"job_id": job_id, "spec": spec, "priority": priority, "posted_at": now()}
        self.store.backend.write(f"{INBOX}{job_id}.json", json.dumps(doc).encode())

    def post_cancel(self, job_id: str) -> None:
        """Ask the service to cancel `job_id`; its answer comes back through `answer`."""
        if not JOB_ID.fullmatch(job_id):
            raise ValueError(f"{job_id!r} is not a job id the farm makes")
        self.store.backend.delete(f"{ANSWERS}cancel-{job_id}.json")  # an earlier request's, never read
        self.store.backend.write(f"{CANCELS}{job_id}.json", json.dumps({"job_id": job_id, "posted_at": now()}).encode())

    def answer(self, job_id: str) -> dict[str, Any] | None:
        """The service's answer to a request to cancel `job_id` ({"units_stopped": n} or {"error": ...}),
        removed as it is read; None while there is none."""
        path = f"{ANSWERS}cancel-{job_id}.json"
        data = self.store.backend.read(path)
        if data is None:
            return None
        self.store.backend.delete(path)
        try:
            said = json.loads(data)
        except ValueError:
            said = None
        return said if isinstance(said, dict) else {"error": f"the service's answer in {path} is not one it writes"}

    def answer_cancel(self, job_id: str, said: dict[str, Any]) -> None:
        self.store.backend.write(f"{ANSWERS}cancel-{job_id}.json", json.dumps(said).encode())
        self.prune_answers()

    def prune_answers(self, older_than_s: float = ANSWERS_KEPT_S) -> None:
        """Remove the answers no client read within `older_than_s` (by the store's clock, which
        writes the mtimes: this one's answer just written is the newest)."""
        found = list(self.store.backend.list_info(ANSWERS))
        newest = max((i.mtime for i in found), default=0.0)
        for info in found:
            if info.mtime < newest - older_than_s:
                try:
                    self.store.backend.delete(info.path)
                except StoreError as e:
                    log.warning("unread service answer %s not removed (%s); the next answer tries again", info.path, e)

    def waiting(self, job_id: str) -> bool:
        return JOB_ID.fullmatch(job_id) is not None and self.store.backend.exists(f"{INBOX}{job_id}.json")

    def entries(self) -> list[InboxEntry]:
        """Up to TAKEN_PER_POLL entries, each read (not yet removed: see `done`)."""
        taken = []
        for info in sorted(self.store.backend.list_info(INBOX), key=lambda i: i.mtime)[:TAKEN_PER_POLL]:
            if info.path.startswith(CANCELS):
                job_id = info.path[len(CANCELS):].removesuffix(".json")
                taken.append(InboxEntry(info.path, job_id, None, cancel=True) if JOB_ID.fullmatch(job_id) else
                             InboxEntry(info.path, None, None, error="its name is not a job id the farm makes",
                                        cancel=True))
                continue
            job_id = info.path[len(INBOX):].removesuffix(".json")
            if not JOB_ID.fullmatch(job_id):
                taken.append(InboxEntry(info.path, None, None, error="its name is not a job id the farm makes"))
            elif info.size > INBOX_MAX_BYTES:
                taken.append(InboxEntry(info.path, job_id, None, error=f"its spec is {info.size} bytes, over the "
                                                                       f"{INBOX_MAX_BYTES}-byte limit"))
            else:
                taken.append(_entry(info.path, job_id, self.store.backend.read(info.path)))
        return taken

    def done(self, entry: InboxEntry) -> None:
        try:
            self.store.backend.delete(entry.path)
        except StoreError as e:
            log.warning("inbox entry %s not removed (%s); the job is recorded, so it is not run again", entry.path, e)

    def beat(self, info: dict[str, Any]) -> None:
        self.store.backend.write(ALIVE, json.dumps({**info, "beat_at": time.time()}).encode())

    def alive(self) -> dict[str, Any] | None:
        """The service's heartbeat, if one watches this store (its last beat within STALE_S)."""
        doc = self.last_beat()
        return doc if doc is not None and time.time() - doc["beat_at"] < STALE_S else None

    def last_beat(self) -> dict[str, Any] | None:
        data = self.store.backend.read(ALIVE)
        try:
            doc = json.loads(data) if data is not None else None
        except ValueError:
            return None
        return doc if isinstance(doc, dict) and isinstance(doc.get("beat_at"), (int, float)) else None

    def stop_beating(self) -> None:
        self.store.backend.delete(ALIVE)


def _entry(path: str, job_id: str, data: bytes | None) -> InboxEntry:
    if data is None:
        return InboxEntry(path, job_id, None, error="it went while being read")
    try:
        doc = json.loads(data)
        spec, priority = doc["spec"], doc.get("priority")
        if not isinstance(spec, dict) or not (priority is None or isinstance(priority, str)):
            raise TypeError("spec is not a mapping, or priority not a string")
    except (ValueError, TypeError, KeyError) as e:
        return InboxEntry(path, job_id, None, error=f"its inbox entry is not a job the farm client wrote ({e})")
    return InboxEntry(path, job_id, spec, priority)


def _record(job_id: str, data: bytes) -> JobRecord | None:
    try:
        doc = json.loads(data)
        return JobRecord(**doc)
    except (ValueError, TypeError) as e:
        log.warning("service record %s%s.json is unreadable (%s); skipped", PREFIX, job_id, e)
        return None
