"""The Redis protocol (RESP2, and of RESP3 what a client that asks for it with HELLO 3 reads of
GET, SET and HELLO: its null and its map), as much as a Redis client's GET and SET need: requests
are arrays of bulk strings, replies simple strings, errors, integers, bulk strings, arrays and
maps (https://redis.io/docs/latest/develop/reference/protocol-spec/). redis-py 8 asks for RESP3
when it authenticates; earlier ones speak RESP2.

Hand-written because no parser on the registry fits a server that faces untrusted clients:
hiredis and redis-py parse replies, not requests, and bound nothing. This one reads from an
asyncio stream and bounds everything before it reads it: a line's length, an array's length, a
bulk string's length (`Limits`). A request that breaks them, or the protocol, raises
`ProtocolError`, after which the connection is closed (the stream's position is lost).
Tested with malformed and random input (tests/test_resp.py).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass


class ProtocolError(Exception):
    """The request breaks RESP or a limit; the server answers with an error and closes."""


@dataclass(frozen=True)
class Limits:
    line_bytes: int = 1024  # a `*<n>` or `$<n>` header line
    args: int = 16  # elements of one request (SET key value EX 60 ... fits)
    arg_bytes: int = 64 << 20  # one bulk string: a value; set from the server's value limit
    total_bytes: int = 64 << 20  # all of one request's bulk strings together


async def read_request(reader: asyncio.StreamReader, limits: Limits) -> list[bytes] | None:
    """One request's arguments, or None at a clean end of the stream (between requests)."""
    try:
        header = await reader.readuntil(b"\r\n")
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise ProtocolError("the connection closed inside a request") from None
    except asyncio.LimitOverrunError:
        raise ProtocolError(f"a request line is longer than {limits.line_bytes} bytes") from None
    if len(header) > limits.line_bytes:
        raise ProtocolError(f"a request line is longer than {limits.line_bytes} bytes")
    if not header.startswith(b"*"):
        raise ProtocolError("expected an array of bulk strings ('*'); inline commands are not served")
    count = _length(header, limits.args, "an array")
    args: list[bytes] = []
    total = 0
    for _ in range(count):
        line = await _line(reader, limits)
        if not line.startswith(b"$"):
            raise ProtocolError("expected a bulk string ('$') in the request's array")
        size = _length(line, limits.arg_bytes, "a bulk string")
        total += size
        if total > limits.total_bytes:
            raise ProtocolError(f"a request of more than {limits.total_bytes} bytes is over the limit")
        try:
            data = await reader.readexactly(size + 2)
        except asyncio.IncompleteReadError:
            raise ProtocolError("the connection closed inside a bulk string") from None
        if data[-2:] != b"\r\n":
            raise ProtocolError("a bulk string is not followed by CRLF")
        args.append(data[:-2])
    if not args:
        raise ProtocolError("an empty request")
    return args


async def _line(reader: asyncio.StreamReader, limits: Limits) -> bytes:
    try:
        line = await reader.readuntil(b"\r\n")
    except asyncio.IncompleteReadError:
        raise ProtocolError("the connection closed inside a request") from None
    except asyncio.LimitOverrunError:
        raise ProtocolError(f"a request line is longer than {limits.line_bytes} bytes") from None
    if len(line) > limits.line_bytes:
        raise ProtocolError(f"a request line is longer than {limits.line_bytes} bytes")
    return line


def _length(line: bytes, most: int, what: str) -> int:
    digits = line[1:-2]
    if not digits.isdigit() or len(digits) > 19:
        raise ProtocolError(f"the length of {what} is not a number: {line[:40]!r}")
    n = int(digits)
    if n > most:
        raise ProtocolError(f"{what} of {n} {'elements' if what == 'an array' else 'bytes'} is over the limit of {most}")
    return n


# replies ---------------------------------------------------------------------------
def simple(text: str) -> bytes:
    return b"+" + _one_line(text) + b"\r\n"


def error(text: str) -> bytes:
    """An error reply: its first word is its kind (ERR, NOAUTH, NOPERM, WRONGPASS...)."""
    return b"-" + _one_line(text) + b"\r\n"


def integer(n: int) -> bytes:
    return b":%d\r\n" % n


def bulk(data: bytes | None, proto: int = 2) -> bytes:
    if data is None:
        return b"_\r\n" if proto == 3 else b"$-1\r\n"
    return b"$%d\r\n" % len(data) + data + b"\r\n"


def array(items: list[bytes]) -> bytes:
    """An array of already-encoded replies."""
    return b"*%d\r\n" % len(items) + b"".join(items)


def mapping(pairs: list[tuple[bytes, bytes]], proto: int = 2) -> bytes:
    """Already-encoded key and value replies: a map in RESP3, a flat array in RESP2."""
    flat = b"".join(k + v for k, v in pairs)
    return (b"%%%d\r\n" % len(pairs) if proto == 3 else b"*%d\r\n" % (2 * len(pairs))) + flat


def _one_line(text: str) -> bytes:
    return text.replace("\r", " ").replace("\n", " ").encode("utf-8", "replace")
