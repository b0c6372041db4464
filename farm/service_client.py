"""Talking to a farm service (`farm serve`): hand it jobs, list them, cancel them, stop it.

A job's local graphs are uploaded to the service's store first and named by digest
(`blob://sha256/...`), so the service never reads a client's paths; keys are computed in the
service's sandboxes, so nothing here imports torch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from farm.stores import open_store
from scheduler.spec import BLOB_SCHEME, JobSpec, SpecError, is_local_source, load_job, parse_job
from storage import Store


class ServiceRefused(ValueError):
    """The service refused the call (a bad spec, an unknown or ended job); the message says why."""


def absolute_store(uri: str) -> str:
    """A store URI every process on the cluster reads alike (a relative directory made absolute)."""
    return uri if "://" in uri and not uri.startswith("file://") else str(Path(uri.removeprefix("file://")).resolve())


def _same_store(a: str, b: str) -> bool:
    return absolute_store(a).rstrip("/") == absolute_store(b).rstrip("/")


@dataclass
class Service:
    actor: Any
    info: dict[str, Any]  # what its ping said: store, started_at, config

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
        from scheduler.ray_service import call

        job = job_spec(spec)
        s = self.store(store)
        doc = upload_graphs(job, s)
        if workers is not None:
            doc.setdefault("limits", {})["workers"] = workers
        said = call(self.actor, "submit", doc, priority)
        if "error" in said:
            raise ServiceRefused(said["error"])
        return said["job_id"]

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
