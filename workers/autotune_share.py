"""Sharing Inductor's autotuning across the farm: a kernel choice benchmarked once is not
benchmarked again on any worker of the same device class.

Under max-autotune Inductor times its GEMM choices and keeps the timings in a per-host file
(`<cache dir>/cache/<system hash>`). On CPU that system hash is the same on every machine,
so it cannot tell hosts apart; the farm keys shared timings by its own device fingerprint
(the backend's, e.g. CPU model, vector ISAs and target ISA). Before a compile the worker
merges every published timing for its fingerprint into the local file, after the compile it
publishes what the compile added.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from storage import Store
from storage.tuning import Entry, inductor_entries, put_inductor_shard
from workers.unit import Target

AUTOTUNE_OPTIONS = ("max_autotune", "max_autotune_gemm")


def autotunes(target: Target) -> bool:
    options = target.options_dict
    return any(bool(options.get(name)) for name in AUTOTUNE_OPTIONS)


def fingerprint_of(device: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(device, sort_keys=True).encode()).hexdigest()[:32]


def benchmarked() -> int:
    """How many kernel selections Inductor has benchmarked in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["select_algorithm_autotune"])


def _local_cache() -> dict[str, Any]:
    from torch._inductor.codecache import PersistentCache

    return PersistentCache().get_local_cache()


def _entries(cache: dict[str, Any]) -> list[Entry]:
    """The kernel timings in Inductor's local cache file, `{op: {inputs: {precision: {choice: ms}}}}`.
    Other Inductor caches share that file with entries of other shapes (on CUDA, e.g. pad_mm's
    decisions): those are not timings and are skipped."""
    return [(op, inputs, precision, choice, float(ms))
            for op, by_inputs in cache.items() if isinstance(by_inputs, dict)
            for inputs, by_precision in by_inputs.items() if isinstance(by_precision, dict)
            for precision, by_choice in by_precision.items() if isinstance(by_choice, dict)
            for choice, ms in by_choice.items() if isinstance(ms, (int, float)) and not isinstance(ms, bool)]


def _merge_into_local(entries: list[Entry]) -> tuple[int, dict[str, Any]]:
    """Add the entries the local cache lacks; how many were added, and the cache as it now is."""
    from torch._inductor.codecache import PersistentCache

    cache = PersistentCache()
    local = cache.get_local_cache()
    added = 0
    for op, inputs, precision, choice, ms in entries:
        slot = local.setdefault(op, {})
        for level in (inputs, precision):
            slot = slot.setdefault(level, {}) if isinstance(slot, dict) else None
        if isinstance(slot, dict) and choice not in slot:  # never overwrite another cache's entry
            slot[choice] = ms
            added += 1
    if added:
        cache.update_local_cache(local)
    return added, local


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

    def collect(self) -> None:
        new = [e for e in _entries(_local_cache()) if e[:4] not in self._known]
        put_inductor_shard(self.store, self.fingerprint, self.device, new)
        self.published = len(new)
