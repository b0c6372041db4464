"""`farm gc` in a loop, with a grace period of seconds, while three jobs compile and hit the same
keys on a real S3 server (SeaweedFS), and unreferenced blobs keep appearing for it to sweep."""
from __future__ import annotations

import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from farm.client import fetch
from scheduler.jobs import execute
from scheduler.spec import parse_job
from storage import BlobRef, store_from_uri
from storage.gc import Policy, collect
from storage.pins import pin

pytestmark = pytest.mark.slow

GRACE_S = 3.0


def test_jobs_beside_a_collector_in_a_loop_lose_nothing(zoo_dir, s3_uri, tmp_path, monkeypatch):
    monkeypatch.setenv("FARM_REFRESH_AGE_S", "0")  # every use renews the mark: the collector sees every hit
    graphs = [str(zoo_dir / "mlp.pt2"), str(zoo_dir / "cnn.pt2")]
    job = parse_job({"graphs": graphs, "targets": ["core-aten"]})  # the chaos is the store's: cheap compiles
    released = execute(parse_job({"graphs": graphs[:1], "targets": ["core-aten"]}), store_from_uri(s3_uri)).results[0]
    assert released.status == "compiled", released.error
    pin(store_from_uri(s3_uri), [released.key], label="release")

    stop, passes, swept, problems = threading.Event(), [], [], []

    def collector() -> None:
        s = store_from_uri(s3_uri)
        while not stop.is_set():
            for _ in range(5):  # garbage: blobs nothing will ever refer to
                s.put_bytes(secrets.token_bytes(64))
            try:
                report = collect(s, Policy(unused_days=1, grace_s=GRACE_S)).to_dict()
            except Exception as e:  # the test's verdict, not a crash of the thread
                problems.append(repr(e))
                return
            passes.append(report)
            swept.append(report["deleted"].get("blobs", {}).get("count", 0))
            time.sleep(0.2)

    loop = threading.Thread(target=collector, daemon=True)
    loop.start()
    try:
        with ThreadPoolExecutor(3) as pool:
            outcomes = list(pool.map(lambda _: execute(job, store_from_uri(s3_uri)), range(3)))
    finally:
        stop.set()
        loop.join(timeout=120)
    assert not problems and len(passes) >= 3 and sum(swept) > 0, (problems, len(passes), swept)

    store = store_from_uri(s3_uri)
    for outcome in outcomes:  # every unit has exactly one result, compiled or a hit
        assert sorted((r.graph, r.target) for r in outcome.results) == sorted(
            (g, "core-aten") for g in ("mlp", "cnn"))
        assert all(r.status in ("compiled", "hit") for r in outcome.results), [r.error for r in outcome.results]
        for r in outcome.results:  # no result points at a missing blob
            assert store.has_blob(r.artifact) and store.has_blob(r.log), (r.graph, r.target, r.status)
    for key in store.manifest_keys():  # every surviving manifest is complete
        assert store.complete_manifest(key)[1] is None, key
    path = tmp_path / "release.pt2"  # the pinned unit fetches and loads
    facts = fetch(released.key, path, store)
    assert store.has_blob(BlobRef(facts["sha256"], facts["bytes"]))
    x = torch.randn(8, 32)
    torch.testing.assert_close(torch.export.load(str(path)).module()(x),  # our own artifact: trusted here
                               torch.export.load(str(zoo_dir / "mlp.pt2")).module()(x), atol=1e-4, rtol=1e-4)
