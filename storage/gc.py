"""The store's collector: mark and sweep, safe beside publishers and readers.

Mark: what is kept refers to what it needs. Pins keep their units (and their jobs' records);
units used within `unused_days` are kept (last use is a manifest's mtime: storage/store.py);
job records as young, or named by the nightly history, are kept; torch's remote-cache entries
(storage/remote_cache.py) used within `unused_days`, or of a kind a pin keeps, are kept; every
blob a kept manifest, job record, cache entry, tuning record or pin refers to is kept. Sweep, in
this order: unit manifests, job records, cache entries, then blobs nothing refers to that are
older than the grace period, then expired leases.

Races, and how each is closed:
- A publish in flight has its blobs up and its manifest not yet written: nothing refers to them,
  but they are younger than the grace period (or were made young by the publisher, which touches
  every blob it relies on before naming it: `Store._kept`).
- A manifest published after the listing is not in the mark: its blobs were touched by its
  publisher, and every blob's mtime is read again (its shard listed again) just before the
  shard's deletes; one that changed since the listing stays.
- A unit used after the listing: its use renewed its manifest's mtime (when older than the
  refresh age), and manifests are read again the same way before they are deleted.
- Left open, by design: a touch that lands between that second read and the delete (one
  listing and one delete call per shard). The manifest it protected is then incomplete, and readers treat an
  incomplete manifest as a miss (`Store.complete_manifest`): the unit is compiled again, never
  served broken. Clocks: ages compare the server's mtimes with this machine's clock, so the
  grace period must be far longer than their skew (the default is a day).
"""
from __future__ import annotations

import gzip
import json
import logging
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from storage.backend import ObjectInfo, StoreError
from storage.pins import pins
from storage.store import Store
from storage.unit_refs import PREFIX as JOURNAL, UnitFacts, digests_in, read_journal

log = logging.getLogger(__name__)

DAY_S = 86400.0
READERS = 32  # documents read at once (a listing of 100,000 objects holds thousands)
DELETERS = 8  # shards re-read and deleted at once
STAT_AT_MOST = 8  # a shard with more objects to delete is listed again instead of stat'ed object by object
KINDS = ("units", "blobs", "jobs", "leases", "pins", "tuning", "history", "programs", "gc", "remote-cache", "other")


@dataclass(frozen=True)
class Policy:
    unused_days: float = 30.0  # units (and job records) unused this long go; 0: every unpinned one
    max_bytes: int | None = None  # then least recently used units too, until the store fits
    grace_s: float = DAY_S  # an unreferenced blob younger than this stays (a publish in flight)
    lease_expiry_s: float = 3600.0  # a lease not renewed this long is gone (holders renew every few seconds)
    dry_run: bool = False

    def __post_init__(self) -> None:
        for name in ("unused_days", "grace_s", "lease_expiry_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"gc: {name} must be a number >= 0, not {getattr(self, name)!r}")
        if self.max_bytes is not None and self.max_bytes < 0:
            raise ValueError(f"gc: max_bytes must be >= 0, not {self.max_bytes!r}")


@dataclass
class Tally:
    count: int = 0
    bytes: int = 0

    def add(self, size: int) -> None:
        self.count += 1
        self.bytes += size


@dataclass
class Report:
    deleted: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))
    kept: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))
    dry_run: bool = False
    objects: int = 0  # listed
    spared: int = 0  # chosen, then left because a use or a publisher made them young meanwhile
    young: Tally = field(default_factory=Tally)  # blobs nothing refers to, younger than the grace period

    def to_dict(self) -> dict[str, Any]:
        table = lambda d: {k: {"count": d[k].count, "bytes": d[k].bytes} for k in KINDS if k in d}
        return {"dry_run": self.dry_run, "objects": self.objects, "spared": self.spared,
                "deleted": table(self.deleted), "kept": table(self.kept),
                "young_blobs": {"count": self.young.count, "bytes": self.young.bytes}}


def kind_of(path: str) -> str:
    top = path.split("/", 1)[0]
    return top if top in KINDS else "other"


