"""`farm du`: what a store holds, by kind, by target and by age of last use, and what
`farm gc --unused-days N` would free for a few N (from one listing: storage/gc.py's Snapshot)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from storage.gc import DAY_S, Policy, Snapshot, Tally, blob_digest, plan
from storage.store import Store

# a blob's kind is the role a manifest gives it; a target's bundle is its artifact
ROLE_KINDS = {"artifact": "artifacts", "program": "programs", "log": "logs", "trace": "traces"}
BUNDLE_BACKENDS = ("inductor-cache", "aot-compile")
AGES = ((1, "< 1 day"), (7, "1-7 days"), (30, "7-30 days"), (90, "30-90 days"), (float("inf"), "> 90 days"))
WHAT_IF_DAYS = (1, 7, 30, 90)


@dataclass
class Usage:
    objects: int = 0
    bytes: int = 0
    by_kind: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))
    by_target: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))  # units and their own blobs
    by_last_use: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))  # the same, by last use
    # torch's remote-cache entries (storage/remote_cache.py) by cache kind: index, value and kernels
    by_cache_kind: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))
    gc_frees: dict[int, int] = field(default_factory=dict)  # unused days -> bytes that gc would delete
    pinned_units: int = 0

    def to_dict(self) -> dict[str, Any]:
        table = lambda d: {k: {"count": v.count, "bytes": v.bytes} for k, v in sorted(d.items())}
        return {"objects": self.objects, "bytes": self.bytes, "by_kind": table(self.by_kind),
                "by_target": table(self.by_target), "by_cache_kind": table(self.by_cache_kind),
                "by_last_use": {label: {"count": self.by_last_use[label].count, "bytes": self.by_last_use[label].bytes}
                                for _, label in AGES if label in self.by_last_use},
                "gc_unused_days_frees_bytes": {str(n): b for n, b in self.gc_frees.items()},
                "pinned_units": self.pinned_units}


def _blob_kind(role: str, target: str) -> str:
    kind = ROLE_KINDS.get(role, "artifacts")  # autotune's static specializations are artifacts too
    return "bundles" if kind == "artifacts" and target.split(":")[0].split("+")[0] in BUNDLE_BACKENDS else kind


def _age_label(age_s: float) -> str:
    return next(label for days, label in AGES if age_s < days * DAY_S)


def usage(store: Store, grace_s: float = DAY_S) -> Usage:
    snap = Snapshot(store, store.clock())
    listing, now = snap.listing, snap.now
    u = Usage(objects=snap.objects)
    blobs = {blob_digest(i.path): i for i in listing.by_kind["blobs"]}
    kind_of_blob: dict[str, str] = {}
    for key, info in listing.units.items():
        target = snap.facts[key].target
        own = info.size
        for role, digest in snap.facts[key].blobs.items():
            if digest in blobs:
                kind_of_blob.setdefault(digest, _blob_kind(role, target))
                if role != "program":  # a program is shared by every target of its graph
                    own += blobs[digest].size
        u.by_target[target].count += 1
        u.by_target[target].bytes += own
        label = _age_label(now - info.mtime)
        u.by_last_use[label].count += 1
        u.by_last_use[label].bytes += own
    for name, info in listing.cache.items():
        kind = info.path.split("/")[1]
        refs = snap.cache_refs.get(name, set())
        u.by_cache_kind[kind].count += 1
        u.by_cache_kind[kind].bytes += info.size + sum(blobs[d].size for d in refs if d in blobs)
        for digest in refs:
            kind_of_blob.setdefault(digest, "remote-cache values")
    for digest, info in blobs.items():
        u.by_kind[kind_of_blob.get(digest, "unreferenced blobs")].add(info.size)
    for kind, infos in listing.by_kind.items():
        if kind == "blobs":
            continue
        for info in infos:
            u.by_kind[{"units": "manifests", "programs": "identities", "gc": "gc index and journal"}.get(kind, kind)].add(info.size)
    u.bytes = sum(t.bytes for t in u.by_kind.values())
    u.pinned_units = len({k for p in snap.pins for k in p.keys})
    snap.save_index()  # the collector's cache (storage/gc.py ManifestIndex): the next pass reads less
    for days in WHAT_IF_DAYS:
        chosen = plan(snap, Policy(unused_days=days, grace_s=grace_s))
        u.gc_frees[days] = (sum(listing.units[k].size for k in chosen.units)
                            + sum(i.size for j in chosen.jobs for i in listing.jobs[j])
                            + sum(blobs[d].size for d in chosen.blobs)
                            + sum(i.size for k in chosen.leases for i in listing.leases[k])
                            + sum(listing.cache[n].size for n in chosen.cache))
    return u
