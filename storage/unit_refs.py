"""What a unit's manifest refers to, and the journal publishers keep of it for the collector.

The collector needs, for every manifest, the blobs it names. Reading each manifest costs one GET
(about 300 a second from one 2-core machine), so a store of 25,000 units took over a minute to
mark the first time. A publisher knows those facts as it writes the manifest: each `Store` notes
them, with the content's MD5 (S3's ETag of a single PUT), and writes them out in batches under
`gc/published/`. The collector takes an entry only where the listing's ETag matches, so a
manifest replaced, or written by anything else (an older farm, SSE-KMS, whose ETag is not the
MD5), is simply read. A lost batch (a killed process) costs reads, never a wrong mark; a forged
one could only make the collector delete blobs a manifest names, which readers then treat as an
incomplete unit (compiled again, never a broken hit), as with the collector's own index.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import logging
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable

from storage.backend import Backend, StoreError

log = logging.getLogger(__name__)

DIGEST = re.compile(r"[0-9a-f]{64}")
PREFIX = "gc/published/"
BATCH = 500  # entries per journal object
BATCH_AGE_S = 30.0  # an entry waits at most this long to be written (a worker that publishes now and then)


def digests_in(value: Any) -> Iterable[str]:
    """Every sha256 named anywhere in a JSON value: conservative, so more is kept, never less."""
    if isinstance(value, str):
        if DIGEST.fullmatch(value):
            yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from digests_in(v)
    elif isinstance(value, list):
        for v in value:
            yield from digests_in(v)


@dataclass(frozen=True)
class UnitFacts:
    """What the mark phase needs of a manifest (from the manifest, the journal or the index)."""

    target: str
    blobs: dict[str, str]  # role -> digest
    refs: frozenset[str]  # every digest it names (conservative: digests_in)

    @classmethod
    def of(cls, doc: dict[str, Any]) -> "UnitFacts":
        blobs = {str(role): str(ref["digest"]) for role, ref in (doc.get("blobs") or {}).items()
                 if isinstance(ref, dict) and isinstance(ref.get("digest"), str)}
        return cls(str(doc.get("target", "unknown")), blobs, frozenset(digests_in(doc)))

    def entry(self, etag: str) -> dict[str, Any]:
        """The compact form the journal and the collector's index keep, under the content's tag."""
        return {"e": etag, "t": self.target, "b": self.blobs, "r": sorted(self.refs)}

    @classmethod
    def from_entry(cls, entry: Any, etag: str | None) -> "UnitFacts | None":
        """The facts of a kept entry if it was made for this content (`etag`, as listed); None for
        another content, no tag, or an entry that is not well formed (it was read from the store)."""
        if not etag or not isinstance(entry, dict) or entry.get("e") != etag.strip('"'):
            return None
        try:
            return cls(str(entry["t"]), {str(r): str(d) for r, d in entry["b"].items()},
                       frozenset(d for d in map(str, entry["r"]) if DIGEST.fullmatch(d)))
        except (KeyError, TypeError, AttributeError):
            return None


class PublishJournal:
    """What one Store published, written out every BATCH entries, BATCH_AGE_S after an entry, and
    when the owner says (a job's end: scheduler/jobs.py). Not at interpreter exit: by then the
    store may be gone, and a write would wait out its retries; a batch lost costs reads only."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self._entries: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def note(self, key: str, data: bytes, manifest: dict[str, Any]) -> None:
        """The manifest `data` (its bytes, as written) was published under `key`."""
        entry = UnitFacts.of(manifest).entry(hashlib.md5(data, usedforsecurity=False).hexdigest())
        with self._lock:
            self._entries[key] = entry
            full = len(self._entries) >= BATCH
            if not full and self._timer is None:
                self._timer = threading.Timer(BATCH_AGE_S, self.flush)
                self._timer.daemon = True
                self._timer.start()
        if full:
            self.flush()

    def flush(self) -> None:
        """Write what is noted as one journal object; best effort (a lost batch only costs reads)."""
        with self._lock:
            entries, self._entries = self._entries, {}
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        if not entries:
            return
        path = f"{PREFIX}{time.time_ns():020d}-{uuid.uuid4().hex[:12]}.json.gz"
        try:
            self.backend.write(path, gzip.compress(json.dumps(entries, separators=(",", ":")).encode(), 6))
        except StoreError as e:
            log.debug("the publish journal was not written to %s (%s); the collector reads those manifests", path, e)


def read_journal(backend: Backend, paths: list[str]) -> dict[str, Any]:
    """Entries by unit key from the journal objects at `paths` (oldest first: a later entry wins);
    an unreadable object is skipped."""

    def batch(path: str) -> Any:
        try:
            data = backend.read(path)
            return json.loads(gzip.decompress(data)) if data is not None else {}
        except (OSError, ValueError, EOFError, StoreError) as e:
            log.warning("gc: the publish journal %s is unreadable (%s); reading those manifests instead", path, e)
            return {}

    entries: dict[str, Any] = {}
    with ThreadPoolExecutor(8) as pool:
        for got in pool.map(batch, sorted(paths)):
            if isinstance(got, dict):
                entries.update(got)
    return entries