def blob_digest(path: str) -> str:
    return path.rsplit("/", 1)[-1]


class _Listing:
    """One listing of the whole store, by kind."""

    def __init__(self, objects: list[ObjectInfo]):
        self.by_kind: dict[str, list[ObjectInfo]] = defaultdict(list)
        for info in objects:
            self.by_kind[kind_of(info.path)].append(info)
        self.units = {i.path[len("units/"):-len(".json")]: i for i in self.by_kind["units"] if i.path.endswith(".json")}
        self.jobs: dict[str, list[ObjectInfo]] = defaultdict(list)
        for info in self.by_kind["jobs"]:
            parts = info.path.split("/")
            if len(parts) >= 3:
                self.jobs[parts[1]].append(info)
        self.leases: dict[str, list[ObjectInfo]] = defaultdict(list)
        for info in self.by_kind["leases"]:
            self.leases[info.path.split("/")[1]].append(info)
        # torch's remote-cache entries (storage/remote_cache.py), by their index document's name
        self.cache = {blob_digest(i.path).removesuffix(".json"): i for i in self.by_kind["remote-cache"]
                      if i.path.endswith(".json")}


def _read_all(store: Store, paths: list[str]) -> dict[str, dict[str, Any] | None]:
    with ThreadPoolExecutor(READERS) as pool:
        return dict(zip(paths, pool.map(store.read_unchecked, paths)))


def _history_jobs(store: Store) -> set[str] | None:
    """Job ids the nightly history refers to; None when it cannot be read (then every job record stays)."""
    import pyarrow as pa

    from storage.history import read_history

    try:
        table = read_history(store)
    except (pa.ArrowException, OSError, ValueError) as e:  # a damaged history must not cost the records it names
        log.warning("gc: the nightly history in %s could not be read (%s); keeping every job record", store.uri, e)
        return None
    return {j for j in table.column("job_id").to_pylist() if j} if "job_id" in table.column_names else set()


def _job_digests(store: Store, files: list[ObjectInfo]) -> set[str]:
    """Blobs a job record refers to: its results table's digests and any its JSON files name."""
    import pyarrow as pa

    from storage.results import read_results

    found: set[str] = set()
    for info in files:
        name = info.path.rsplit("/", 1)[-1]
        if name == "results.parquet":
            try:
                rows = read_results(store, info.path.split("/")[1]) or []
            except (pa.ArrowException, OSError, ValueError) as e:  # its references unknown: collect nothing
                raise StoreError(f"{store.uri}/{info.path} is unreadable ({e}); nothing was deleted. Delete that job "
                                 "record (or restore it), then run gc again") from e
            found |= {r[c] for r in rows for c in ("artifact_digest", "log_digest", "trace_digest") if r.get(c)}
        elif name.endswith(".json"):
            found |= set(digests_in(store.read_unchecked(info.path)))
    return found


class ManifestIndex:
    """The collector's cache of what each manifest refers to, kept in the store by S3 ETag (the
    content's tag, which a touch keeps): a pass reads only the manifests published or replaced
    since the last one, instead of one GET per unit. A lost or damaged index only costs reads; a
    forged one could only make the collector delete blobs a manifest still names, which readers
    then treat as an incomplete unit (compiled again, never a broken hit)."""

    PATH = "gc/manifest-refs.json.gz"

    def __init__(self, store: Store):
        self.store = store
        try:
            data = store.backend.read(self.PATH)
            entries = json.loads(gzip.decompress(data)) if data is not None else {}
        except (OSError, ValueError, EOFError) as e:
            log.warning("gc: the manifest index in %s is unreadable (%s); reading every manifest", store.uri, e)
            entries = {}
        self.entries: dict[str, Any] = entries if isinstance(entries, dict) else {}

    def get(self, key: str, etag: str | None) -> UnitFacts | None:
        return UnitFacts.from_entry(self.entries.get(key), etag)

    def save(self, facts: dict[str, UnitFacts], etags: dict[str, str | None]) -> bool:
        """Keep `facts` (by their manifests' listed ETags); True once the store holds them."""
        entries = {k: f.entry(str(etags[k]).strip('"')) for k, f in facts.items() if etags.get(k)}
        if entries == self.entries or not entries and not self.entries:
            return True
        try:
            self.store.backend.write(self.PATH, gzip.compress(json.dumps(entries, separators=(",", ":")).encode(), 6))
            self.entries = entries
            return True
        except StoreError as e:  # a cache: the next pass reads the manifests again
            log.warning("gc: the manifest index was not saved to %s (%s)", self.store.uri, e)
            return False


