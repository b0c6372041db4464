"""Pins: units kept whatever their age, with everything they need (artifact, program, log, trace,
and their job's record when pinned by job). The collector (storage/gc.py) never takes them.

    pins/<name>.json    {"name", "label", "keys": [...], "job": JOB | null, "created_at",
                         "caches": [...]}   # PyTorch remote-cache kinds kept whole (`all`: every kind)

A pin is an ordinary store document, signed like manifests when signing is on. Its name is the
label when one is given, else the key (`farm pin KEY`) or `job-<JOB>` (`farm pin --job JOB`).
"""
from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass
from typing import Any

from storage.signing import UntrustedDocument
from storage.store import Store

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
KIND = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True)
class Pin:
    name: str
    keys: tuple[str, ...]
    label: str | None
    job: str | None
    created_at: str
    caches: tuple[str, ...] = ()  # remote-cache kinds (storage/remote_cache.py) whose entries it keeps

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> "Pin":
        return cls(str(doc["name"]), tuple(str(k) for k in doc.get("keys", [])), doc.get("label"), doc.get("job"),
                   str(doc.get("created_at", "")), tuple(str(c) for c in doc.get("caches", [])))

    def keeps_cache(self, kind: str) -> bool:
        return kind in self.caches or "all" in self.caches


def _path(name: str) -> str:
    if not NAME.fullmatch(name):
        raise ValueError(f"{name!r} cannot name a pin: use letters, digits, '.', '_' or '-' (at most 128), "
                         "starting with a letter or digit")
    return f"pins/{name}.json"


def pin(store: Store, keys: list[str], label: str | None = None, job: str | None = None) -> Pin:
    """Pin `keys` (each must have a manifest) under `label`, else under the key or the job."""
    if not keys:
        raise ValueError("nothing to pin: no keys given" + (f" (job {job} has no compiled or hit units)" if job else ""))
    name = label or (f"job-{job}" if job else keys[0] if len(keys) == 1 else None)
    if name is None:
        raise ValueError("pinning several keys needs a --label to name the pin")
    path = _path(name)
    missing = [k for k in keys if store.get_manifest(k) is None]
    if missing:
        raise ValueError(f"no manifest for {', '.join(k[:16] for k in missing)} in {store.uri}: only published units can be pinned")
    doc = {"name": name, "label": label, "keys": sorted(set(keys)), "job": job,
           "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    store.put_document(path, doc)
    return Pin.from_doc(doc)


def pin_caches(store: Store, kinds: list[str], label: str | None = None) -> Pin:
    """Keep every entry of these remote-cache kinds (`fx-graph-v1`, ..., or `all`) whatever its age."""
    bad = [k for k in kinds if not KIND.fullmatch(k)]
    if not kinds or bad:
        raise ValueError(f"name the remote-cache kinds to keep (as `farm du` lists them, or all), not {bad or 'none'}")
    name = label or f"remote-cache-{'-'.join(sorted(set(kinds)))}"
    doc = {"name": name, "label": label, "keys": [], "job": None, "caches": sorted(set(kinds)),
           "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    store.put_document(_path(name), doc)
    return Pin.from_doc(doc)


def unpin(store: Store, name: str) -> bool:
    """Remove the pin called `name`; False if there is none."""
    path = _path(name)
    if store.backend.stat(path) is None:
        return False
    store.backend.delete(path)
    return True


def pins(store: Store) -> list[Pin]:
    """Every pin, by name. One that fails the signature check still counts as a pin (the collector
    must never take more than it was asked to) and is listed with its label marked so."""
    found = []
    for path in sorted(store.backend.list("pins/")):
        try:
            doc = store.get_document(path)
        except UntrustedDocument:
            doc = store.read_unchecked(path)
            if doc is not None:
                doc["label"] = f"{doc.get('label') or ''} (signature not valid)".strip()
        if doc is not None and "name" in doc:
            found.append(Pin.from_doc(doc))
    return found
