"""What a sandbox child answers its worker on the reply pipe: a length header, then a JSON
mapping, read within a deadline and a size bound (workers/sandbox/process.py sends, child.py answers)."""
from __future__ import annotations

import json
import os
import select
import struct
import time
from typing import Any

MAX_REPLY = 64 << 20
HEADER = struct.Struct("!Q")


class SandboxFailed(Exception):
    """The child crashed, hung, ran out of a resource, or refused the input; the message says which."""

    def __init__(self, message: str, output: str = "", retryable: bool = False):
        super().__init__(message)
        self.output = output
        self.retryable = retryable


def read_reply(fd: int, deadline: float) -> dict[str, Any]:
    """The child's next reply on pipe `fd`, by the monotonic deadline."""
    header = read_exact(fd, HEADER.size, deadline)
    (size,) = HEADER.unpack(header)
    if size > MAX_REPLY:
        raise SandboxFailed(f"the sandbox sent a {size}-byte reply (limit {MAX_REPLY})")
    try:
        reply = json.loads(read_exact(fd, size, deadline))
    except ValueError as e:
        raise SandboxFailed(f"the sandbox sent a reply that is not JSON ({e})") from e
    if not isinstance(reply, dict):
        raise SandboxFailed("the sandbox sent a reply that is not a mapping")
    return reply


def read_exact(fd: int, n: int, deadline: float) -> bytes:
    chunks, got = [], 0
    while got < n:
        left = deadline - time.monotonic()
        # what is there is read even past the deadline: a child started ahead (`renew`, after
        # a job) said it was ready long before the next job's first call waits for it
        ready, _, _ = select.select([fd], [], [], min(max(left, 0.0), 1.0))
        if not ready:
            if left <= 0:
                raise SandboxFailed("timeout: no answer within the unit's time limit; the sandbox was killed")
            continue
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            raise OSError("the sandbox closed its reply pipe")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