class Snapshot:
    """The store as the mark phase sees it: one listing, every manifest (or its index entry, or
    its publisher's journal entry: storage/unit_refs.py) and pin read once. A plan for any
    policy comes from it (`farm du` asks several)."""

    def __init__(self, store: Store, now: float):
        self.store, self.now = store, now
        self.listing = _Listing(list(store.backend.list_info("")))
        self.pins = pins(store)
        self.index = ManifestIndex(store)
        units = self.listing.units
        self.facts = {k: f for k in units if (f := self.index.get(k, units[k].etag)) is not None}
        # what publishers noted since (storage/unit_refs.py), taken where the content is the same;
        # not read when the index knows every manifest (a real pass still folds it away)
        self.journals = [i.path for i in self.listing.by_kind["gc"] if i.path.startswith(JOURNAL)]
        noted = read_journal(store.backend, self.journals) if self.journals and len(self.facts) < len(units) else {}
        for k in units.keys() - self.facts.keys():
            if (f := UnitFacts.from_entry(noted.get(k), units[k].etag)) is not None:
                self.facts[k] = f
        unread = [f"units/{k}.json" for k in units if k not in self.facts]
        self.manifests_read = len(unread)
        for path, doc in _read_all(store, unread).items():
            self.facts[path[len("units/"):-len(".json")]] = UnitFacts.of(doc or {})
        self.refs = {k: set(f.refs) for k, f in self.facts.items()}
        self.history_jobs = _history_jobs(store) if self.listing.jobs else set()
        docs = _read_all(store, [i.path for k in ("tuning", "pins") for i in self.listing.by_kind.get(k, [])
                                 if i.path.endswith(".json")])
        self.fixed_refs = {d for doc in docs.values() for d in digests_in(doc or {})}  # tuning records, pins
        cache_docs = _read_all(store, [i.path for i in self.listing.cache.values()])
        self.cache_refs = {blob_digest(path).removesuffix(".json"): set(digests_in(doc or {}))
                           for path, doc in cache_docs.items()}
        self._job_refs: dict[str, set[str]] = {}

    def save_index(self, gone: frozenset[str] | set[str] = frozenset(), fold_journal: bool = False) -> None:
        """Keep what this pass learned of the manifests that remain, for the next pass; with
        `fold_journal`, then delete the journal objects this pass read (the index holds them now)."""
        saved = self.index.save({k: f for k, f in self.facts.items() if k not in gone},
                                {k: i.etag for k, i in self.listing.units.items()})
        if fold_journal and saved and self.journals:
            try:
                self.store.backend.delete_many(self.journals)
            except StoreError as e:  # read again next pass
                log.warning("gc: the publish journal in %s was not folded (%s)", self.store.uri, e)

    def job_refs(self, job: str) -> set[str]:
        if job not in self._job_refs:
            self._job_refs[job] = _job_digests(self.store, self.listing.jobs[job])
        return self._job_refs[job]

    @property
    def objects(self) -> int:
        return sum(len(v) for v in self.listing.by_kind.values())


@dataclass
class Plan:
    units: set[str]  # keys whose manifests go
    jobs: set[str]  # job ids whose records go
    blobs: set[str]  # digests that go
    leases: set[str]  # keys whose expired leases go
    cache: set[str] = field(default_factory=set)  # remote-cache entries (index names) unused too long
    young: set[str] = field(default_factory=set)  # digests nothing refers to, kept for the grace period


