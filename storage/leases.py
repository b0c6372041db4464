"""Leases: who is compiling a key right now, so that concurrent jobs compile each key once.

A lease is a series of generations, ``leases/<key>/<generation>.json``, each created with
the backend's conditional write, so of two workers racing for one generation exactly one
wins, on S3 as on a local disk. The holder renews its generation by rewriting it with a
growing beat count. A watcher decides that a holder is gone when the beat has not moved for
`ttl_s` *by the watcher's own clock* (no clock on another machine is trusted), and then
takes the next generation. A holder that was taken over may still finish; manifests are
published with a conditional write, so the worst case is one duplicate compile, never a
clobbered manifest.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, TypeVar

from storage.backend import Backend, StoreError

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaseInfo:
    key: str
    generation: int
    holder: str
    beat: int
    acquired_at: str

    @property
    def state(self) -> tuple[int, int]:
        """What a watcher compares over time: it changes whenever the holder shows life."""
        return self.generation, self.beat


def _lease_path(key: str, generation: int) -> str:
    return f"leases/{key}/{generation:010d}.json"


class Lease:
    """A lease this process holds. Use as a context manager: it renews itself every
    `interval_s` until released."""

    def __init__(self, leases: "Leases", info: LeaseInfo, interval_s: float):
        self._leases, self.info, self._interval = leases, info, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name=f"lease-{info.key[:12]}", daemon=True)
        self.superseded = False

    def __enter__(self) -> "Lease":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.renew()
            except (StoreError, OSError, ValueError, TypeError) as e:  # I/O, or a lease file we cannot read
                # a missed beat only risks a takeover; the compile goes on, and the operator hears of it
                log.warning("lease %s: heartbeat failed (%s: %s); a waiter may take the key over",
                            self.info.key[:16], type(e).__name__, e)

    def renew(self) -> bool:
        """Show life; False once a later generation exists (someone took the key over)."""
        current = self._leases.current(self.info.key)
        if current is not None and current.generation > self.info.generation:
            self.superseded = True
            return False
        self.info = LeaseInfo(**{**asdict(self.info), "beat": self.info.beat + 1})
        self._leases.backend.write(_lease_path(self.info.key, self.info.generation), _encode(self.info))
        return True

    def release(self) -> None:
        """Stop renewing and delete the lease. A failed delete is logged, never raised: what the
        lease guarded is done (published, or failed), and a lease left behind only makes the
        next claimant wait ttl_s before it takes over."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        try:
            self._leases.backend.delete(_lease_path(self.info.key, self.info.generation))
        except (StoreError, OSError) as e:
            _LEFT_BEHIND.add((self.info.key, self.info.generation, self.info.holder))
            log.warning("lease %s: release failed (%s: %s); it expires %gs after its last beat, or at once "
                        "when this process claims the key again", self.info.key[:16], type(e).__name__, e,
                        self._leases.ttl_s)


class Leases:
    def __init__(self, backend: Backend, holder: str, ttl_s: float = 60.0):
        self.backend, self.holder, self.ttl_s = backend, holder, ttl_s

    def current(self, key: str) -> LeaseInfo | None:
        """The newest generation of key's lease, or None if nobody holds it."""
        for _ in range(3):  # a generation can be released between listing and reading it
            paths = sorted(self.backend.list(f"leases/{key}/"))
            if not paths:
                return None
            data = self.backend.read(paths[-1])
            if data is not None:
                return LeaseInfo(**json.loads(data))
        return None

    def try_acquire(self, key: str, generation: int) -> Lease | None:
        """Create this generation of the lease; None if another worker created it first."""
        info = LeaseInfo(key, generation, self.holder, 0, dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
        mine = _lease_path(key, generation)
        if not self.backend.write(mine, _encode(info), if_absent=True) and self.backend.read(mine) != _encode(info):
            return None  # (the same bytes: our own write, answered 'exists' when attempted again after a lost reply)
        for path in list(self.backend.list(f"leases/{key}/")):
            if path < mine:  # generations of holders that stopped: gone for good
                self.backend.delete(path)
        return Lease(self, info, interval_s=max(self.ttl_s / 4, 0.2))

    def claim(self, key: str, published: Callable[[], T | None], on_wait: Callable[[LeaseInfo], None] = lambda i: None,
              poll_s: float = 1.0, wait_s: float | None = None) -> Lease | T | None:
        """Either the lease on key (the caller compiles it) or what `published` returns once
        another worker has published the key (the caller compiles nothing); with `wait_s`, None
        once it has waited that long on a live holder (the caller compiles without the lease).

        A holder that stops renewing for ttl_s is taken over; a holder that releases without
        publishing (its compile failed) leaves the key to the next claimant."""
        seen: LeaseInfo | None = None
        seen_since = time.monotonic()
        give_up = None if wait_s is None else time.monotonic() + wait_s
        next_generation = 0
        while True:
            done = published()
            if done is not None:
                return done
            current = self.current(key)
            if current is None:
                lease = self.try_acquire(key, next_generation)
            elif (key, current.generation, current.holder) in _LEFT_BEHIND:  # released here, its delete failed
                lease = self.try_acquire(key, current.generation + 1)
            elif seen is not None and current.state == seen.state and time.monotonic() - seen_since > self.ttl_s:
                lease = self.try_acquire(key, current.generation + 1)  # its holder stopped renewing
            elif gone_from_this_host(current.holder):
                lease = self.try_acquire(key, current.generation + 1)  # its holder died here: no need to wait
            else:
                if seen is None or current.state != seen.state:
                    if seen is None or current.generation != seen.generation:
                        on_wait(current)
                    seen, seen_since = current, time.monotonic()
                next_generation = current.generation + 1
                if give_up is not None and time.monotonic() > give_up:
                    return None
                time.sleep(min(poll_s, self.ttl_s / 4))
                continue
            if lease is None:  # lost the race for that generation: watch the winner
                continue
            done = published()  # the last holder may have published just before we got here
            if done is not None:
                lease.release()
                return done
            return lease


# Leases this process released but could not delete (the store was unreachable): no one holds
# them, so this process's next claim of the key takes over at once instead of waiting ttl_s.
_LEFT_BEHIND: set[tuple[str, int, str]] = set()


def holder_here() -> str:
    """A holder name for this process: `<host>/pid-<pid>/<token>`, which `gone_from_this_host` reads."""
    return f"{socket.gethostname()}/pid-{os.getpid()}/{secrets.token_hex(3)}"


def gone_from_this_host(holder: str) -> bool:
    """Whether a holder named `<host>/pid-<pid>/<token>` ran on this host and its process is gone
    (a worker killed mid-compile, whose unit is run again here): then its lease is taken over at
    once instead of after ttl_s. A pid reused since only means waiting ttl_s, as for any holder;
    a holder on another host, or in another PID namespace under this host's name, is judged by
    its beat alone, except in the last case, where the worst is one duplicate compile."""
    host, _, rest = holder.partition("/")
    pid = rest.partition("/")[0].removeprefix("pid-")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _encode(info: LeaseInfo) -> bytes:
    return json.dumps(asdict(info)).encode()
