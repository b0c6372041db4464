"""Shared fixtures: one SeaweedFS server and one exported zoo per session."""
from __future__ import annotations

import itertools
import os
import secrets
import time
from pathlib import Path

import pytest

# Ray reads its auth settings when it is first imported, so the test cluster's token is set
# before anything imports ray; the test process then joins the cluster like any driver would.
os.environ["RAY_AUTH_MODE"] = "token"
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))

from storage import store_from_uri

_bucket_ids = itertools.count()
# The modules whose tests start or join a Ray cluster. Under xdist (pyproject.toml: two workers)
# they run on one worker, in one group (the largest, so it starts first), against the session's one
# cluster; the embedded Ray takes Ray's default ports. Every other module is a group of its own, so
# its module fixtures (a compiled store, say) are made once. The README recipe's cluster
# (test_cluster_recipe) runs in PID and network namespaces of its own, so it goes with the others,
# which evens the two workers' loads (the Ray group was the longer by about 2 minutes).
RAY_MODULES = {"test_cuda_targets", "test_gang", "test_nightly", "test_observe", "test_ray_farm",
               "test_sandbox", "test_serialized_targets", "test_service"}


# The other modules go longest first (seconds each took in one run, 2 cores, 2026-11-29), so that
# the run ends on short ones: xdist's own order (most tests first) left the one-test README recipe
# (35 s) for last, with the other worker done and a core idle. Unlisted modules take a few seconds.
LONGEST_FIRST = ("test_remote_cache", "test_training", "test_sandbox_children", "test_autotune_share", "test_leases",
                 "test_autotune_specialize", "test_worker_start", "test_weights_and_cache_bundle", "test_s3_faults",
                 "test_s3_end_to_end", "test_bad_input", "test_cluster_recipe", "test_store_conformance",
                 "test_serialized_in_process", "test_jail", "test_pipeline_zoo", "test_tolerance_hits", "test_gang_early",
                 "test_explain", "test_gc_chaos", "test_hostile_archives")


def pytest_collection_modifyitems(items):
    """The Ray group first (the largest), then LONGEST_FIRST, then the rest as collected; each
    module's tests keep their order."""
    order = {stem: i for i, stem in enumerate(LONGEST_FIRST, start=1)}
    items.sort(key=lambda item: 0 if item.path.stem in RAY_MODULES else order.get(item.path.stem, len(order) + 1))


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # scopes go out in the order pytest_collection_modifyitems left

    class RayModulesTogether(LoadScopeScheduling):
        """xdist's --dist loadfile, with the Ray modules one scope (xdist_group marks cannot do it:
        xdist 3.8 reads them from `item.nodeid`, which pytest 9 no longer lets it change)."""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "ray" if Path(path).stem in RAY_MODULES else path

    return RayModulesTogether(config, log)


@pytest.fixture(scope="session", autouse=True)
def worker_disk_cache(tmp_path_factory) -> Path:
    """Workers' local blob tier (FARM_CACHE_DIR) and clients' known services in a session
    directory, not in ~/.cache."""
    d = tmp_path_factory.mktemp("farm-disk-cache")
    os.environ["FARM_CACHE_DIR"] = str(d)
    os.environ["FARM_KNOWN_SERVICES"] = str(d / "services.json")  # where clients remember each cluster's service
    return d


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    from tests.seaweed import start_seaweed  # boto3: only where a test needs S3

    server = start_seaweed(tmp_path_factory.mktemp("seaweed"))
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())  # boto3's standard chain is how the farm finds S3
    yield server
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


@pytest.fixture
def s3_uri(s3_server) -> str:
    bucket = f"farm-test-{next(_bucket_ids)}"
    s3_server.create_bucket(bucket)
    return f"s3://{bucket}/store"


@pytest.fixture
def local_uri(tmp_path) -> str:
    return str(tmp_path / "store")


@pytest.fixture
def tokens(tmp_path) -> Path:
    """A tokens file for `farm cache-serve`: `ci` writes, `alice` reads (tests/cache_endpoint.py)."""
    from tests.cache_endpoint import write_tokens

    return write_tokens(tmp_path / "tokens")


@pytest.fixture(scope="session")
def moto_endpoint():
    """A second S3 implementation (moto's server, from PyPI) on a free loopback port."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(params=["local", "s3", "moto"])
def store(request, tmp_path):
    if request.param == "local":
        return store_from_uri(str(tmp_path / "store"))
    if request.param == "moto":
        import boto3
        from botocore.config import Config

        from storage import Store
        from storage.s3 import S3Backend

        client = boto3.client("s3", endpoint_url=request.getfixturevalue("moto_endpoint"), region_name="us-east-1",
                              aws_access_key_id="moto", aws_secret_access_key="moto",
                              config=Config(retries={"max_attempts": 5, "mode": "standard"}))
        bucket = f"farm-moto-{next(_bucket_ids)}"
        client.create_bucket(Bucket=bucket)
        return Store(S3Backend(bucket, "store", client=client))
    return store_from_uri(request.getfixturevalue("s3_uri"))


@pytest.fixture(scope="session")
def zoo_dir(tmp_path_factory) -> Path:
    from farm.zoo import export_zoo

    d = tmp_path_factory.mktemp("zoo")
    export_zoo(d)
    return d


@pytest.fixture(scope="session")
def zoo_runs(zoo_dir, tmp_path_factory):
    """The zoo job run twice into one local store: cold, then unchanged."""
    from scheduler.jobs import execute
    from scheduler.spec import parse_job

    store = store_from_uri(str(tmp_path_factory.mktemp("zoo-store")))
    job = parse_job({"name": "zoo", "graphs": sorted(str(p) for p in zoo_dir.glob("*.pt2")), "targets": ["aoti-cpu"]})
    t0 = time.perf_counter()
    cold = execute(job, store)
    t1 = time.perf_counter()
    warm = execute(job, store)
    t2 = time.perf_counter()
    return store, cold, warm, t1 - t0, t2 - t1


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """Head (2 CPUs, builds avx2 and ExecuTorch programs) and a second node (1 CPU, builds only
    scalar x86-64, and claims one sm_90 GPU it does not have: a fake GPU class for routing), with
    the test process joined to it as the driver."""
    import ray

    from scheduler.ray_session import join
    from tests.raycluster import start_cluster

    cluster = start_cluster(tmp_path_factory.mktemp("inductor-cache"), head_resources={"farm_cpu_avx2": 2, "farm_executorch": 2},
                            node_resources={"farm_cpu_x86_64": 1, "farm_cuda_sm90": 1, "farm_cuda": 1}, node_gpus=1)
    join(cluster.address, namespace="farm", log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.stop()
