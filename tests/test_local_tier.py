"""The workers' local disk tier in front of the store: a blob on disk is not fetched again,
a damaged copy is never handed out, and eviction keeps the cache under its limit."""
from __future__ import annotations

import os

import pytest

from storage import CacheConfig, TieredStore, store_from_uri
from storage.store import blob_path
from storage.tiered import LocalBlobCache


@pytest.fixture
def tiered(store, tmp_path):
    return TieredStore(store.backend, LocalBlobCache(CacheConfig(tmp_path / "disk-cache", max_bytes=3000)))


def test_second_fetch_comes_from_local_disk(tiered, store, tmp_path):
    ref = store.put_bytes(b"x" * 1000)
    tiered.fetch(ref.digest, tmp_path / "a")
    assert (tiered.transfer.downloaded, tiered.transfer.cached) == (1000, 0)
    out = tiered.fetch(ref.digest, tmp_path / "b")
    assert out.read_bytes() == b"x" * 1000
    assert (tiered.transfer.downloaded, tiered.transfer.cached) == (1000, 1000)


def test_what_a_worker_uploads_is_already_local(tiered, tmp_path):
    src = tmp_path / "artifact"
    src.write_bytes(b"compiled" * 100)
    ref = tiered.put_file(src)
    tiered.fetch(ref.digest, tmp_path / "again")
    assert tiered.transfer.downloaded == 0 and tiered.transfer.cached == ref.size


def test_a_full_cache_disk_costs_the_copy_not_the_upload_or_the_fetch(tiered, tmp_path, monkeypatch, caplog):
    import errno
    import shutil

    def full(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    src = tmp_path / "artifact"
    src.write_bytes(b"compiled" * 100)
    monkeypatch.setattr(shutil, "copyfile", full)  # the local store (the remote here) copies with it too
    monkeypatch.setattr(tiered.backend, "upload_file", lambda path, f: tiered.backend.write(path, f.read_bytes()))
    ref = tiered.put_file(src)
    assert tiered.backend.read(blob_path(ref.digest)) == b"compiled" * 100
    assert "not kept (No space left on device)" in caplog.text
    assert [p for p in tiered.cache.root.rglob("*") if p.is_file()] == []  # no temp file left behind
    monkeypatch.undo()
    assert tiered.fetch(ref.digest, tmp_path / "again").read_bytes() == b"compiled" * 100


def test_damaged_local_copy_is_dropped_and_fetched_again(tiered, store, tmp_path):
    ref = store.put_bytes(b"good" * 100)
    tiered.fetch(ref.digest, tmp_path / "a")
    cached = tiered.cache._path(ref.digest)
    os.chmod(cached, 0o644)
    cached.write_bytes(b"evil" * 100)  # disk rot, or someone editing the cache
    out = tiered.fetch(ref.digest, tmp_path / "b")
    assert out.read_bytes() == b"good" * 100
    assert tiered.transfer.downloaded == 800 and tiered.transfer.cached == 0


def test_eviction_keeps_the_cache_under_its_limit_least_recently_used_first(tiered, store, tmp_path):
    refs = [store.put_bytes(bytes([i]) * 1000) for i in range(3)]
    for i, ref in enumerate(refs):
        tiered.fetch(ref.digest, tmp_path / f"{i}")
        os.utime(tiered.cache._path(ref.digest), (1000 + i, 1000 + i))  # distinct ages, oldest first
    tiered.fetch(refs[0].digest, tmp_path / "use-0-again")  # now the youngest
    tiered.fetch(store.put_bytes(b"n" * 1000).digest, tmp_path / "new")  # 4000 > 3000: one must go
    assert tiered.cache.size() <= 3000
    assert not tiered.cache._path(refs[1].digest).exists()  # the least recently used
    assert tiered.cache._path(refs[0].digest).exists()


def test_only_remote_stores_get_a_tier(tmp_path, s3_uri):
    config = CacheConfig(tmp_path / "c")
    assert isinstance(store_from_uri(s3_uri, config), TieredStore)
    assert not isinstance(store_from_uri(str(tmp_path / "local"), config), TieredStore)
