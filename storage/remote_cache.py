"""PyTorch's remote caches (FX graph, AOTAutograd, autotune) kept in the farm's store, for
`farm cache-serve` (storage/cache_server.py): each entry is a content-addressed blob (its value)
and a small index document that names it, at

    remote-cache/<cache-id>/<h[:2]>/<h>.json      h = sha256 of the client's key

where <cache-id> is the part of torch's key `pt2:<cache-id>::<key>:c1` that says which cache
(`fx-graph-v1`, `autograd-shared-v1`, ...): `farm du` and `farm gc` see entries by cache kind.
An index document's mtime is the entry's last use, renewed by a read at most once per refresh
age (as units' manifests are), and `farm gc` removes entries unused for its `unused_days`, then
the blobs nothing else names (storage/gc.py).

Values are torch's own: JSON around base64 pickles, which a reader unpickles. Whoever may write
here runs code in every reader: see storage/cache_tokens.py and the README.
"""
from __future__ import annotations

import collections
import hashlib
import logging
import re
import threading
from typing import Any

from storage.backend import StoreError
from storage.store import BlobRef, Store

log = logging.getLogger(__name__)

PREFIX = "remote-cache/"
_CACHE_ID = re.compile(rb"pt2:([A-Za-z0-9_.-]{1,64})::")
REFRESH_AGE_S = 3600.0  # a use renews an entry's mark at most this often


def kind_of(key: bytes) -> str:
    """Which of torch's caches a key is for (`fx-graph-v1`, ...), or `other`."""
    m = _CACHE_ID.match(key)
    return m.group(1).decode() if m else "other"


def index_path(key: bytes) -> str:
    h = hashlib.sha256(key).hexdigest()
    return f"{PREFIX}{kind_of(key)}/{h[:2]}/{h}.json"


class CacheEntries:
    """GET and SET of torch's remote-cache entries in a store (thread-safe: the server's threads
    share one)."""

    def __init__(self, store: Store, refresh_age_s: float = REFRESH_AGE_S):
        self.store, self.refresh_age_s = store, refresh_age_s
        self._renewed: dict[str, float] = {}
        self._stats: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self._lock = threading.Lock()

    def get(self, key: bytes) -> bytes | None:
        """The value, or None for a miss. An entry that fails the store's signature check
        (FARM_VERIFY_KEY), or whose value is gone or corrupt, is a miss too, and counted refused."""
        path, kind = index_path(key), kind_of(key)
        try:
            doc = self.store.get_document(path)
            if doc is None or doc.get("key") != key.decode("utf-8", "surrogateescape"):
                self._count(kind, "misses")  # absent, or (never in practice) another key with its hash
                return None
            value = self.store.get_bytes(BlobRef.from_dict(doc["blob"]).digest)
        except (StoreError, KeyError, TypeError, ValueError) as e:
            log.warning("remote cache: %s refused, served as a miss: %s", path, e)
            self._count(kind, "refused")
            return None
        self._count(kind, "hits")
        self._count(kind, "bytes_read", len(value))
        self._renew(path)
        return value

    def put(self, key: bytes, value: bytes, writer: str) -> None:
        """Publish: the value first, then the index document naming it (a reader never sees an
        index without its value)."""
        ref = self.store.put_bytes(value)
        doc: dict[str, Any] = {"key": key.decode("utf-8", "surrogateescape"), "kind": kind_of(key),
                               "blob": ref.to_dict(), "writer": writer}
        self.store.put_document(index_path(key), doc)
        self._count(kind_of(key), "writes")
        self._count(kind_of(key), "bytes_written", len(value))

    def count_refused(self, key: bytes) -> None:
        """A request the server refused for this key (no permission, a value over the limit)."""
        self._count(kind_of(key), "refused")

    def stats(self) -> dict[str, dict[str, int]]:
        """Per cache kind: hits, misses, refused, writes, bytes_read, bytes_written."""
        with self._lock:
            return {k: dict(v) for k, v in self._stats.items()}

    def _count(self, kind: str, what: str, n: int = 1) -> None:
        with self._lock:
            self._stats[kind][what] += n

    def _renew(self, path: str) -> None:
        """The entry's last use, best effort: a store that refuses loses the mark, never the read."""
        now = self.store.clock()
        with self._lock:
            if now - self._renewed.get(path, float("-inf")) < self.refresh_age_s:
                return
            self._renewed[path] = now
        try:
            info = self.store.backend.stat(path)
            if info is not None and now - info.mtime >= self.refresh_age_s:
                self.store.backend.touch(path)
        except StoreError as e:
            log.warning("remote cache: last use of %s not recorded (%s)", path, e)
