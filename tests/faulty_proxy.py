"""A loopback HTTP proxy in front of the test S3 server that injects faults: for a share of
requests it resets the connection (before the request reaches S3, or `cut`: after the first
bytes of the response), answers 500 or 503 with an S3 error document, or stalls the response. A short helper rather than a library: what it must do is small (one request per
connection, faults chosen per request), and the proxies on PyPI either need a server binary
(Toxiproxy) or are far larger than the job (mitmproxy).

Each request's head is read and sent on with `Connection: close`, so every connection carries
exactly one request and the proxy never parses a response; the rest of the bytes are piped.
"""
from __future__ import annotations

import asyncio
import random
import socket
import struct
import threading
from collections import Counter
from dataclasses import dataclass, field

FAULTS = ("reset", "cut", "500", "503", "stall")
_ERROR = ("<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code><Message>injected by the "
          "test's fault proxy</Message></Error>")


@dataclass
class FaultyProxy:
    upstream: tuple[str, int]
    rate: float = 0.0  # share of requests that get a fault, chosen evenly among `faults`
    faults: tuple[str, ...] = FAULTS
    stall_s: float = 2.0
    seed: int = 0
    counts: Counter = field(default_factory=Counter)  # requests, and each fault injected

    def __post_init__(self):
        self._random = random.Random(self.seed)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="faulty-s3-proxy", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "FaultyProxy":
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        # stopped: end the connections still open here, on this loop, before it closes (left to the
        # garbage collector, their coroutines closed on a closed loop: "Event loop is closed")
        server.close()
        pending = asyncio.all_tasks(self._loop)
        for task in pending:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.close()

    def _pick(self) -> str | None:
        return self._random.choice(self.faults) if self._random.random() < self.rate else None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        self.counts["requests"] += 1
        fault = self._pick()
        if fault:
            self.counts[fault] += 1
        if fault == "reset":  # the client sees its connection reset before S3 saw the request
            _reset(writer)
            return
        if fault in ("500", "503"):
            body = _ERROR.format(code="InternalError" if fault == "500" else "SlowDown").encode()
            reason = "Internal Server Error" if fault == "500" else "Slow Down"
            writer.write(f"HTTP/1.1 {fault} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
                         f"Connection: close\r\n\r\n".encode() + body)
            await writer.drain()
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:  # the server is down (a test stopped it): the client sees a reset, as it would
            _reset(writer)
            return
        up_writer.write(_one_shot(head))
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer, fault))

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, fault: str | None = None) -> None:
        try:
            first = True
            while data := await src.read(1 << 16):
                if first and fault == "stall":  # the response's first bytes arrive late: a slow read
                    await asyncio.sleep(self.stall_s)
                if first and fault == "cut":  # the response breaks off halfway through its first bytes
                    dst.write(data[:len(data) // 2])
                    await dst.drain()
                    _reset(dst)
                    return
                first = False
                dst.write(data)
                await dst.drain()
        except ConnectionError:
            pass  # the other side went away: closing below is all there is to do
        finally:
            dst.close()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (linger 0), not a polite FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _one_shot(head: bytes) -> bytes:
    """The request head with `Connection: close` (one request per connection)."""
    lines = [line for line in head.split(b"\r\n")[:-2] if not line.lower().startswith(b"connection:")]
    return b"\r\n".join(lines + [b"Connection: close", b"", b""])
