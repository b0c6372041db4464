"""Why did this not hit? Keys are diffed by the components their manifests keep.

`farm explain A B` diffs two keys; `farm explain --job JOB` takes every unit of a job that
was not a hit and finds the closest key already in the store: one built from the same graph
if there is one (so a retrained checkpoint or a new compiler shows up as the difference),
else the one with the fewest differing components.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scheduler.jobs import read_keys
from storage import Store, UnknownKey
from storage.signing import UntrustedDocument
from workers.keys import diff_components

Diff = tuple[str, Any, Any]


class ExplainError(ValueError):
    """The key or job asked about is not in the store; the message says where to look."""


def manifest_of(store: Store, key: str) -> dict[str, Any]:
    try:
        manifest = store.get_manifest(key)
    except UntrustedDocument as e:
        raise ExplainError(str(e)) from e
    if manifest is None:
        raise ExplainError(f"no manifest for key {key} in {store.uri}; `farm results JOB` lists a job's keys")
    return manifest


def _trusted_manifest(store: Store, key: str) -> dict[str, Any] | None:
    """A manifest to compare against; one that fails the signature check is no explanation."""
    try:
        return store.get_manifest(key)
    except UntrustedDocument:
        return None


def explain_keys(store: Store, a: str, b: str) -> tuple[str, str, list[Diff]]:
    try:
        ka, kb = store.resolve_key(a), store.resolve_key(b)
    except UnknownKey as e:
        raise ExplainError(str(e)) from e
    return ka, kb, diff_components(manifest_of(store, ka)["components"], manifest_of(store, kb)["components"])


@dataclass
class Miss:
    """A unit that did not simply hit: a miss, a failure, or a hit that needed a check (`note`)."""
    graph: str
    target: str
    status: str
    key: str | None
    error: str | None = None
    note: str | None = None
    closest: str | None = None
    closest_label: str | None = None
    diffs: list[Diff] = field(default_factory=list)


def _rank(mine: dict[str, Any], theirs: dict[str, Any]) -> tuple[bool, int, list[Diff]]:
    diffs = diff_components(mine, theirs)
    other_graph = any(path == "program.graph" for path, _, _ in diffs)
    return other_graph, len(diffs), diffs


def explain_job(store: Store, job_id: str) -> list[Miss]:
    entries = read_keys(store, job_id)
    if entries is None:
        raise ExplainError(f"no job {job_id} in {store.uri} (or it has not finished); `farm status {job_id}` tells")
    own = {e["key"] for e in entries}  # "closest existing key": one the job did not make itself
    known = {k: m for k in store.manifest_keys() if k not in own and (m := _trusted_manifest(store, k)) is not None}
    misses = []
    for e in entries:
        if e["status"] == "hit" and not e.get("note"):
            continue
        miss = Miss(e["graph"], e["target"], e["status"], e["key"], e.get("error"), e.get("note"))
        misses.append(miss)
        if e["status"] == "hit" or not e.get("components"):
            continue  # a hit's note, or the error of a unit that failed before it had a key, is the explanation
        ranked = sorted(((_rank(e["components"], m["components"]), k) for k, m in known.items()),
                        key=lambda r: r[0][:2])
        if ranked:
            (_, _, miss.diffs), miss.closest = ranked[0]
            closest = known[miss.closest]
            miss.closest_label = f"{closest.get('graph')}@{closest.get('target')}, built {closest.get('created_at')}"
    return misses
