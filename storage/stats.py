"""What a job saved and what it cost: one record that merges (`+=`), rendered elsewhere.

It is derived from the results rows, so `farm results` can show it for any past job.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any, Iterable

from storage.store import Store

STATS_FILE = "stats.json"


@dataclass
class JobStats:
    units: int = 0
    looked_up: int = 0  # units that got as far as a key (bad input never does)
    hits: int = 0
    compiled: int = 0
    failed: int = 0
    saved_s: float = 0.0  # the recorded compile time of every hit: work not done again
    compile_s: float = 0.0  # time spent compiling the misses
    lease_wait_s: float = 0.0  # time spent waiting for another worker's compile of the same key
    bytes_uploaded: int = 0
    bytes_downloaded: int = 0
    bytes_cached: int = 0  # served from a worker's local disk tier instead of the store

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.looked_up if self.looked_up else None

    @classmethod
    def from_rows(cls, rows: Iterable[dict[str, Any]]) -> "JobStats":
        total = cls()
        for r in rows:
            total += cls(
                units=1,
                looked_up=int(r.get("key") is not None),
                hits=int(r["status"] == "hit"),
                compiled=int(r["status"] == "compiled"),
                failed=int(r["status"] == "failed"),
                saved_s=r.get("saved_s") or 0.0,
                compile_s=r.get("compile_s") or 0.0 if r["status"] == "compiled" else 0.0,
                lease_wait_s=r.get("lease_wait_s") or 0.0,
                bytes_uploaded=r.get("bytes_uploaded") or 0,
                bytes_downloaded=r.get("bytes_downloaded") or 0,
                bytes_cached=r.get("bytes_cached") or 0,
            )
        return total

    def __iadd__(self, other: "JobStats") -> "JobStats":
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": self.hit_rate}


def write_stats(store: Store, job_id: str, stats: JobStats) -> str:
    return store.put_job_file(job_id, STATS_FILE, json.dumps(stats.to_dict(), indent=1).encode())
