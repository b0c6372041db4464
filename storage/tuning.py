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

from storage.signing import UntrustedDocument
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
    doc = {"device": device, "entries": sorted(entries)}
    digest = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
    path = _prefix(fingerprint) + digest + ".json"
    store.put_document(path, doc, if_absent=True)
    return path


def inductor_entries(store: Store, fingerprint: str) -> tuple[list[Entry], list[str]]:
    """Every entry published for this device fingerprint (a choice timed twice keeps one timing),
    and the shards refused because their signature is missing or wrong (never used)."""
    entries: dict[tuple[str, str, str, str], float] = {}
    refused: list[str] = []
    for path in sorted(store.backend.list(_prefix(fingerprint))):
        try:
            doc = store.get_document(path)
        except UntrustedDocument as e:
            refused.append(str(e))
            continue
        for op, inputs, precision, choice, ms in (doc or {}).get("entries", []):
            entries.setdefault((str(op), str(inputs), str(precision), str(choice)), float(ms))
    return [(*k, v) for k, v in entries.items()], refused


def record_path(graph_digest: str, fingerprint: str) -> str:
    return f"tuning/{_segment(graph_digest)}/{_segment(fingerprint)}.json"


def put_tuning_record(store: Store, path: str, record: dict[str, Any]) -> None:
    store.put_document(path, record)


def _measured_path(key: str, fingerprint: str) -> str:
    return f"tuning/measured/{_segment(key)}/{_segment(fingerprint)}.json"


def get_measurements(store: Store, key: str, fingerprint: str) -> dict[str, float]:
    """Latencies measured since publishing; none if their signature fails (they are measured again)."""
    try:
        doc = store.get_document(_measured_path(key, fingerprint))
    except UntrustedDocument:
        return {}
    return {str(k): float(v) for k, v in (doc or {}).get("metrics", {}).items() if isinstance(v, (int, float))}


def put_measurements(store: Store, key: str, fingerprint: str, metrics: dict[str, float]) -> None:
    store.put_document(_measured_path(key, fingerprint), {"metrics": metrics})
