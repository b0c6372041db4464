"""`farm cache-serve`: the farm's store behind enough of the Redis protocol for PyTorch's own
remote caches (torch/_inductor/remote_cache.py's RedisRemoteCacheBackend, through redis-py):
PING, AUTH, HELLO (protocol 2, and 3 for redis-py 8), QUIT, SELECT 0, CLIENT SETNAME/SETINFO,
GET and SET; and for `farm.client.use_farm_cache`, FARM.ENTRY key (the entry's index document
as stored, with its signature, which that client checks; its value; the compiled kernels it
names) and FARM.PUT key value facts [name data]... (a writer's SET with those kernels; a file's
data may instead be `sha256:DIGEST:SIZE`, a blob the store already holds, so a writer sends each
kernel once however many of its entries name it), and FARM.WHOAMI (the user's name and role). Values
live in the store (storage/remote_cache.py); who may read or write, in a tokens file
(storage/cache_tokens.py).

Every client is hostile until it has authenticated: before AUTH it may send only requests of a
few KiB, it is closed after 30 s idle or three wrong tokens, and at most `max_clients` are
served at once. Only a writer may send a value, of at most `max_value_bytes`. A request that
breaks the protocol or a limit gets an error and its connection is closed; the server goes on
for the others. Store calls run on a small thread pool, never on the event loop.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import json
import logging
import os
import re
import socket
import ssl
import threading
from dataclasses import dataclass, field
from typing import Callable

from storage import resp
from storage.backend import StoreError
from storage.cache_tokens import User, Users
from storage.local import LocalBackend
from storage.remote_cache import KERNEL_PATH, PROBE_PATH, CacheEntries, save_stats
from storage.store import BlobRef

log = logging.getLogger(__name__)

ANON_ARG_BYTES = 4096  # AUTH and HELLO before authenticating, a GET key after: small
ANON_IDLE_S = 30.0
AUTH_TRIES = 3
STORE_THREADS = 16
STREAM_LIMIT = 1 << 16  # the stream's buffer for header lines (resp.Limits bounds them far lower)
FARM_PUT_ARGS = 2 * 1024 + 4  # FARM.PUT key value facts, and up to 1024 named files
BLOB_REF = re.compile(rb"sha256:([0-9a-f]{64}):([0-9]{1,12})")  # a file already in the store, by its blob
STATS_EVERY_S = 10.0  # how often a server's counts reach the store, when they changed
VERSION = "7.0.0"  # what HELLO says it is: the protocol torch and redis-py expect of a Redis 7


@dataclass
class _Session:
    user: User | None = None
    failed_auths: int = 0
    proto: int = 2  # 3 once the client asked for it with HELLO 3 (redis-py 8 does)


_SMALL = resp.Limits(arg_bytes=ANON_ARG_BYTES)


@dataclass
class CacheServer:
    entries: CacheEntries
    users: Users
    host: str = "127.0.0.1"
    port: int = 0
    max_value_bytes: int = 64 << 20
    max_clients: int = 1024
    tls: ssl.SSLContext | None = None
    clients: int = 0
    _pool: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(STORE_THREADS, thread_name_prefix="cache-store"))
    _loop: asyncio.AbstractEventLoop | None = None
    _server: asyncio.base_events.Server | None = None
    _thread: threading.Thread | None = None
    stats_every_s: float = STATS_EVERY_S
    _saver: asyncio.Task | None = None
    started_at: str = field(default_factory=lambda: dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
    _open: dict = field(default_factory=dict)  # each client's task → its writer: cut off as the server stops

    def _limits(self, session: _Session) -> resp.Limits:
        """Only a writer may send a value (and, with FARM.PUT, the kernels beside it: as many
        bytes again); everyone else, requests of a few KiB."""
        if session.user is not None and session.user.writes:
            return resp.Limits(args=FARM_PUT_ARGS, arg_bytes=self.max_value_bytes, total_bytes=2 * self.max_value_bytes)
        return _SMALL

    # running ------------------------------------------------------------------------
    async def start(self) -> tuple[str, int]:
        """Listen, and write what it served to the store every `stats_every_s` when it changed
        (`farm cache-stats`), and once more as it stops."""
        self._server = await asyncio.start_server(self._client, self.host, self.port, limit=STREAM_LIMIT, ssl=self.tls)
        self.port = self._server.sockets[0].getsockname()[1]
        self._saver = asyncio.create_task(self._save_stats_every(self.stats_every_s))
        return self.host, self.port

    async def serve_forever(self, listening: Callable[[str, int], None] | None = None) -> None:
        """Serve until cancelled; `listening` is told the address once it listens (the port the
        system chose, for port 0), not before: a port in use raises OSError first."""
        await self.start()
        if listening is not None:
            listening(self.host, self.port)
        try:
            async with self._server:
                await self._server.serve_forever()
        finally:
            self._saver.cancel()
            await self._store(self.save_stats)

    async def _save_stats_every(self, seconds: float) -> None:
        last = None
        while True:
            await asyncio.sleep(seconds)
            now = self.entries.stats()
            if now != last:
                await self._store(self.save_stats)
                last = now

    def save_stats(self) -> None:
        try:
            save_stats(self.entries.store, self.name, self.entries.stats(), self.started_at)
        except StoreError as e:
            log.warning("cache-serve: its counts not written to the store (%s)", e)

    @property
    def name(self) -> str:
        return f"{socket.gethostname()}-{self.port}-{os.getpid()}"

    def start_in_thread(self) -> tuple[str, int]:
        """Serve from a thread of this process (tests, embedding); `stop` ends it."""
        started = concurrent.futures.Future()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            try:
                started.set_result(self._loop.run_until_complete(self.start()))
                self._loop.run_forever()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                if not started.done():
                    started.set_exception(e)
            finally:
                self._loop.close()

        self._thread = threading.Thread(target=run, name="farm cache-serve", daemon=True)
        self._thread.start()
        return started.result(timeout=30)

    def stop(self) -> None:
        if self._loop is not None and self._server is not None:
            async def close() -> None:
                self._saver.cancel()
                await asyncio.gather(self._saver, return_exceptions=True)
                self._server.close()
                for writer in list(self._open.values()):
                    writer.transport.abort()  # its task then reads the end of its stream, and ends
                await asyncio.gather(*self._open, return_exceptions=True)
                await self._server.wait_closed()
                self._loop.stop()
            asyncio.run_coroutine_threadsafe(close(), self._loop)
            self._thread.join(timeout=10)
        self.save_stats()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # one client ---------------------------------------------------------------------
    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.clients >= self.max_clients:
            writer.write(resp.error("ERR max number of clients reached"))
            await _close(writer)
            return
        self.clients += 1
        self._open[asyncio.current_task()] = writer
        session = _Session()
        try:
            while True:
                try:
                    read = resp.read_request(reader, self._limits(session))
                    args = await (read if session.user else asyncio.wait_for(read, ANON_IDLE_S))
                except resp.ProtocolError as e:
                    writer.write(resp.error(f"ERR Protocol error: {e}"))
                    break
                except asyncio.TimeoutError:
                    writer.write(resp.error(f"ERR no AUTH within {ANON_IDLE_S:g}s; closing"))
                    break
                if args is None:
                    break
                try:
                    reply, done = await self._answer(args, session)
                except Exception as e:  # noqa: BLE001 - a bug or a store error here ends this client, not the server
                    log.exception("cache-serve: %s failed", args[0][:20])
                    writer.write(resp.error(f"ERR the farm cache failed ({type(e).__name__}); see its log"))
                    break
                writer.write(reply)
                await writer.drain()
                if done:
                    break
        except (ConnectionError, OSError):
            pass  # the client went away, mid-value or between requests
        finally:
            self.clients -= 1
            self._open.pop(asyncio.current_task(), None)
            await _close(writer)

    async def _answer(self, args: list[bytes], session: _Session) -> tuple[bytes, bool]:
        """The reply to one request, and whether to close after it."""
        command = args[0].upper()
        if command == b"QUIT":
            return resp.simple("OK"), True
        if command == b"AUTH":
            return self._auth(args[1:], session)
        if command == b"HELLO":
            return self._hello(args[1:], session)
        if session.user is None:
            return resp.error("NOAUTH Authentication required."), False
        if command == b"PING":
            return (resp.bulk(args[1]) if len(args) > 1 else resp.simple("PONG")), False
        if command == b"SELECT":
            ok = args[1:] == [b"0"]
            return (resp.simple("OK") if ok else resp.error("ERR DB index is out of range")), False
        if command == b"CLIENT" and len(args) > 1 and args[1].upper() in (b"SETNAME", b"SETINFO"):
            return resp.simple("OK"), False
        if command == b"GET" and len(args) == 2:
            value = await self._read(self.entries.get, args[1])
            return resp.bulk(value, session.proto), False
        if command == b"SET" and len(args) >= 3:
            return await self._set(args[1:], session)
        if command == b"FARM.PUT" and len(args) >= 4 and len(args) % 2 == 0:  # key value facts (name data)...
            return await self._farm_put(args[1:], session)
        if command == b"FARM.ENTRY" and len(args) == 2:  # use_farm_cache: the signed index document too
            found = await self._read(self.entries.entry, args[1])
            if found is None:
                return resp.bulk(None, session.proto), False
            files = await self._read(self.entries.files, found[1])
            named = [resp.array([resp.bulk(n.encode()), resp.bulk(d)]) for n, d in sorted(files.items())]
            return resp.array([resp.bulk(found[0]), resp.bulk(found[2]), resp.array(named)]), False
        if command == b"FARM.WHOAMI" and len(args) == 1:  # use_farm_cache(write=True) asks before it writes
            return resp.array([resp.bulk(session.user.name.encode()), resp.bulk(session.user.role.encode())]), False
        if command in (b"GET", b"SET"):
            return resp.error(f"ERR wrong number of arguments for '{command.decode().lower()}' command"), False
        shown = args[0][:40].decode("utf-8", "replace")
        return resp.error(f"ERR unknown command '{shown}'; this farm cache serves GET and SET (farm cache-serve)"), False

    def _auth(self, args: list[bytes], session: _Session) -> tuple[bytes, bool]:
        if len(args) not in (1, 2):
            return resp.error("ERR wrong number of arguments for 'auth' command"), False
        name, token = (b"default", args[0]) if len(args) == 1 else args
        user = self.users.check(name.decode("utf-8", "replace"), token.decode("utf-8", "replace"))
        if user is None:
            session.failed_auths += 1
            log.warning("cache-serve: a wrong token for user %r", name[:64].decode("utf-8", "replace"))
            return (resp.error("WRONGPASS invalid username-password pair or user is disabled."),
                    session.failed_auths >= AUTH_TRIES)
        session.user = user
        return resp.simple("OK"), False

    def _hello(self, args: list[bytes], session: _Session) -> tuple[bytes, bool]:
        if args and args[0] not in (b"2", b"3"):
            return resp.error("NOPROTO sorry, this protocol version is not supported."), False
        rest = args[1:]
        while rest:
            option = rest[0].upper()
            if option == b"AUTH" and len(rest) >= 3:
                reply, close = self._auth(rest[1:3], session)
                if session.user is None:
                    return reply, close
                rest = rest[3:]
            elif option == b"SETNAME" and len(rest) >= 2:
                rest = rest[2:]
            else:
                return resp.error("ERR Syntax error in HELLO option"), False
        if session.user is None:
            return resp.error("NOAUTH HELLO must be called with the client already authenticated, otherwise the "
                              "HELLO <proto> AUTH <user> <pass> option can be used to authenticate the client"), False
        if args:
            session.proto = int(args[0])
        fields = {"server": "redis", "version": VERSION, "proto": session.proto, "id": 0, "mode": "standalone",
                  "role": "master"}
        pairs = [(resp.bulk(k.encode()), resp.integer(v) if isinstance(v, int) else resp.bulk(v.encode()))
                 for k, v in fields.items()]
        return resp.mapping(pairs + [(resp.bulk(b"modules"), resp.array([]))], session.proto), False

    async def _set(self, args: list[bytes], session: _Session) -> tuple[bytes, bool]:
        key, value, options, user = args[0], args[1], [o.upper() for o in args[2:]], session.user
        if not user.writes:
            self.entries.count_refused(key)
            return resp.error(f"NOPERM User {user.name} has no permissions to run the 'set' command "
                              f"(its role is read)"), False
        only_new = b"NX" in options
        i = 0
        while i < len(options):  # expiries are accepted and not kept: entries go with `farm gc`
            if options[i] in (b"NX", b"XX", b"KEEPTTL"):
                i += 1
            elif options[i] in (b"EX", b"PX", b"EXAT", b"PXAT") and i + 1 < len(options) and options[i + 1].isdigit():
                i += 2
            else:
                return resp.error("ERR syntax error"), False
        if b"XX" in options or only_new:
            present = await self._store(self.entries.get, key) is not None
            if present == only_new:
                return resp.bulk(None, session.proto), False
        try:
            await self._store(self.entries.put, key, value, user.name)
        except StoreError as e:
            log.warning("cache-serve: a SET of %d bytes not stored: %s", len(value), e)
            return resp.error(f"ERR the farm store refused the write: {e}"), False
        return resp.simple("OK"), False

    async def _farm_put(self, args: list[bytes], session: _Session) -> tuple[bytes, bool]:
        """use_farm_cache's SET: the value, what it was built with (JSON), and the compiled files a
        reader needs beside it (kernels, ISA probes), named as Inductor names them."""
        key, value, facts_json, rest = args[0], args[1], args[2], args[3:]
        if not session.user.writes:
            self.entries.count_refused(key)
            return resp.error(f"NOPERM User {session.user.name} has no permissions to run the 'farm.put' command "
                              f"(its role is read)"), False
        names = [n.decode("utf-8", "replace") for n in rest[0::2]]
        bad = [n for n in names if not (KERNEL_PATH.fullmatch(n) or PROBE_PATH.fullmatch(n))]
        try:
            facts = json.loads(facts_json)
        except ValueError:
            facts = None
        if bad or not isinstance(facts, dict):
            self.entries.count_refused(key)
            what = f"file names that are not Inductor's ({bad[0][:60]!r})" if bad else "facts that are not a JSON object"
            return resp.error(f"ERR FARM.PUT with {what}"), False
        try:
            files = await self._store(self._files, dict(zip(names, rest[1::2])))
            if isinstance(files, str):
                return resp.error(f"ERR FARM.PUT names {files}, which the store does not hold: send its bytes"), False
            await self._store(self.entries.put, key, value, session.user.name, files, facts)
        except StoreError as e:
            return resp.error(f"ERR the farm store refused the write: {e}"), False
        return resp.simple("OK"), False

    def _files(self, sent: dict[str, bytes]) -> dict[str, bytes | BlobRef] | str:
        """The files as sent: bytes, or a blob of the store named by `sha256:DIGEST:SIZE` (the
        name of the first one the store does not hold, instead)."""
        files: dict[str, bytes | BlobRef] = {}
        for name, data in sent.items():
            ref = BLOB_REF.fullmatch(data)
            if ref is None:
                files[name] = data
                continue
            files[name] = blob = BlobRef(ref.group(1).decode(), int(ref.group(2)))
            if not self.entries.store.has_blob(blob):
                return f"{name} as blob {blob.digest[:16]}"
        return files

    async def _store(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _read(self, fn, *args):
        """A read of the store: on a local store, here on the loop. It takes about 0.1 ms from the
        page cache, less than handing it to a thread and back, which held one client's 100 KiB
        GETs to 1,800/s on its own (2,600/s inline; bench/remote_cache.py). Other stores' reads
        (S3) and every write go to the threads."""
        if isinstance(self.entries.store.backend, LocalBackend):
            return fn(*args)
        return await self._store(fn, *args)


async def _close(writer: asyncio.StreamWriter) -> None:
    try:
        writer.close()
        await writer.wait_closed()
    except (ConnectionError, OSError):
        pass


def tls_context(cert_pem: str, key_pem: str) -> ssl.SSLContext:
    """A server context from PEM text (as a farm service's actor gets it), through files only this
    process can read, removed at once."""
    import tempfile

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    with tempfile.TemporaryDirectory(prefix="farm-cache-tls-") as d:
        cert, key = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
        for path, text in ((cert, cert_pem), (key, key_pem)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
        context.load_cert_chain(cert, key)
    return context
