"""Autotuning results in the store, shared by every worker of a device class.

    tuning/<graph-digest>/<device-fp>.json      a tuning record: every candidate's measurements
                                                and the decision (rewritten only on retune)
    tuning/inductor/<device-fp>/<digest>.json   Inductor's own kernel-choice timings, in shards
    tuning/measured/<key>/<device-fp>.json      latencies of a compiled key measured after it was
                                                published (at other sizes, or on retune)

Inductor keeps the timings of the kernel choices it benchmarked under max-autotune in a
per-host file. A worker publishes what its compile added as one shard, named by the digest
of its content, so many workers publish at once without read-modify-write races; a worker
about to compile reads every shard of its device fingerprint. Entries are plain rows
(op, inputs, precision, choice, milliseconds).
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from storage.store import Store

Entry = tuple[str, str, str, str, float]


def _segment(part: str) -> str:
    """A digest or fingerprint used as one path segment."""
    if not part or "/" in part or part in ("inductor", "measured"):
        raise ValueError(f"not a digest: {part!r}")
    return part


def _prefix(fingerprint: str) -> str:
    return f"tuning/inductor/{_segment(fingerprint)}/"


def put_inductor_shard(store: Store, fingerprint: str, device: dict[str, Any], entries: list[Entry]) -> str | None:
    """Publish entries as one shard; None when there is nothing to publish."""
    if not entries:
        return None
    data = json.dumps({"device": device, "entries": sorted(entries)}, sort_keys=True).encode()
    path = _prefix(fingerprint) + hashlib.sha256(data).hexdigest() + ".json"
    store.backend.write(path, data, if_absent=True)
    return path


def inductor_entries(store: Store, fingerprint: str) -> list[Entry]:
    """Every entry published for this device fingerprint (a choice timed twice keeps one timing)."""
    entries: dict[tuple[str, str, str, str], float] = {}
    for path in sorted(store.backend.list(_prefix(fingerprint))):
        data = store.backend.read(path)
        if data is None:
            continue
        for op, inputs, precision, choice, ms in json.loads(data)["entries"]:
            entries.setdefault((op, inputs, precision, choice), float(ms))
    return [(*k, v) for k, v in entries.items()]


def record_path(graph_digest: str, fingerprint: str) -> str:
    return f"tuning/{_segment(graph_digest)}/{_segment(fingerprint)}.json"


def put_tuning_record(store: Store, path: str, record: dict[str, Any]) -> None:
    store.backend.write(path, json.dumps(record, indent=1, sort_keys=True).encode())


def _measured_path(key: str, fingerprint: str) -> str:
    return f"tuning/measured/{_segment(key)}/{_segment(fingerprint)}.json"


def get_measurements(store: Store, key: str, fingerprint: str) -> dict[str, float]:
    data = store.backend.read(_measured_path(key, fingerprint))
    return {} if data is None else json.loads(data)


def put_measurements(store: Store, key: str, fingerprint: str, metrics: dict[str, float]) -> None:
    store.backend.write(_measured_path(key, fingerprint), json.dumps(metrics, sort_keys=True).encode())
