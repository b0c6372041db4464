"""One conformance suite for every store backend: the local directory and two S3 servers
(SeaweedFS, and moto's server: both honour conditional writes; one that ignores them is refused,
tests/test_s3_faults.py)."""
from __future__ import annotations

import hashlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from storage import CorruptBlob, Store, StoreError
from storage.results import read_results, write_results
from storage.store import blob_path, manifest_path


def test_blob_round_trip_is_content_addressed(store):
    ref = store.put_bytes(b"compiled bytes")
    assert ref.digest == hashlib.sha256(b"compiled bytes").hexdigest()
    assert store.get_bytes(ref.digest) == b"compiled bytes"
    assert store.put_bytes(b"compiled bytes") == ref  # idempotent
    assert store.has_blob(ref)


def test_large_file_goes_through_the_transfer_manager(store, tmp_path):
    src = tmp_path / "big.bin"
    src.write_bytes(bytes(range(256)) * (300 * 1024))  # 75 MiB: multipart on S3
    ref = store.put_file(src)
    dest = store.fetch(ref.digest, tmp_path / "out" / "big.bin")
    assert dest.read_bytes() == src.read_bytes()


def test_corrupt_blob_is_refused_on_every_read(store, tmp_path):
    ref = store.put_bytes(b"good bytes")
    store.backend.write(blob_path(ref.digest), b"evil bytes")  # someone tampered with the store
    with pytest.raises(CorruptBlob):
        store.get_bytes(ref.digest)
    dest = tmp_path / "x.bin"
    with pytest.raises(CorruptBlob):
        store.fetch(ref.digest, dest)
    assert not dest.exists()  # nothing half-verified is left behind


def test_missing_blob_is_an_error_not_empty_bytes(store):
    with pytest.raises(StoreError, match="missing"):
        store.get_bytes("0" * 64)


def test_the_end_of_a_blob_is_read_alone_and_a_short_or_missing_one_whole_or_none(store):
    ref = store.put_bytes(bytes(range(256)) * 4)
    assert store.backend.read_tail(blob_path(ref.digest), 10) == bytes(range(246, 256))
    assert store.backend.read_tail(blob_path(ref.digest), 5000) == bytes(range(256)) * 4  # (S3: a suffix range)
    assert store.backend.read_tail(blob_path("0" * 64), 10) is None


def test_manifest_is_published_once(store):
    ref = store.put_bytes(b"artifact")
    first = {"key": "k1", "blobs": {"artifact": ref.to_dict()}, "n": 1}
    assert store.publish_manifest("k1", first)
    assert not store.publish_manifest("k1", {**first, "n": 2})
    assert store.get_manifest("k1")["n"] == 1
    assert "k1" in set(store.manifest_keys())
    assert store.get_manifest("nope") is None


def test_manifest_pointing_at_missing_blob_is_never_published(store):
    missing = {"digest": "f" * 64, "size": 3}
    with pytest.raises(StoreError, match="not in"):
        store.publish_manifest("k2", {"blobs": {"artifact": missing}})
    assert store.get_manifest("k2") is None


def test_concurrent_publishers_one_winner(store):
    ref = store.put_bytes(b"artifact")
    wins = []

    def publish(i: int) -> None:
        if store.publish_manifest("race", {"blobs": {"artifact": ref.to_dict()}, "writer": i}):
            wins.append(i)

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    assert store.get_manifest("race")["writer"] == wins[0]


def test_results_table_round_trip(store):
    rows = [{"job_id": "j", "graph": "mlp", "target": "aoti-cpu", "status": "compiled", "total_s": 1.5, "artifact_bytes": 10}]
    write_results(store, "j", rows)
    back = read_results(store, "j")
    assert back[0]["graph"] == "mlp" and back[0]["total_s"] == 1.5 and back[0]["error"] is None
    assert "j" in store.job_ids()
    with pytest.raises(ValueError, match="not in the schema"):
        write_results(store, "j2", [{"bogus": 1}])


def test_a_key_is_found_by_the_unique_prefix_tables_print(store):
    from storage import UnknownKey

    ref = store.put_bytes(b"artifact")
    keys = ["8e0ed2c3fbec854b" + "0" * 48, "8e0ed2c3fbec854b" + "1" * 48, "1234abcd" + "2" * 56]
    for k in keys:
        assert store.publish_manifest(k, {"blobs": {"artifact": ref.to_dict()}})
    assert store.resolve_key("1234abcd") == keys[2]
    assert store.resolve_key("8e0ed2c3fbec854b1…") == keys[1]  # as a table prints it, ellipsis and all
    assert store.resolve_key(keys[0].upper()) == keys[0]
    for text, says in [("8e0ed2c3fbec854b", "2 keys"), ("ffffff", "no key"), ("8e0e", "at least 6"),
                       ("../../etc", "hex digits")]:
        with pytest.raises(UnknownKey, match=says):
            store.resolve_key(text)


def test_listing_and_stat_give_sizes_and_mtimes_and_touch_renews_only_the_mtime(store):
    ref = store.put_bytes(b"an artifact")
    path = blob_path(ref.digest)
    before = store.backend.stat(path)
    assert before.size == ref.size and abs(before.mtime - time.time()) < 120  # the server's clock, near ours
    listed = {i.path: i for i in store.backend.list_info("blobs/")}
    assert listed[path].size == ref.size and abs(listed[path].mtime - before.mtime) < 1.01
    time.sleep(1.1)  # S3 keeps LastModified to the second
    assert store.backend.touch(path)
    after = store.backend.stat(path)
    assert after.mtime > before.mtime and store.get_bytes(ref.digest) == b"an artifact"
    assert after.etag == before.etag == listed[path].etag  # the content's tag: the collector's index holds
    assert not store.backend.touch(blob_path("e" * 64)) and store.backend.stat(blob_path("e" * 64)) is None


