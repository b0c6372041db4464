"""The store under S3 faults: a loopback proxy in front of the real SeaweedFS server resets
connections, answers 500/503 and stalls responses for a share of requests."""
from __future__ import annotations

from urllib.parse import urlparse

import pytest

from scheduler.spec import parse_job
from scheduler.jobs import execute
from storage import store_from_uri
from storage.store import blob_path
from tests.faulty_proxy import FaultyProxy

pytestmark = pytest.mark.slow


@pytest.fixture
def faulty_s3(s3_server, s3_uri, monkeypatch):
    """A proxy in front of the session's S3 server (faults off until a test sets `rate`), and
    this process's boto3 pointed at it."""
    upstream = urlparse(s3_server.endpoint)
    with FaultyProxy((upstream.hostname, upstream.port), stall_s=1.0, seed=11) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        yield proxy, s3_uri


def test_the_zoo_job_completes_correctly_at_a_ten_percent_fault_rate(faulty_s3, zoo_dir, monkeypatch, capsys):
    proxy, uri = faulty_s3
    proxy.rate = 0.10
    store = store_from_uri(uri)
    graphs = sorted(str(p) for p in zoo_dir.glob("*.pt2"))
    # core-aten: the store's path under test (leases, blobs, manifests, retries) is every target's,
    # and without a C++ build the job takes a third of aoti-cpu's time for as many requests
    outcome = execute(parse_job({"name": "faults", "graphs": graphs, "targets": ["core-aten"]}), store)
    proxy.rate = 0.0
    with capsys.disabled():
        print(f"\nS3 faults: {proxy.counts['requests']} requests, "
              f"{sum(n for k, n in proxy.counts.items() if k != 'requests')} faults injected "
              f"({', '.join(f'{k} {n}' for k, n in sorted(proxy.counts.items()) if k != 'requests')}), "
              f"{store.backend.retried} calls retried by the store, "
              f"{sum(r.status == 'compiled' for r in outcome.results)}/{len(graphs)} units compiled")
    assert sum(n for k, n in proxy.counts.items() if k != "requests") > 10  # the faults really happened
    assert [r.status for r in outcome.results] == ["compiled"] * len(graphs), [r.error for r in outcome.results]

    clean = store_from_uri(uri)  # read back without faults: what was published is whole and consistent
    for r in outcome.results:
        manifest = clean.get_manifest(r.key)
        for name, blob in manifest["blobs"].items():
            if blob:
                assert clean.backend.size(blob_path(blob["digest"])) == blob["size"], (r.graph, name)
        clean.fetch(manifest["blobs"]["artifact"]["digest"], zoo_dir.parent / f"check-{r.graph}")  # digest-checked
    assert not list(clean.backend.list("leases/"))


def test_reads_that_break_off_mid_body_are_attempted_again(faulty_s3):
    """Botocore retries a request that fails before its response; a body cut off halfway (or an
    error document cut off, which urllib3 raises as is) is the store's to retry."""
    proxy, uri = faulty_s3
    store = store_from_uri(uri)
    data = bytes(range(256)) * 4096  # 1 MiB: a response long enough to be cut
    store.backend.write("docs/big", data)
    proxy.rate, proxy.faults = 0.3, ("cut",)
    for _ in range(20):
        assert store.backend.read("docs/big") == data
        assert store.backend.read("docs/absent") is None  # a 404 whose error document is cut
    assert proxy.counts["cut"] > 5 and store.backend.retried > 0


def test_a_job_rides_out_its_s3_server_killed_and_restarted(zoo_dir, tmp_path, monkeypatch):
    """SIGKILL the S3 server while a job runs and start it again on the same data: units caught
    in the outage fail as transient, run again once it is back, and nothing partial is published."""
    import os
    import signal
    import threading
    import time

    from scheduler import jobs
    from scheduler.jobs import NoEvents
    from storage import s3
    from tests.seaweed import start_seaweed

    monkeypatch.setattr(s3, "ATTEMPTS", 1)  # no attempts again inside a store call: the outage reaches the units
    monkeypatch.setattr(s3, "BOTO_ATTEMPTS", 1)
    monkeypatch.setattr(jobs, "TRANSIENT_PAUSE_S", 6.0)
    data = tmp_path / "weed"
    server = start_seaweed(data)
    server.create_bucket("outage")
    servers = [server]
    upstream = urlparse(server.endpoint)
    with FaultyProxy((upstream.hostname, upstream.port)) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        for k, v in server.env().items():
            if k != "AWS_ENDPOINT_URL":
                monkeypatch.setenv(k, v)

        def outage() -> None:
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait()
            time.sleep(2)
            restarted = start_seaweed(data)  # same data, new ports: the proxy now forwards there
            servers.append(restarted)
            back = urlparse(restarted.endpoint)
            proxy.upstream = (back.hostname, back.port)

        class KillOnSecondStart(NoEvents):
            starts = 0

            def started(self, unit):
                self.starts += 1
                if self.starts == 2:
                    threading.Thread(target=outage).start()

        graphs = [str(zoo_dir / "cnn.pt2"), str(zoo_dir / "mlp.pt2")]  # the kill lands as the second starts
        try:
            store = store_from_uri("s3://outage/store")
            outcome = execute(parse_job({"name": "outage", "graphs": graphs, "targets": ["core-aten"]}), store,
                              events=KillOnSecondStart())  # core-aten: the store's path, without a C++ build
        finally:
            for s in servers:
                s.stop()
            servers.clear()
            restarted = start_seaweed(data)  # read back what was published, fault-free
            servers.append(restarted)
        try:
            monkeypatch.setenv("AWS_ENDPOINT_URL", restarted.endpoint)
            assert [r.status for r in outcome.results] == ["compiled"] * len(graphs), [r.error for r in outcome.results]
            assert max(r.retries for r in outcome.results) >= 1  # some unit failed in the outage and ran again
            clean = store_from_uri("s3://outage/store")
            for key in clean.manifest_keys():
                for blob in clean.get_manifest(key)["blobs"].values():
                    if blob:
                        assert clean.backend.size(blob_path(blob["digest"])) == blob["size"]
            assert sorted(clean.manifest_keys()) == sorted(r.key for r in outcome.results)
            assert not list(clean.backend.list("leases/"))
        finally:
            restarted.stop()


def test_a_server_that_ignores_conditional_writes_is_refused_not_raced(s3_server, s3_uri):
    """As if the server dropped `If-None-Match` (some S3 implementations do): the store probes
    once, and refuses to publish leases or manifests rather than let two writers both win."""
    from storage import Leases, Store, UnsafeStore
    from storage.s3 import S3Backend

    class Ignoring:  # the real client, minus the header the server would ignore
        def __init__(self, client):
            self._client = client

        def __getattr__(self, name):
            return getattr(self._client, name)

        def put_object(self, **kwargs):
            kwargs.pop("IfNoneMatch", None)
            return self._client.put_object(**kwargs)

    bucket = urlparse(s3_uri).netloc
    store = Store(S3Backend(bucket, "ignoring", client=Ignoring(s3_server.client())))
    ref = store.put_bytes(b"artifact")  # plain writes still work
    with pytest.raises(UnsafeStore, match="ignores conditional writes"):
        store.publish_manifest("k", {"blobs": {"artifact": ref.to_dict()}})
    with pytest.raises(UnsafeStore, match="refuses to publish"):
        Leases(store.backend, "worker").try_acquire("k", 0)
    assert store.get_manifest("k") is None and not list(store.backend.list("_probe/"))
