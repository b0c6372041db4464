"""Where `use_farm_cache` reads and writes its entries: the store itself (store=), or a `farm
cache-serve` endpoint (url=), through redis-py as torch's own Redis backend.

A source that fails (the store or the server does not answer) is an outage, not a reason to stop
training: the process compiles without it, says so once, and asks again every RETRY_S, instead
of logging, and waiting on, every graph's lookup. A token the endpoint refuses is the caller's
mistake, not an outage: `EndpointSource` says so at once, as use_farm_cache starts.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Any

from farm.jit_kernels import read_files

log = logging.getLogger("farm.jit_cache")  # use_farm_cache's one logger, as users filter it

RETRY_S = 30.0  # how long a source that failed is left alone before it is asked again
CONNECT_TIMEOUT_S = 10.0  # an endpoint that does not accept the connection in this long is down
READ_TIMEOUT_S = 120.0  # nor one that sends nothing for this long (a value is at most 64 MiB)


class Source:
    """An entry is (its index document, its value, its kernels by name under Inductor's cache dir)."""

    name = ""  # what the log calls it: a store URI, or the endpoint's URL without its token
    _resting_until = 0.0  # set by `failed`: until then, `resting()`

    def entry(self, key: bytes) -> tuple[bytes, bytes, dict[str, bytes]] | None: ...

    # files: name under Inductor's cache dir -> this process's path of it
    def put(self, key: bytes, value: bytes, files: dict[str, str], facts: dict[str, Any]) -> None: ...

    def graph(self, gm: str) -> tuple[str, str, dict[str, list[str]]] | None:
        return None  # (key, writer, parts) of a graph published under another key: through store= only

    def resting(self) -> bool:
        """Whether this source failed less than RETRY_S ago (lookups are then misses, unasked)."""
        return time.monotonic() < self._resting_until

    def failed(self, error: BaseException) -> None:
        """`error` came from this source: leave it alone for RETRY_S, said once per outage."""
        if not self._resting_until:
            log.warning("farm cache: %s failed (%s: %s): this process compiles without it, and asks it again "
                        "every %gs", self.name, type(error).__name__, error, RETRY_S)
        self._resting_until = time.monotonic() + RETRY_S

    def answered(self) -> None:
        """A lookup went through: an outage, if there was one, is over."""
        if self._resting_until:
            log.warning("farm cache: %s answers again", self.name)
            self._resting_until = 0.0


class StoreSource(Source):
    def __init__(self, store: Any):
        from storage.remote_cache import CacheEntries

        self.name = store.uri
        self.entries = CacheEntries(store)
        self.writer = f"use_farm_cache@{os.uname().nodename}"
        self._put_files: dict[str, Any] = {}  # name -> its blob: each FX entry names every kernel loaded so far

    def entry(self, key: bytes) -> tuple[bytes, bytes, dict[str, bytes]] | None:
        found = self.entries.entry(key, verify=False, outages_raise=True)  # checked by jit_cache._problem
        if found is None:
            return None
        raw, doc, value = found
        return raw, value, self.entries.files(doc)

    def put(self, key: bytes, value: bytes, files: dict[str, str], facts: dict[str, Any]) -> None:
        """A file is read and uploaded once per process (its name is its content's hash), however
        many later entries name it."""
        new = read_files({n: p for n, p in files.items() if n not in self._put_files})
        self._put_files.update((n, self.entries.store.put_bytes(data)) for n, data in new.items())
        self.entries.put(key, value, self.writer, {n: self._put_files[n] for n in files if n in self._put_files}, facts)

    def note_graph(self, key: bytes, parts: dict[str, list[str]]) -> None:
        """Which key this graph (its `gm` part) was last published under, and what went into it."""
        self.entries.note_graph(parts["gm"][0], key, json.dumps(parts).encode(), self.writer)

    def graph(self, gm: str) -> tuple[str, str, dict[str, list[str]]] | None:
        found = self.entries.graph(gm)
        return None if found is None else (found[0], found[1], json.loads(found[2]))


class EndpointSource(Source):
    def __init__(self, url: str, name: str, write: bool = False):
        """Connected and authenticated at once: a token the server refuses, or a `read` user given
        to write, raises ValueError (the caller's to fix); a server that does not answer is an
        outage (`failed`)."""
        import redis  # redis-py, as torch's own Redis backend needs

        self.name = name
        self.client = redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                           socket_timeout=READ_TIMEOUT_S)
        self.user = self.client.connection_pool.connection_kwargs.get("username")  # None: the URL names none
        self._refused = redis.ResponseError
        self._sent: dict[str, bytes] = {}  # kernel name → its blob in the store, once its bytes went
        try:
            self.client.ping()
            role = self._role() if write else b"write"
        except (redis.AuthenticationError, redis.ResponseError) as e:  # the first a ConnectionError to redis-py
            raise ValueError(self._refused_because(e)) from None
        except (redis.ConnectionError, redis.TimeoutError) as e:
            self.failed(e)
            return
        if role != b"write":  # else every put is refused, and a reader's value cuts its connection
            raise ValueError(f"use_farm_cache: write=True, but {name} lets user {self.user!r} only {role.decode()}; "
                             f"give a user of role write in the server's tokens file, or leave write unset to read")

    def _role(self) -> bytes:
        """The user's role as the server says; `write` where the server is older than FARM.WHOAMI
        (its puts are then refused one by one if the user only reads, as before the question)."""
        import redis

        try:
            return self.client.execute_command("FARM.WHOAMI")[1]
        except redis.ResponseError as e:
            if "unknown command" not in str(e):
                raise
            log.warning("farm cache: %s is older than this client and cannot say whether user %r may write "
                        "(it has no FARM.WHOAMI); writing, as asked: upgrade it to have a read user refused here",
                        self.name, self.user)
            return b"write"

    def _refused_because(self, error: Exception) -> str:
        if not self.user:
            return (f"use_farm_cache: {self.name} asks for a user ({error}); give url= as "
                    f"redis://NAME:TOKEN@HOST:PORT with a user of the server's tokens file")
        return (f"use_farm_cache: {self.name} refused user {self.user!r} ({error}); check NAME:TOKEN in url= against "
                f"the server's tokens file (farm cache-serve --tokens)")

    def entry(self, key: bytes) -> tuple[bytes, bytes, dict[str, bytes]] | None:
        reply = self.client.execute_command("FARM.ENTRY", key)
        if reply is None:
            return None
        raw, value, files = reply
        return raw, value, {name.decode(): data for name, data in files}

    def put(self, key: bytes, value: bytes, files: dict[str, str], facts: dict[str, Any]) -> None:
        """Each kernel's bytes travel once per process; later entries that name it send its blob
        (`sha256:DIGEST:SIZE`), and all bytes again if the store no longer holds one (collected)."""
        if not files:
            self.client.set(key, value)
            return
        new = read_files({n: p for n, p in files.items() if n not in self._sent})
        try:
            self._farm_put(key, value, facts, {**{n: self._sent[n] for n in files if n in self._sent}, **new})
        except self._refused as e:
            if "which the store does not hold" not in str(e):
                raise
            self._sent.clear()
            self._farm_put(key, value, facts, read_files(files))
            new = {}
        self._sent.update((n, f"sha256:{hashlib.sha256(d).hexdigest()}:{len(d)}".encode()) for n, d in new.items())

    def _farm_put(self, key: bytes, value: bytes, facts: dict[str, Any], files: dict[str, bytes]) -> None:
        named = [part for name, data in sorted(files.items()) for part in (name.encode(), data)]
        self.client.execute_command("FARM.PUT", key, value, json.dumps(facts).encode(), *named)