def test_delete_many_goes_past_one_s3_batch(store):
    paths = [f"jobs/bulk/{i:05d}" for i in range(1003)]  # S3's DeleteObjects takes 1000 a call
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda p: store.backend.write(p, b"x"), paths))
    store.backend.delete_many(paths + ["jobs/bulk/never-was"])
    assert list(store.backend.list("jobs/bulk/")) == []


def test_a_use_renews_last_use_once_per_refresh_age(store):
    """A hit writes nothing while the unit's last-use mark is younger than the refresh age (a day
    by default); once it is older, the first use renews it, manifest and blobs, bytes unchanged."""
    ref = store.put_bytes(b"artifact bytes")
    manifest = {"key": "k", "blobs": {"artifact": ref.to_dict()}}
    assert store.publish_manifest("k", manifest)
    touched = []
    real_touch = store.backend.touch
    store.backend.touch = lambda p: touched.append(p) or real_touch(p)
    now = time.time()
    store.clock = lambda: now + 3600  # an hour later: the mark is young
    assert not store.note_use("k", manifest) and touched == []
    later = Store(store.backend, store.trust)  # another process, two days on: the mark is old
    later.clock = lambda: now + 2 * 86400
    assert later.note_use("k", manifest)
    assert sorted(touched) == sorted([manifest_path("k"), blob_path(ref.digest)])
    assert not later.note_use("k", manifest)  # that process asks the store again only a refresh age later
    after = Store(store.backend, store.trust)  # a third, half a day after the renewal: young again
    after.clock = lambda: time.time() + 86400 / 2
    assert not after.note_use("k", manifest) and len(touched) == 2
    assert store.get_manifest("k") == manifest and store.get_bytes(ref.digest) == b"artifact bytes"


def test_a_publish_right_after_its_uploads_copies_nothing_again_and_an_older_blob_is_made_young(store):
    """Publishing checks that every blob is there and young; one this process has just uploaded
    is not touched again (on S3 a touch is a copy of the whole artifact onto itself)."""
    old = store.put_bytes(b"a program uploaded by an earlier job")
    touched = []
    real_touch = store.backend.touch
    store.backend.touch = lambda p: touched.append(p) or real_touch(p)
    later = Store(store.backend, store.trust)  # the process that compiles, not the one that uploaded the program
    artifact, log = later.put_bytes(b"fresh artifact"), later.put_bytes(b"fresh log")
    manifest = {"key": "k4", "blobs": {"artifact": artifact.to_dict(), "log": log.to_dict(), "program": old.to_dict()}}
    assert later.publish_manifest("k4", manifest)
    assert touched == [blob_path(old.digest)]  # the blob it did not write, once
    assert later.complete_manifest("k4") == (manifest, None)


def test_a_manifest_whose_blob_is_gone_is_not_served_and_is_replaced_on_publish(store):
    ref, log = store.put_bytes(b"artifact"), store.put_bytes(b"log")
    first = {"key": "k3", "blobs": {"artifact": ref.to_dict(), "log": log.to_dict()}, "n": 1}
    assert store.publish_manifest("k3", first)
    store.backend.delete(blob_path(ref.digest))  # a collector, a lifecycle rule or a person
    manifest, why = store.complete_manifest("k3")
    assert manifest is None and "artifact" in why and "gone" in why
    again = store.put_bytes(b"artifact, built again")  # never the same bytes twice
    second = {**first, "blobs": {"artifact": again.to_dict(), "log": log.to_dict()}, "n": 2}
    assert store.publish_manifest("k3", second)
    assert store.complete_manifest("k3") == (second, None)
    assert not store.publish_manifest("k3", {**second, "n": 3})  # a complete one stands, as ever


def test_a_local_store_on_a_full_disk_says_so_and_leaves_no_temp_file(tmp_path, monkeypatch):
    """A write that fails midway (here os.fsync answers ENOSPC, as a full disk does) raises the
    store's error, not a bare OSError that ends the job, and one a retry would not fix."""
    import errno
    import os

    from storage import StoreUnwritable, store_from_uri

    store = store_from_uri(str(tmp_path / "store"))
    source = tmp_path / "artifact"
    source.write_bytes(b"x" * 1000)

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(StoreUnwritable, match=r"write file://.*/jobs/j/status.json failed: No space left on device "
                                              r"\(its disk is full: free space there, or run `farm gc`\)"):
        store.put_job_file("j", "status.json", b"{}")
    monkeypatch.setattr("shutil.copyfile", lambda src, dst: full(None))
    with pytest.raises(StoreUnwritable, match="upload .* failed: No space left on device"):
        store.put_file(source)
    assert [p for p in (tmp_path / "store").rglob("*") if p.is_file()] == []  # neither temp file stayed


def test_a_local_store_that_fails_a_read_names_the_path_and_the_cli_says_it_in_a_line(tmp_path):
    """A read the disk refuses (here a directory where a manifest should be; on a team's NFS
    store, a stale handle or an I/O error) is the store's error naming the path, as S3's are,
    never an OSError that ends the command in a traceback."""
    from storage import StoreError, store_from_uri
    from tests.cli import farm

    key = "ab" * 32
    (tmp_path / "store" / "units" / f"{key}.json").mkdir(parents=True)
    store = store_from_uri(str(tmp_path / "store"))
    with pytest.raises(StoreError, match=rf"read file://.*/units/{key}\.json failed: Is a directory"):
        store.backend.read(f"units/{key}.json")
    said = farm("fetch", key, str(tmp_path / "out"), "--store", str(tmp_path / "store"))
    assert f"units/{key}.json failed: Is a directory" in said and "Traceback" not in said, said
    assert not (tmp_path / "out").exists()