def _older(now: float, mtime: float, limit_s: float) -> bool:
    """Older than the limit; a limit of 0 means any age (an mtime a little ahead of this clock too)."""
    return limit_s == 0 or now - mtime > limit_s


def plan(snap: Snapshot, policy: Policy) -> Plan:
    """What the collector would delete under `policy` (see the module doc for the rules)."""
    listing, now = snap.listing, snap.now
    limit = policy.unused_days * DAY_S
    keep_units = {k for p in snap.pins for k in p.keys}
    units = {k for k, info in listing.units.items() if k not in keep_units and _older(now, info.mtime, limit)}
    if snap.history_jobs is None:
        jobs: set[str] = set()
    else:
        keep_jobs = snap.history_jobs | {p.job for p in snap.pins if p.job}
        jobs = {j for j, files in listing.jobs.items()
                if j not in keep_jobs and _older(now, max(i.mtime for i in files), limit)}
    cache = {n for n, info in listing.cache.items() if _older(now, info.mtime, limit)
             and not any(p.keeps_cache(info.path.split("/")[1]) for p in snap.pins)}
    others = set(snap.fixed_refs).union(*(refs for n, refs in snap.cache_refs.items() if n not in cache))
    for job in listing.jobs:
        if job not in jobs:
            others |= snap.job_refs(job)
    blob_infos = {blob_digest(i.path): i for i in listing.by_kind["blobs"]}
    if policy.max_bytes is not None:
        units |= _to_fit(snap, policy, units, jobs, others, blob_infos, keep_units)
    marked = others.union(*(snap.refs[k] for k in listing.units if k not in units))
    unreferenced = {d for d in blob_infos if d not in marked}
    blobs = {d for d in unreferenced if _older(now, blob_infos[d].mtime, policy.grace_s)}
    leases = {k for k, files in listing.leases.items() if _older(now, max(i.mtime for i in files), policy.lease_expiry_s)}
    return Plan(units, jobs, blobs, leases, cache, unreferenced - blobs)


def _to_fit(snap: Snapshot, policy: Policy, doomed: set[str], doomed_jobs: set[str], others: set[str],
            blob_infos: dict[str, ObjectInfo], pinned: set[str]) -> set[str]:
    """Least recently used units beyond those too old, until the store's bytes fit max_bytes
    (counting what each frees: its manifest, and blobs only it refers to, once past the grace)."""
    listing, now = snap.listing, snap.now
    holders = Counter(d for k, ds in snap.refs.items() if k not in doomed for d in ds)
    freed = lambda d: holders[d] == 0 and d not in others and _older(now, blob_infos[d].mtime, policy.grace_s)
    total = sum(i.size for infos in listing.by_kind.values() for i in infos)
    total -= sum(listing.units[k].size for k in doomed)
    total -= sum(i.size for j in doomed_jobs for i in listing.jobs[j])
    total -= sum(i.size for d, i in blob_infos.items() if freed(d))
    more: set[str] = set()
    for key in sorted((k for k in listing.units if k not in doomed and k not in pinned), key=lambda k: listing.units[k].mtime):
        if total <= (policy.max_bytes or 0):
            break
        more.add(key)
        total -= listing.units[key].size
        for d in snap.refs[key]:
            holders[d] -= 1
            if d in blob_infos and freed(d):
                total -= blob_infos[d].size
    return more


