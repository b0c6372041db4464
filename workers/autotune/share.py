"""Sharing Inductor's autotuning across the farm: a kernel choice benchmarked once is not
benchmarked again on any worker of the same device class.

Under max-autotune Inductor times its GEMM choices and keeps the timings in a per-host file
(`<cache dir>/cache/<system hash>`). On CPU that system hash is the same on every machine,
so it cannot tell hosts apart; the farm keys shared timings by its own device fingerprint
(the backend's, e.g. CPU model, vector ISAs and target ISA). Before a compile the worker
merges every published timing for its fingerprint into the local file; the compile (in the
sandbox) records the timings it benchmarked itself, and the worker publishes those alone, never
what other workers on the host added meanwhile. Every write to the local file, the worker's
merge and Inductor's own in the sandbox, is a read-merge-write under one file lock, so
workers on a host never drop each other's timings.
"""
from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from storage import Store
from storage.tuning import Entry, inductor_entries, put_inductor_shard
from workers.unit import Target

AUTOTUNE_OPTIONS = ("max_autotune", "max_autotune_gemm")
LOCK_TIMEOUT_S = 120.0  # a rewrite takes milliseconds; a lock held this long belongs to a stuck process
MAX_ENTRIES = 100_000  # timings one compile may report


def autotunes(target: Target) -> bool:
    options = target.options_dict
    return any(bool(options.get(name)) for name in AUTOTUNE_OPTIONS)


def fingerprint_of(device: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(device, sort_keys=True).encode()).hexdigest()[:32]


def benchmarked() -> int:
    """How many kernel selections Inductor has benchmarked in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["select_algorithm_autotune"])


def _entries(cache: dict[str, Any]) -> list[Entry]:
    """The kernel timings in Inductor's local cache file, `{op: {inputs: {precision: {choice: ms}}}}`.
    Other Inductor caches share that file with entries of other shapes (on CUDA, e.g. pad_mm's
    decisions): those are not timings and are skipped."""
    return [(op, inputs, precision, choice, float(ms))
            for op, by_inputs in cache.items() if isinstance(by_inputs, dict)
            for inputs, by_precision in by_inputs.items() if isinstance(by_precision, dict)
            for precision, by_choice in by_precision.items() if isinstance(by_choice, dict)
            for choice, ms in by_choice.items() if isinstance(ms, (int, float)) and not isinstance(ms, bool)]


def _add(local: dict[str, Any], entries: list[Entry]) -> list[Entry]:
    """Add to the cache the entries it lacks (never overwriting one); the entries added."""
    added = []
    for entry in entries:
        op, inputs, precision, choice, ms = entry
        slot = local.setdefault(op, {})
        for level in (inputs, precision):
            slot = slot.setdefault(level, {}) if isinstance(slot, dict) else None
        if isinstance(slot, dict) and choice not in slot:
            slot[choice] = ms
            added.append(entry)
    return added


@contextmanager
def _file_locked() -> Iterator[None]:
    """The lock every farm process on this host takes to rewrite Inductor's local timing file."""
    from filelock import FileLock
    from torch._inductor.codecache import CacheBase

    path = CacheBase.get_local_cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.farm-lock", timeout=LOCK_TIMEOUT_S):
        yield


def _merge_into_local(entries: list[Entry]) -> tuple[int, dict[str, Any]]:
    """Add the entries the local cache lacks; how many were added, and the cache as it now is."""
    from torch._inductor.codecache import PersistentCache

    cache = PersistentCache()
    with _file_locked():
        local = cache.get_local_cache()
        added = _add(local, entries)
        if added:
            cache.update_local_cache(local)
    return len(added), local


@contextmanager
def recording_timings() -> Iterator[list[Entry]]:
    """In the sandbox, around a lowering: Inductor's writes to its local timing file become
    read-merge-writes under the host's lock, and the list fills with the timings this process
    added (benchmarked here, not already in the file)."""
    from torch._inductor.codecache import CacheBase

    original = CacheBase.update_local_cache
    added: list[Entry] = []

    def merged_write(self, local_cache: dict[str, Any]) -> None:
        with _file_locked():
            current = self.get_local_cache()
            added.extend(_add(current, _entries(local_cache)))
            original(self, current)

    CacheBase.update_local_cache = merged_write
    try:
        yield added
    finally:
        CacheBase.update_local_cache = original


def entries_from(reply: Any) -> list[Entry]:
    """The timings a sandbox says it benchmarked, if well formed (it is untrusted output)."""
    if not isinstance(reply, list):
        return []
    return [(str(e[0]), str(e[1]), str(e[2]), str(e[3]), float(e[4])) for e in reply[:MAX_ENTRIES]
            if isinstance(e, (list, tuple)) and len(e) == 5 and all(isinstance(x, str) for x in e[:4])
            and isinstance(e[4], (int, float)) and not isinstance(e[4], bool)]


@dataclass
class SharedAutotune:
    store: Store
    device: dict[str, Any]
    seeded: int = 0  # timings this worker took from the farm instead of measuring them
    refused: int = 0  # shards not used because their signature is missing or wrong
    published: int = 0  # timings this worker measured and gave to the farm
    _known: frozenset[tuple[str, str, str, str]] = frozenset()

    @property
    def fingerprint(self) -> str:
        return fingerprint_of(self.device)

    def seed(self) -> None:
        entries, refused = inductor_entries(self.store, self.fingerprint)
        self.refused = len(refused)
        self.seeded, local = _merge_into_local(entries)
        self._known = frozenset(e[:4] for e in _entries(local))

    def collect(self, measured: list[Entry]) -> None:
        """Publish the timings this compile measured (`recording_timings` in its sandbox)."""
        new = [e for e in measured if e[:4] not in self._known]
        put_inductor_shard(self.store, self.fingerprint, self.device, new)
        self.published = len(new)
