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
import json
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


# The files an entry may carry, by their path under Inductor's cache dir: compiled kernels, and
# (in a per-toolchain entry of their own) Inductor's ISA probes.
KERNEL_PATH = re.compile(r"[a-z0-9]{2}/[a-z0-9]{20,80}\.main\.so")
PROBE_PATH = re.compile(r"[a-z0-9]{2}/[a-z0-9]{20,80}\.so")  # an ISA probe: not a kernel's .main.so
_PART = re.compile(r"\[(\w+)\] ([^:\n]{1,200}): (.*)", re.DOTALL)
MAX_PARTS = 400


def key_parts(lines: list[str]) -> dict[str, list[str]]:
    """What torch hashed into an FX graph key, from its debug lines (`[hash] part: value`): part →
    [hash, value shortened], as `note_graph` keeps it and a client compares it."""
    parts = {}
    for line in lines[:MAX_PARTS]:
        if (m := _PART.match(line)) is not None:
            parts[m.group(2)] = [m.group(1), " ".join(m.group(3).split())[:120]]
    return parts


FX_KIND = "fx-graph-v1"  # torch's cache ids: its FX graph cache…
AUTOGRAD_KIND = "autograd-experimental"  # …and its AOTAutograd cache


def remote_key(kind: str, key: str) -> str:
    """The key torch's RedisRemoteCache stores an entry of cache `kind` under."""
    return f"pt2:{kind}::{key}:c1"


def kind_of(key: bytes) -> str:
    """Which of torch's caches a key is for (`fx-graph-v1`, ...), or `other`."""
    m = _CACHE_ID.match(key)
    return m.group(1).decode() if m else "other"


def _graph_path(gm: str) -> str:
    if not re.fullmatch(r"[a-z0-9]{8,128}", gm):
        raise ValueError(f"not a part hash of torch's: {gm[:40]!r}")
    return f"{PREFIX}graphs/{gm[:2]}/{gm}.json"


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
        found = self.entry(key)
        return found[2] if found is not None else None

    def entry(self, key: bytes, verify: bool = True,
              outages_raise: bool = False) -> tuple[bytes, dict[str, Any], bytes] | None:
        """(the index document as stored, what it says, the value), or None for a miss (as `get`).
        The document's bytes carry its signature, for a client to check itself (FARM.ENTRY);
        `verify=False` leaves that check to the caller (use_farm_cache, which says what it refused).
        A store that fails to read the document is a miss too, unless `outages_raise` (the
        caller then stops asking it for a while: use_farm_cache)."""
        path, kind = index_path(key), kind_of(key)
        try:
            raw = self.store.backend.read(path)
        except StoreError as e:
            if outages_raise:
                raise
            return self._refused(path, kind, e)
        try:
            doc = json.loads(raw) if raw is not None else None
            if doc is not None and verify:
                doc = self.store.trust.open(path, doc)
            if not isinstance(doc, dict) and doc is not None:
                raise ValueError("the index document is not a JSON object")
            if doc is None or doc.get("key") != key.decode("utf-8", "surrogateescape"):
                self._count(kind, "misses")  # absent, or (never in practice) another key with its hash
                return None
            value = self.store.get_bytes(BlobRef.from_dict(doc["blob"]).digest)
        except (StoreError, KeyError, TypeError, ValueError) as e:
            return self._refused(path, kind, e)
        self._count(kind, "hits")
        self._count(kind, "bytes_read", len(value))
        self._renew(path)
        return raw, doc, value

    def _refused(self, path: str, kind: str, error: Exception) -> None:
        log.warning("remote cache: %s refused, served as a miss: %s", path, error)
        self._count(kind, "refused")
        return None

    def put(self, key: bytes, value: bytes, writer: str, files: dict[str, bytes | BlobRef] | None = None,
            facts: dict[str, Any] | None = None) -> None:
        """Publish: the value and `files` (compiled kernels, by their path under Inductor's cache
        dir; their bytes, or the blob of one already put) first, then the index document naming
        them (a reader never sees an index without its value); `facts`: what a reader checks
        before it uses the files (the build command)."""
        ref = self.store.put_bytes(value)
        doc: dict[str, Any] = {"key": key.decode("utf-8", "surrogateescape"), "kind": kind_of(key),
                               "blob": ref.to_dict(), "writer": writer}
        if files:
            doc["files"] = {name: (data if isinstance(data, BlobRef) else self.store.put_bytes(data)).to_dict()
                            for name, data in sorted(files.items())}
            doc["facts"] = facts or {}
        self.store.put_document(index_path(key), doc)
        self._count(kind_of(key), "writes")
        self._count(kind_of(key), "bytes_written", len(value))

    def note_graph(self, gm: str, key: bytes, parts: bytes, writer: str) -> None:
        """The key a graph (by the hash of its `gm` part in torch's key) was last published under,
        and what went into that key (a blob), so that a client that misses it under another key
        can say which part differs (use_farm_cache)."""
        ref = self.store.put_bytes(parts)
        self.store.put_document(_graph_path(gm), {"key": key.decode("utf-8", "surrogateescape"), "writer": writer,
                                                  "parts": ref.to_dict()})

    def graph(self, gm: str) -> tuple[str, str, bytes] | None:
        """(key, writer, parts) of the graph's last publish, or None."""
        try:
            doc = self.store.get_document(_graph_path(gm))
            if doc is None:
                return None
            return str(doc["key"]), str(doc.get("writer")), self.store.get_bytes(BlobRef.from_dict(doc["parts"]).digest)
        except (StoreError, KeyError, TypeError, ValueError) as e:
            log.warning("remote cache: graph %s unreadable: %s", gm[:16], e)
            return None

    def files(self, doc: dict[str, Any]) -> dict[str, bytes]:
        """The files an entry names (its kernels), each checked against its digest; one that is
        gone or corrupt is left out (its reader compiles that kernel itself)."""
        found = {}
        for name, ref in (doc.get("files") or {}).items():
            try:
                found[name] = self.store.get_bytes(BlobRef.from_dict(ref).digest)
            except (StoreError, KeyError, TypeError, ValueError) as e:
                log.warning("remote cache: %s's file %s left out: %s", doc.get("key"), name, e)
        return found

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


# what each `farm cache-serve` has served, for `farm cache-stats` (outside remote-cache/: not entries)
STATS_PREFIX = "service/cache-stats/"


def save_stats(store: Store, server: str, stats: dict[str, dict[str, int]], started_at: str) -> None:
    """One server's counts since it started, by cache kind (rewritten as they change)."""
    store.backend.write(f"{STATS_PREFIX}{server}.json", json.dumps(
        {"server": server, "started_at": started_at, "updated_at": _now(), "by_kind": stats}, indent=1).encode())


def read_stats(store: Store) -> list[dict[str, Any]]:
    """Every server's counts, oldest start first; a document that is not one is skipped."""
    found = []
    for path in sorted(store.backend.list(STATS_PREFIX)):
        try:
            doc = json.loads(store.backend.read(path) or b"null")
        except ValueError:
            continue
        if isinstance(doc, dict) and isinstance(doc.get("by_kind"), dict):
            found.append(doc)
    return sorted(found, key=lambda d: str(d.get("started_at")))


def _now() -> str:
    import datetime as dt

    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
