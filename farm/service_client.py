"""Talking to a farm service (`farm serve`): hand it jobs, list them, cancel them, stop it.

A job's local graphs are uploaded to the service's store first and named by digest
(`blob://sha256/...`), so the service never reads a client's paths; keys are computed in the
service's sandboxes, so nothing here imports torch.

A job reaches the service through its store's inbox where the store shows the service's
heartbeat (storage/service_jobs.py, ServiceInbox): that path needs no Ray, so a laptop or a CI
runner with the store's credentials submits without joining the cluster, and without Ray's
start-up. A client that names only the cluster finds the store there (`_inbox_of_cluster`).
Otherwise through Ray, to the `farm-scheduler` actor; `farm cancel` always goes that way, and
`farm jobs` unless it is given the store (`jobs_in_store`).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from farm.stores import open_store
from scheduler.fair import DEFAULT_PRIORITY, UnknownPriority, weight_of
from scheduler.spec import BLOB_SCHEME, JobSpec, SpecError, is_local_source, load_job, parse_job
from storage import Store
from storage.service_jobs import COUNTED, ENDED_SHOWN, ServiceInbox, ServiceJobs


class ServiceRefused(ValueError):
    """The service refused the call (a bad spec, an unknown or ended job); the message says why."""


def absolute_store(uri: str) -> str:
    """A store URI every process on the cluster reads alike (a relative directory made absolute)."""
    return uri if "://" in uri and not uri.startswith("file://") else str(Path(uri.removeprefix("file://")).resolve())


def _same_store(a: str, b: str) -> bool:
    return absolute_store(a).rstrip("/") == absolute_store(b).rstrip("/")


@dataclass
class Service:
    actor: Any | None  # None: reached through its store's inbox alone
    info: dict[str, Any]  # what its ping (or heartbeat) said: store, started_at

    @property
    def via(self) -> str:
        return "Ray" if self.actor is not None else "its store's inbox"

    @property
    def store_uri(self) -> str:
        return self.info["store"]

    def store(self, asked: str | Store | None = None) -> Store:
        """The service's store; a store the caller named must be the same one."""
        if asked is not None:
            uri = asked.uri if isinstance(asked, Store) else asked
            if not _same_store(uri, self.store_uri):
                raise ServiceRefused(f"the farm service on this cluster keeps its artifacts in {self.store_uri}, not "
                                     f"{uri}; leave out --store (or pass that one)")
        return open_store(self.store_uri)

    def submit(self, spec: JobSpec | dict | str | Path, store: str | Store | None = None, priority: str | None = None,
               workers: int | None = None) -> str:
        """Upload the job's local graphs and hand it over; its id."""
        job = job_spec(spec)
        s = self.store(store)
        doc = upload_graphs(job, s)
        if workers is not None:
            doc.setdefault("limits", {})["workers"] = workers
        if self.actor is None:
            return self._post(job, doc, s, priority)
        from scheduler.ray_service import call

        said = call(self.actor, "submit", doc, priority)
        if "error" in said:
            raise ServiceRefused(said["error"])
        return said["job_id"]

    def _post(self, job: JobSpec, doc: dict[str, Any], store: Store, priority: str | None) -> str:
        from scheduler.jobs import new_job_id

        try:
            if priority is not None:
                weight_of(priority)
            parse_job(doc, "the job as the farm service takes it")  # what the service checks, said here
        except (UnknownPriority, SpecError) as e:
            raise ServiceRefused(str(e)) from None
        job_id = new_job_id(job.name)
        ServiceInbox(store).post(job_id, doc, priority)
        return job_id

    def jobs(self) -> list[dict[str, Any]]:
        from scheduler.ray_service import call

        return call(self.actor, "jobs")

    def cancel(self, job_id: str) -> dict[str, Any]:
        from scheduler.ray_service import call

        said = call(self.actor, "cancel", job_id)
        if "error" in said:
            raise ServiceRefused(said["error"])
        return said


def job_spec(spec: JobSpec | dict | str | Path) -> JobSpec:
    if isinstance(spec, JobSpec):
        return spec
    if isinstance(spec, dict):
        return parse_job(spec, "the job given to submit()", base_dir=Path.cwd())
    return load_job(spec)