class Collector:
    """Carries out a plan: deletes shard by shard, reading mtimes again just before each shard."""

    def __init__(self, store: Store, policy: Policy):
        self.store, self.policy = store, policy
        self.report = Report(dry_run=policy.dry_run)

    def run(self, snap: Snapshot | None = None) -> Report:
        snap = snap or Snapshot(self.store, self.store.clock())
        self.report.objects = snap.objects
        chosen = plan(snap, self.policy)
        listing = snap.listing
        gone_units = self._delete(listing.units, chosen.units, "units")
        snap.save_index(set() if self.policy.dry_run else gone_units, fold_journal=not self.policy.dry_run)
        self._delete_groups(listing.jobs, chosen.jobs, "jobs")
        spared_cache = chosen.cache - self._delete(listing.cache, chosen.cache, "remote-cache")
        # a manifest (or cache entry) spared at the last moment keeps its blobs
        spared = chosen.units - gone_units
        blob_infos = {blob_digest(i.path): i for i in listing.by_kind["blobs"]}
        named = lambda d: any(d in snap.refs[k] for k in spared) or any(d in snap.cache_refs.get(n, ()) for n in spared_cache)
        self._delete(blob_infos, {d for d in chosen.blobs if not named(d)}, "blobs")
        for digest in chosen.young:  # kept, and said: a later collection takes them
            if not named(digest):
                self.report.young.add(blob_infos[digest].size)
        self._delete_groups(listing.leases, chosen.leases, "leases")
        for kind in KINDS:
            if kind not in ("units", "blobs", "jobs", "leases", "remote-cache"):
                for info in listing.by_kind.get(kind, []):
                    self.report.kept[kind].add(info.size)
        return self.report

    # sweeping -----------------------------------------------------------------------
    def _delete(self, infos: dict[str, ObjectInfo], chosen: set[str], kind: str) -> set[str]:
        """Delete the chosen objects shard by shard (`units/ab`, `blobs/sha256/ab/`), reading the
        shard's mtimes again just before its delete: one a use or a publisher touched since the
        listing stays. Shards go several at once (a server deletes objects one by one). Returns
        the names deleted."""
        for name, info in infos.items():
            if name not in chosen:
                self.report.kept[kind].add(info.size)
        shards: dict[str, list[str]] = defaultdict(list)
        for name in chosen:
            path = infos[name].path
            shards[path[:path.rfind("/") + 3]].append(name)

        def shard(prefix: str) -> tuple[list[ObjectInfo], list[ObjectInfo]]:
            names = shards[prefix]
            now = {n: infos[n] for n in names} if self.policy.dry_run else self._now(prefix, [infos[n] for n in names])
            fresh = [now[n] for n in names if n in now]  # one gone already: another collector, a person
            go = [i for i in fresh if i.mtime <= infos[blob_digest(i.path).removesuffix(".json")].mtime]
            if go and not self.policy.dry_run:
                self.store.backend.delete_many([i.path for i in go])
            return go, [i for i in fresh if i not in go]

        gone: set[str] = set()
        with ThreadPoolExecutor(DELETERS) as pool:
            for go, spared in pool.map(shard, sorted(shards)):
                for info in go:
                    gone.add(blob_digest(info.path).removesuffix(".json"))
                    self.report.deleted[kind].add(info.size)
                for info in spared:
                    self.report.spared += 1
                    self.report.kept[kind].add(info.size)
        return gone

    def _now(self, prefix: str, listed: list[ObjectInfo]) -> dict[str, ObjectInfo]:
        """The objects' current mtimes by name: one listing of their shard, or a stat each for a few."""
        if len(listed) <= STAT_AT_MOST:
            with ThreadPoolExecutor(min(READERS, len(listed))) as pool:
                found = [i for i in pool.map(lambda i: self.store.backend.stat(i.path), listed) if i is not None]
        else:
            wanted = {i.path for i in listed}
            found = [i for i in self.store.backend.list_info(prefix) if i.path in wanted]
        return {i.path.rsplit("/", 1)[-1].removesuffix(".json"): i for i in found}

    def _delete_groups(self, groups: dict[str, list[ObjectInfo]], chosen: set[str], kind: str) -> None:
        """Job records and leases: every object of a chosen group goes (no age read again: they are
        chosen by their newest object's age, far beyond any write in flight)."""
        for name, files in groups.items():
            for info in files:
                (self.report.deleted if name in chosen else self.report.kept)[kind].add(info.size)
        paths = [i.path for name in sorted(chosen) for i in groups[name]]
        if paths and not self.policy.dry_run:
            self.store.backend.delete_many(paths)


def collect(store: Store, policy: Policy) -> Report:
    """One collection (or, with policy.dry_run, what one would delete)."""
    return Collector(store, policy).run()
