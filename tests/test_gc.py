"""The store's collector on a local store and a fake clock: what the mark phase keeps (what refers
to what), the age rules, --max-gb, and the races with publishers and readers (storage/gc.py)."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from storage import Store, store_from_uri
from storage.gc import DAY_S, Collector, Policy, Snapshot, collect
from storage.history import append_run
from storage.pins import pin, pins, unpin
from storage.results import write_results
from storage.store import blob_path, manifest_path
from storage.tuning import put_tuning_record, record_path

NOW = time.time()


def _age(store: Store, path: str, days: float) -> None:
    """Make an object look last written `days` ago (a local store's mtime is its last use)."""
    when = NOW - days * DAY_S
    os.utime(Path(store.backend.root) / path, (when, when))


def _blob(store: Store, data: bytes, days: float = 0.0):
    ref = store.put_bytes(data)
    _age(store, blob_path(ref.digest), days)
    return ref


def _unit(store: Store, key: str, days: float, **blobs) -> dict:
    manifest = {"key": key, "target": "aoti-cpu:avx2", "blobs": {role: ref.to_dict() for role, ref in blobs.items()}}
    assert store.publish_manifest(key, manifest)
    _age(store, manifest_path(key), days)
    for ref in blobs.values():
        _age(store, blob_path(ref.digest), days)
    return manifest


def _job(store: Store, job_id: str, days: float, artifact) -> None:
    write_results(store, job_id, [{"job_id": job_id, "graph": "g", "target": "aoti-cpu", "key": "k" * 64,
                                   "status": "compiled", "artifact_digest": artifact.digest}])
    store.put_job_file(job_id, "status.json", b'{"state": "done"}')
    for name in ("results.parquet", "status.json"):
        _age(store, f"jobs/{job_id}/{name}", days)


@pytest.fixture
def store(tmp_path) -> Store:
    s = store_from_uri(str(tmp_path / "store"))
    s.clock = lambda: NOW
    return s


def _exists(store: Store, ref) -> bool:
    return store.backend.stat(blob_path(ref.digest)) is not None


def test_the_mark_keeps_what_kept_things_refer_to_and_the_sweep_takes_the_rest(store):
    program = _blob(store, b"program shared by two units", days=40)
    old_artifact, old_log = _blob(store, b"old artifact"), _blob(store, b"old log")
    _unit(store, "a" * 64, 40, artifact=old_artifact, log=old_log, program=program)
    fresh_artifact = _blob(store, b"fresh artifact")
    _unit(store, "b" * 64, 1, artifact=fresh_artifact, program=program)
    pinned_artifact = _blob(store, b"pinned artifact")
    _unit(store, "c" * 64, 400, artifact=pinned_artifact)
    pin(store, ["c" * 64], label="release-1")
    old_job_artifact, history_artifact = _blob(store, b"old job's", 40), _blob(store, b"history's job's", 40)
    _job(store, "old-job", 40, old_job_artifact)
    _job(store, "nightly-job", 40, history_artifact)
    append_run(store, "2026-10-01", "run-1", [{"run_id": "run-1", "model": "mlp", "job_id": "nightly-job"}])
    tuned = _blob(store, b"a tuning record's candidate", 40)
    put_tuning_record(store, record_path("d" * 64, "cpu-fp"), {"candidates": [{"artifact": {"digest": tuned.digest}}]})
    orphan_old, orphan_young = _blob(store, b"nothing refers to me", 2), _blob(store, b"a publish in flight", 0.1)
    store.backend.write("leases/" + "e" * 64 + "/0000000000.json", b"{}")
    _age(store, "leases/" + "e" * 64 + "/0000000000.json", 1)
    store.backend.write("leases/" + "f" * 64 + "/0000000000.json", b"{}")  # a holder renewing it now

    report = collect(store, Policy(unused_days=30)).to_dict()

    assert set(store.manifest_keys()) == {"b" * 64, "c" * 64}
    gone = [old_artifact, old_log, old_job_artifact, orphan_old]
    kept = [program, fresh_artifact, pinned_artifact, history_artifact, tuned, orphan_young]
    assert [_exists(store, r) for r in gone] == [False] * len(gone)
    assert [_exists(store, r) for r in kept] == [True] * len(kept)
    assert store.job_ids() == ["nightly-job"]  # the history's job record stays, the history too
    assert [i.path.split("/")[1] for i in store.backend.list_info("leases/")] == ["f" * 64]
    assert report["deleted"]["units"]["count"] == 1 and report["deleted"]["blobs"]["count"] == 4
    assert report["deleted"]["jobs"]["count"] == 2 and report["deleted"]["leases"]["count"] == 1
    assert report["kept"]["units"]["count"] == 2 and report["kept"]["history"]["count"] == 1


def test_a_dry_run_reports_the_same_and_deletes_nothing(store):
    _unit(store, "a" * 64, 40, artifact=_blob(store, b"old artifact"))
    before = sorted(i.path for i in store.backend.list_info(""))
    dry = collect(store, Policy(unused_days=30, dry_run=True)).to_dict()
    assert sorted(i.path for i in store.backend.list_info("")) == before
    real = collect(store, Policy(unused_days=30)).to_dict()
    assert dry["deleted"] == real["deleted"] and dry["dry_run"] and not real["dry_run"]
    assert list(store.manifest_keys()) == []


def test_unused_days_zero_takes_every_unpinned_unit_and_unpinning_lets_it_go(store):
    _unit(store, "a" * 64, 0, artifact=_blob(store, b"a"))
    _unit(store, "b" * 64, 0, artifact=_blob(store, b"b"))
    pin(store, ["b" * 64])
    collect(store, Policy(unused_days=0, grace_s=0))
    assert list(store.manifest_keys()) == ["b" * 64] and [p.name for p in pins(store)] == ["b" * 64]
    assert unpin(store, "b" * 64) and not unpin(store, "b" * 64)
    collect(store, Policy(unused_days=0, grace_s=0))
    assert list(store.manifest_keys()) == [] and list(store.backend.list("blobs/")) == []


def test_max_gb_takes_the_least_recently_used_units_until_the_store_fits(store):
    for i, days in enumerate((5, 3, 1)):  # unit 0 is the least recently used
        _unit(store, str(i) * 64, days, artifact=_blob(store, bytes([i]) * 100_000))
    total = sum(i.size for i in store.backend.list_info(""))
    collect(store, Policy(unused_days=30, grace_s=0, max_bytes=total - 150_000))  # room for one fewer is not enough
    assert sorted(store.manifest_keys()) == ["2" * 64]
    assert sum(i.size for i in store.backend.list_info("")) <= total - 150_000


def test_a_blob_a_publisher_relies_on_after_the_listing_is_spared(store):
    """Race: the collector lists an old blob nothing refers to; a publisher then finds it in the
    store, skips its upload, and publishes a manifest naming it; the collector deletes after."""
    old = _blob(store, b"an artifact someone built before", days=3)
    snap = Snapshot(store, NOW)  # the listing: old, unreferenced
    ref = store.put_bytes(b"an artifact someone built before")  # the publisher: there already, made young
    store.publish_manifest("p" * 64, {"key": "p" * 64, "blobs": {"artifact": ref.to_dict()}})
    report = Collector(store, Policy(grace_s=DAY_S)).run(snap).to_dict()
    assert _exists(store, old) and store.complete_manifest("p" * 64)[0] is not None
    assert report["spared"] == 1 and "blobs" not in report["deleted"]


def test_a_unit_used_after_the_listing_keeps_its_manifest_and_blobs(store):
    artifact = _blob(store, b"an artifact used again")
    manifest = _unit(store, "u" * 64, 40, artifact=artifact)
    snap = Snapshot(store, NOW)
    assert store.note_use("u" * 64, manifest)  # a hit, between the listing and the sweep
    Collector(store, Policy(unused_days=30)).run(snap)
    assert store.complete_manifest("u" * 64)[0] == manifest and _exists(store, artifact)


def test_a_publish_in_flight_keeps_its_blobs_for_the_grace_period(store):
    uploaded = _blob(store, b"uploaded, its manifest not yet written", days=0.5)
    report = collect(store, Policy(grace_s=DAY_S)).to_dict()
    assert _exists(store, uploaded)
    assert report["young_blobs"] == {"count": 1, "bytes": len(b"uploaded, its manifest not yet written")}  # and says so
    report = collect(store, Policy(grace_s=3600)).to_dict()  # past a shorter grace: nothing refers to it
    assert not _exists(store, uploaded) and report["young_blobs"]["count"] == 0


def test_a_running_jobs_record_keeps_its_programs_and_finished_units_blobs(store):
    program, finished = _blob(store, b"program in flight", 3), _blob(store, b"a finished unit's artifact", 3)
    store.put_job_file("running-job", "status.json",
                       f'{{"state": "running", "programs": ["{program.digest}"], "blobs": ["{finished.digest}"]}}'.encode())
    collect(store, Policy(unused_days=1, grace_s=60))
    assert _exists(store, program) and _exists(store, finished)


def test_policy_and_pin_names_are_checked(store):
    with pytest.raises(ValueError, match="grace_s"):
        Policy(grace_s=-1)
    with pytest.raises(ValueError, match="cannot name a pin"):
        pin(store, ["a" * 64], label="../escape")
    with pytest.raises(ValueError, match="only published units"):
        pin(store, ["a" * 64])


def test_on_s3_a_pass_reads_only_the_manifests_published_since_the_last(s3_uri):
    """The collector's index (by S3 ETag, which a touch keeps) spares it a GET per unit."""
    s3 = store_from_uri(s3_uri)
    for i in range(3):
        s3.publish_manifest(str(i) * 64, {"key": str(i) * 64, "target": "core-aten",
                                          "blobs": {"artifact": s3.put_bytes(f"artifact {i}".encode()).to_dict()}})
    assert Snapshot(s3, time.time()).manifests_read == 3  # this process has not written its journal yet
    collect(s3, Policy(dry_run=True))  # a pass keeps what it read
    assert Snapshot(s3, time.time()).manifests_read == 0
    s3.note_use("0" * 64, s3.get_manifest("0" * 64))  # a use touches: same content, same ETag
    s3.publish_manifest("9" * 64, {"key": "9" * 64, "blobs": {"artifact": s3.put_bytes(b"new").to_dict()}})
    snap = Snapshot(s3, time.time())
    assert snap.manifests_read == 1 and snap.facts["0" * 64].blobs["artifact"] in snap.refs["0" * 64]
    collect(s3, Policy(unused_days=0, grace_s=0))  # everything goes, the index follows
    assert list(s3.manifest_keys()) == [] and Snapshot(s3, time.time()).index.entries == {}


def test_on_s3_publishers_journal_spares_the_first_pass_its_reads_and_a_real_pass_folds_it(s3_uri):
    """What a Store published (storage/unit_refs.py) is taken where the listing's ETag matches
    the content it noted; a manifest written another way is read; a real pass folds the journal."""
    s3 = store_from_uri(s3_uri)
    prog = s3.put_bytes(b"program")
    keys = [f"{i}".rjust(64, "a") for i in range(5)]
    for k in keys:
        s3.publish_manifest(k, {"key": k, "target": "core-aten", "program": prog.digest,
                                "blobs": {"artifact": s3.put_bytes(k.encode()).to_dict()}})
    s3.flush_journal()
    s3.backend.write("gc/published/0-damaged.json.gz", b"not gzip")  # skipped, with a warning
    # one manifest rewritten behind the journal's back (another writer, another content)
    other = s3.put_bytes(b"other artifact")
    s3.put_document(manifest_path(keys[0]), {"key": keys[0], "target": "core-aten", "blobs": {"artifact": other.to_dict()}})
    snap = Snapshot(s3, time.time())
    assert snap.manifests_read == 1 and len(snap.journals) == 2
    assert snap.facts[keys[0]].blobs["artifact"] == other.digest  # the content as it is, not as noted
    assert all(prog.digest in snap.refs[k] for k in keys[1:])  # a digest named outside `blobs` is kept too
    collect(s3, Policy(dry_run=True))  # a dry run deletes nothing, its own journal included
    assert len(Snapshot(s3, time.time()).journals) == 2
    collect(s3, Policy(unused_days=30))  # nothing is old: it keeps everything, and folds the journal
    snap = Snapshot(s3, time.time())
    assert snap.journals == [] and snap.manifests_read == 0 and set(keys) <= set(snap.facts)
    assert s3.complete_manifest(keys[1])[0] is not None and s3.has_blob(prog)


def test_remote_cache_entries_unused_too_long_go_with_their_values_and_used_or_pinned_ones_stay(store):
    from storage.pins import pin_caches
    from storage.remote_cache import CacheEntries, index_path
    from storage.usage import usage

    entries = CacheEntries(store, refresh_age_s=0)
    old, used, pinned = b"pt2:fx-graph-v1::old:c1", b"pt2:autograd-shared-v1::used:c1", b"pt2:autotune-v2::kept:c1"
    for key in (old, used, pinned):
        entries.put(key, key + b" value", "ci", files={"ab/" + "c" * 52 + ".main.so": key + b" kernel"} if key == old else None)
        _age(store, index_path(key), 40)
        _age(store, blob_path(_blob(store, key + b" value").digest), 40)
    _age(store, blob_path(_blob(store, old + b" kernel").digest), 40)
    pin_caches(store, ["autotune-v2"], label="keep-autotune")
    assert entries.get(used) == used + b" value"  # a use renews its last-use mark
    du = usage(store).to_dict()
    assert du["by_cache_kind"]["fx-graph-v1"]["count"] == 1 and du["by_kind"]["remote-cache values"]["count"] == 4
    assert du["gc_unused_days_frees_bytes"]["30"] > 0
    report = collect(store, Policy(unused_days=30, grace_s=0))
    assert report.deleted["remote-cache"].count == 1 and report.kept["remote-cache"].count == 2
    assert entries.get(old) is None and entries.get(used) == used + b" value" and entries.get(pinned) == pinned + b" value"
    assert store.backend.stat(index_path(old)) is None and report.deleted["blobs"].count == 2  # its value and kernel