def upload_graphs(job: JobSpec, store: Store) -> dict[str, Any]:
    """The spec as the service takes it: every graph on this machine put in the store and named
    by digest (its label kept); remote URIs as they are."""
    doc = job.model_dump(mode="json", exclude={"base_dir"})
    for graph, entry in zip(job.graphs, doc["graphs"]):
        entry["path"], entry["name"] = _uploaded(job.resolve(graph), store), graph.label
    for gang, entry in zip(job.gangs, doc["gangs"]):
        entry["ranks"] = [_uploaded(job.resolve(p), store) for p in gang.paths()]
    return doc


def _uploaded(source: str, store: Store) -> str:
    if not is_local_source(source):
        return source
    path = Path(source.removeprefix("file://"))
    if not path.is_file():
        raise SpecError(f"{path} is not a file; name the .pt2 written by torch.export.save "
                        f"(relative paths start at the job file)")
    return f"{BLOB_SCHEME}sha256/{store.put_file(path).digest}"


_COUNTED = (*COUNTED, "queued", "running")  # what a row of `farm jobs` counts


def jobs_in_store(store: str | Store | None) -> list[dict[str, Any]]:
    """`farm jobs --store`, with no Ray: a farm service's jobs as its store has them, oldest first
    (queued and running counts as of each job's last status write, about once a second), then
    the latest jobs that ran without a service (`farm compile`, `run`, `submit`, a nightly), then
    jobs still waiting in its inbox."""
    from scheduler.jobs import read_status

    s = open_store(store, create=False)
    records = ServiceJobs(s).all()
    ended = {r.job_id for r in [r for r in records if not r.active][-ENDED_SHOWN:]}  # the latest, as the service shows
    rows = []
    for record in [r for r in records if r.active or r.job_id in ended]:
        status = record.counts if record.counts is not None else (read_status(s, record.job_id) or {})
        rows.append({**record.summary(), **{k: status.get(k, 0) for k in _COUNTED}})
    rows += _jobs_without_service(s, {r.job_id for r in records})
    for entry in ServiceInbox(s).entries():
        if entry.job_id is not None and entry.spec is not None:
            rows.append({"job_id": entry.job_id, "name": entry.job_id, "priority": entry.priority or DEFAULT_PRIORITY,
                         "state": "queued", "submitted_at": "", "ended_at": None, "resumed": 0,
                         "error": "in the store's inbox: no farm service has taken it yet", **{k: 0 for k in _COUNTED}})
    return rows


def _jobs_without_service(store: Store, service_jobs: set[str]) -> list[dict[str, Any]]:
    """The ENDED_SHOWN latest jobs in the store that no service ran, by their status documents
    (one listing of jobs/, then a read each), oldest first; one whose process stopped without
    ending it says so (scheduler.jobs.silence_note)."""
    from concurrent.futures import ThreadPoolExecutor

    from scheduler.jobs import STATUS_FILE, read_status, silence_note

    written = {i.path.split("/")[1]: i.mtime for i in store.backend.list_info("jobs/")
               if i.path.count("/") == 2 and i.path.endswith("/" + STATUS_FILE)}
    latest = sorted((j for j in written if j not in service_jobs), key=written.get)[-ENDED_SHOWN:]
    with ThreadPoolExecutor(8) as pool:
        docs = [d for d in pool.map(lambda j: read_status(store, j), latest) if d]
    return [{"job_id": d["job_id"], "name": d["job_id"], "priority": "-", "state": d["state"],
             "submitted_at": d.get("started_at", ""), "ended_at": None, "resumed": 0,
             "error": d.get("error") or silence_note(d), **{k: d.get(k, 0) for k in _COUNTED}} for d in docs]


