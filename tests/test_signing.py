"""Signed manifests and tuning documents (issue 9): a store written with FARM_SIGNING_KEY is
read by consumers holding only the public key; a tampered or unsigned manifest is refused
by workers answering hits, `farm fetch`, `farm.client` and `load_tuned`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from scheduler.spec import parse_job
from scheduler.jobs import execute
from storage import store_from_uri
from storage.signing import UntrustedDocument, keygen
from storage.store import manifest_path
from storage.tuning import inductor_entries, put_inductor_shard
from tests.cli import farm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> tuple[Path, Path]:
    return keygen(tmp_path_factory.mktemp("keys") / "farm")


@pytest.fixture(scope="module")
def signed_store(keys, zoo_dir, tmp_path_factory):
    """mlp lowered by a worker holding the signing key (core-aten: signing is every target's, and
    this one builds no C++)."""
    uri = str(tmp_path_factory.mktemp("signed") / "store")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FARM_SIGNING_KEY", str(keys[0]))
        mp.delenv("FARM_VERIFY_KEY", raising=False)
        outcome = execute(parse_job({"name": "signed", "graphs": [str(zoo_dir / "mlp.pt2")], "targets": ["core-aten"]}),
                          store_from_uri(uri))
    (mlp,) = outcome.results
    assert mlp.status == "compiled", mlp.error
    return uri, mlp.key


def _consumer(monkeypatch, keys) -> None:
    monkeypatch.delenv("FARM_SIGNING_KEY", raising=False)
    monkeypatch.setenv("FARM_VERIFY_KEY", str(keys[1]))


def test_a_signed_store_is_read_by_a_consumer_with_only_the_public_key(signed_store, keys, monkeypatch, zoo_dir, tmp_path):
    uri, key = signed_store
    raw = json.loads(store_from_uri(uri).backend.read(manifest_path(key)))
    assert raw["signature"]["alg"] == "ed25519"
    _consumer(monkeypatch, keys)
    store = store_from_uri(uri)
    assert store.get_manifest(key)["key"] == key
    again = execute(parse_job({"name": "again", "graphs": [str(zoo_dir / "mlp.pt2")], "targets": ["core-aten"]}), store)
    assert again.results[0].status == "hit", again.results[0].error
    out = farm("fetch", key, str(tmp_path / "m.pt2"), "--store", uri)
    assert "manifest signed (ed25519" in out and (tmp_path / "m.pt2").exists(), out


def test_a_tampered_manifest_is_refused_everywhere(signed_store, keys, monkeypatch, zoo_dir, tmp_path):
    uri, key = signed_store
    store = store_from_uri(uri)
    path = manifest_path(key)
    original = store.backend.read(path)
    manifest = json.loads(original)
    manifest["blobs"]["artifact"] = manifest["blobs"]["program"]  # point it at another blob
    store.backend.write(path, json.dumps(manifest).encode())
    try:
        _consumer(monkeypatch, keys)
        consumer = store_from_uri(uri)
        with pytest.raises(UntrustedDocument, match="does not match"):
            consumer.get_manifest(key)
        out = farm("fetch", key, str(tmp_path / "m.pt2"), "--store", uri)
        assert "does not match" in out, out
        assert not (tmp_path / "m.pt2").exists()
        job = parse_job({"name": "tampered", "graphs": [str(zoo_dir / "mlp.pt2")], "targets": ["core-aten"]})
        (result,) = execute(job, consumer).results
        assert result.status == "failed" and "does not match" in result.error, result.error
        # a valid signature does not travel to another key's path
        other = "0" * 64
        consumer.backend.write(manifest_path(other), original)
        with pytest.raises(UntrustedDocument):
            consumer.get_manifest(other)
    finally:
        store.backend.write(path, original)


def test_an_unsigned_store_is_refused_by_a_consumer_that_requires_signatures(zoo_runs, keys, monkeypatch, tmp_path):
    store, cold, *_ = zoo_runs
    key = cold.results[0].key
    out = farm("fetch", key, str(tmp_path / "plain.pt2"), "--store", store.uri)
    assert "manifest unsigned" in out and (tmp_path / "plain.pt2").exists(), out
    _consumer(monkeypatch, keys)
    with pytest.raises(UntrustedDocument, match="unsigned"):
        store_from_uri(store.uri).get_manifest(key)
    out = farm("fetch", key, str(tmp_path / "m.pt2"), "--store", store.uri)
    assert "unsigned" in out and not (tmp_path / "m.pt2").exists(), out
    from farm.client import load_tuned

    with pytest.raises(UntrustedDocument):
        load_tuned(key, store.uri, tmp_path)


def test_shared_autotune_timings_are_signed_and_unsigned_shards_ignored(keys, monkeypatch, tmp_path):
    uri = str(tmp_path / "store")
    entry = [("mm", "inputs", "fp32", "choice", 0.5)]
    monkeypatch.delenv("FARM_SIGNING_KEY", raising=False)
    monkeypatch.delenv("FARM_VERIFY_KEY", raising=False)
    put_inductor_shard(store_from_uri(uri), "fp", {}, entry)  # written without a key
    monkeypatch.setenv("FARM_SIGNING_KEY", str(keys[0]))
    signer = store_from_uri(uri)
    entries, refused = inductor_entries(signer, "fp")
    assert entries == [] and len(refused) == 1 and "unsigned" in refused[0]
    put_inductor_shard(signer, "fp", {}, [("mm", "inputs", "fp32", "other", 0.25)])
    _consumer(monkeypatch, keys)
    entries, refused = inductor_entries(store_from_uri(uri), "fp")
    assert entries == [("mm", "inputs", "fp32", "other", 0.25)] and len(refused) == 1


def test_keygen_from_the_command_line_never_overwrites_a_key_and_says_where_it_cannot_write(tmp_path):
    said = farm("keygen", str(tmp_path / "keys"))
    assert f"wrote {tmp_path / 'keys' / 'signing.pem'}" in said
    private = (tmp_path / "keys" / "signing.pem").read_bytes()
    assert (tmp_path / "keys" / "signing.pem").stat().st_mode & 0o777 == 0o600
    assert "signing.pem exists; pick an empty folder" in farm("keygen", str(tmp_path / "keys"))
    assert (tmp_path / "keys" / "signing.pem").read_bytes() == private
    (tmp_path / "a-file").write_text("")
    assert f"cannot write keys into {tmp_path / 'a-file'}: it is a file" in farm("keygen", str(tmp_path / "a-file"))