def cancel_in_store(store: str | Store | None, job_id: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """`farm cancel --store`, with no Ray: the request goes in the store's inbox and the service
    answers there ({"job_id", "units_stopped"}); ServiceRefused with what it said otherwise."""
    import time

    s = open_store(store, create=False)
    inbox = ServiceInbox(s)
    if inbox.alive() is None:
        raise ServiceRefused(f"no farm service watches {s.uri} (no heartbeat in its store); nothing was cancelled")
    try:
        inbox.post_cancel(job_id)
    except ValueError as e:
        raise ServiceRefused(f"no job {job_id!r}: {e}") from None
    deadline = time.monotonic() + timeout_s
    while (said := inbox.answer(job_id)) is None:
        if time.monotonic() > deadline:
            raise ServiceRefused(f"the farm service on {s.uri} did not answer within {timeout_s:g}s; the request "
                                 f"stays in its inbox, and `farm jobs --store {s.uri}` shows whether it was taken")
        time.sleep(0.25)  # a read per look: on S3 a billed request, as the service's own inbox poll (0.5 s)
    if "error" in said:
        raise ServiceRefused(said["error"])
    return said


def find(address: str | None, store: str | Store | None) -> Service | None:
    """The farm service to hand a job to: the one whose heartbeat is in the store (named, FARM_STORE,
    or with no cluster named, the default), reached through the inbox; else the one on the
    cluster at address (or RAY_ADDRESS): through its store's inbox too where this process can
    read that store, else through Ray; None if neither. Raises JoinFailed where nothing answers
    at the address."""
    address = address or os.environ.get("RAY_ADDRESS")
    if store is not None or os.environ.get("FARM_STORE") or not address:
        found = _beating(open_store(store))
    else:
        found = _inbox_of_cluster(address)
    return found if found is not None else connect(address)


def _beating(store: Store) -> Service | None:
    beat = ServiceInbox(store).alive()
    return None if beat is None else Service(None, {**beat, "store": store.uri})


def _inbox_of_cluster(address: str) -> Service | None:
    """The service on the cluster at address, through its store's inbox, if this process reaches
    that store and it shows the service's heartbeat. The store is the one this machine found for
    that address before (FARM_KNOWN_SERVICES, default ~/.cache/pt2-farm/services.json) if the
    heartbeat there names the same cluster: no Ray imported at all. Else the one the service left
    in the cluster's KV (scheduler/ray_service.py). A local store that is not on this machine is
    not opened (opening would create it here)."""
    known = _known_services()
    remembered = known.get(address)
    if isinstance(remembered, dict) and isinstance(remembered.get("store"), str):
        found = _beating_at(remembered["store"])
        if found is not None and found.info.get("cluster") == remembered.get("cluster"):
            return found
    from scheduler.gcs_kv import Unread, read_service_store

    try:
        asked = read_service_store(address)  # gRPC alone: no Ray imported
    except Unread:
        from scheduler.ray_session import service_store

        asked = service_store(address)  # Ray's client: loopback clusters, and JoinFailed saying why
    if asked is None:
        return None
    found = _beating_at(asked[0])
    if found is None or found.info.get("cluster") != asked[1]:
        return None  # out of reach here, or watched by another cluster's service: the named one answers through Ray
    known.pop(address, None)
    known[address] = {"store": asked[0], "cluster": asked[1]}
    _remember(dict(list(known.items())[-KNOWN_MAX:]))  # the latest found
    return found


def _beating_at(uri: str) -> Service | None:
    if uri.startswith("file://") and not Path(uri.removeprefix("file://")).is_dir():
        return None
    try:
        return _beating(open_store(uri))
    except Exception:  # no credentials for it here, or it does not answer: Ray is the other way in
        return None


KNOWN_MAX = 32  # clusters remembered


def _known_file() -> Path:
    return Path(os.environ.get("FARM_KNOWN_SERVICES") or "~/.cache/pt2-farm/services.json").expanduser()


def _known_services() -> dict[str, Any]:
    """address → {store, cluster}: where this machine found each cluster's farm service (a hint,
    checked against the service's heartbeat before use)."""
    try:
        known = json.loads(_known_file().read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _remember(known: dict[str, Any]) -> None:
    path = _known_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, path)
    except OSError:
        pass  # a hint only: the next submit reads the cluster's KV again


def connect(address: str | None) -> Service | None:
    """The farm service on the cluster at address (or RAY_ADDRESS), or None if none runs there.
    Raises scheduler.ray_session.JoinFailed when the cluster cannot be joined."""
    from scheduler.ray_service import call, find_service
    from scheduler.ray_session import ray_session

    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        return None
    with ray_session(address, keep=True):
        actor = find_service()
        return None if actor is None else Service(actor, call(actor, "ping"))
