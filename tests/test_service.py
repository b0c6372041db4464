"""The farm as a service on a real two-node Ray cluster (tests/raycluster.py): jobs share its
warm workers by priority, survive their client and the scheduler's death, can be cancelled, and
bad requests are refused with the reason. No test here asserts a speed: order is judged by the
recorded start times."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from farm import client
from farm.service_client import ServiceRefused, connect
from scheduler.ray_service import SERVICE, ServiceError, call, find_service, start_service, stop_service
from scheduler.service_config import CacheSecrets, CacheSettings, ServiceConfig
from scheduler.spec import SpecError
from storage import store_from_uri
from storage.results import read_results
from storage.service_jobs import ServiceJobs
from tests.gang_models import replicas

pytestmark = pytest.mark.slow

CACHE_WRITER, CACHE_READER = "w" * 24, "r" * 24
CHEAP = "core-aten"  # a real lowering, seconds each; its class (x86-64) has one slot on the test cluster


@pytest.fixture(scope="module")
def service(ray_cluster, tmp_path_factory):
    store = str(tmp_path_factory.mktemp("service-store"))
    if find_service() is not None:  # left by an earlier run that was killed
        stop_service()
    start_service(store, ServiceConfig(idle_s=600, cache=CacheSettings(port=0)),
                  CacheSecrets((("ci", "write", CACHE_WRITER), ("alice", "read", CACHE_READER))))
    yield connect(ray_cluster.address)
    if find_service() is not None:
        stop_service()


def farm_cmd(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "farm", *args], capture_output=True, text=True, env=env, timeout=300,
                          stdin=subprocess.DEVNULL)


def _job(zoo_dir, graphs, name, target=CHEAP, **extra) -> dict:
    return {"name": name, "graphs": [str(zoo_dir / f"{g}.pt2") for g in graphs], "targets": [target], **extra}


def _wait(handle, timeout=600) -> dict:
    handle.wait(timeout=timeout, every=0.5)
    doc = handle.status()
    assert doc["state"] in ("done", "cancelled", "failed"), doc
    if doc["state"] == "done":  # the client reads the job's whole outcome back from the store
        assert handle.outcome is not None and len(handle.outcome.results) == doc["total"]
    return doc


def test_a_short_job_starts_before_the_long_jobs_remaining_units(service, ray_cluster, zoo_dir):
    graphs = ["mlp", "cnn", "encoder_block", "gpt"]
    long = client.submit(_job(zoo_dir, graphs, "nightly-zoo", priority="nightly"), address=ray_cluster.address,
                         wait=False)
    deadline = time.monotonic() + 300
    while not any(j == long.job_id for j, _, _ in call(service.actor, "unit_starts")):
        assert time.monotonic() < deadline, "the long job never started"
        time.sleep(0.2)
    short = client.submit(_job(zoo_dir, ["mlp"], "mine", target="core-aten", verify={"atol": 0.5}),
                          address=ray_cluster.address, wait=False, priority="interactive")
    assert _wait(short)["state"] == "done"
    assert _wait(long)["state"] == "done"
    starts = call(service.actor, "unit_starts")
    (short_start,) = [t for j, _, t in starts if j == short.job_id]
    queued_at = json.loads(short.store.get_job_file(short.job_id, "status.json"))["started_at"]
    long_starts = [t for j, _, t in starts if j == long.job_id]
    # every long unit that started after the short one was queued started after it
    assert [t for t in long_starts if t > short_start] or len(long_starts) == len(graphs), starts
    assert not [t for t in long_starts if _iso(queued_at) + 1 < t < short_start], (queued_at, starts)
    rows = read_results(short.store, long.job_id)
    assert sorted(r["graph"] for r in rows) == sorted(graphs) and all(r["status"] in ("compiled", "hit") for r in rows)


def _iso(text: str) -> float:
    import datetime as dt

    return dt.datetime.fromisoformat(text).timestamp()


def test_two_jobs_with_one_key_in_flight_compile_it_once(service, ray_cluster, zoo_dir):
    spec = _job(zoo_dir, ["cnn"], "twin", target="aoti-cpu:avx2")
    a = client.submit(spec, address=ray_cluster.address, wait=False)
    b = client.submit(spec, address=ray_cluster.address, wait=False)
    _wait(a), _wait(b)
    rows = read_results(a.store, a.job_id) + read_results(b.store, b.job_id)
    assert sorted(r["status"] for r in rows) == ["compiled", "hit"], [(r["status"], r["error"]) for r in rows]
    assert rows[0]["key"] == rows[1]["key"]


@ray.remote(num_cpus=1)
class _HoldsACpu:
    """As a farm service's warm worker does: it holds a CPU of Ray's while it lives."""

    def ready(self) -> bool:
        return True


def test_a_zoo_run_exports_beside_busy_workers_and_hands_every_job_of_its_run_to_the_service_at_once(
        service, ray_cluster, monkeypatch):
    """A zoo run exports its entries on the cluster while the service's warm workers hold every CPU
    (its exports, of one CPU each, waited for them to stop: up to FARM_IDLE_S, or behind other
    jobs), then makes one job per settings group. Every job of the run is handed over before the
    run waits for any, at priority nightly, so they share the service's workers (they used to run
    one after the other, the workers draining at each group's tail). Judged by the order of the
    run's own calls, which go to the real service: the units here take a fraction of a second."""
    from farm import nightly

    hogs = [_HoldsACpu.remote() for _ in range(int(ray.available_resources().get("CPU", 0)))]
    ray.get([h.ready.remote() for h in hogs], timeout=60)
    assert ray.available_resources().get("CPU", 0) < 1  # every CPU of the cluster is held now
    calls = []

    def handing_over(spec, *args, **kwargs):
        for hog in hogs:  # exported: the service may need a CPU back for a worker of the jobs' class
            ray.kill(hog)
        hogs.clear()
        calls.append(("submit", spec.name, kwargs.get("wait", True)))
        return client.submit(spec, *args, **kwargs)

    monkeypatch.setattr(nightly, "submit", handing_over)
    monkeypatch.setattr(nightly, "EXPORT_TIMEOUT_S", 120.0)  # (waiting for a CPU, an export fails by then)
    try:
        run = nightly.run_suite(str(Path(__file__).parent / "fixtures" / "two_groups_zoo.py"), service.store(),
                                address=ray_cluster.address,
                                follow=lambda handle: calls.append(("follow", handle.job_id)))
    finally:
        for hog in hogs:
            ray.kill(hog)
    assert sorted((r["model"], r["status"]) for r in run.rows) == [("deep", "compiled"), ("loose", "compiled"),
                                                                  ("wide", "compiled")], run.rows
    assert [c[0] for c in calls] == ["submit", "submit", "follow", "follow"], calls
    assert [c[2] for c in calls[:2]] == [False, False], calls
    jobs = {r["model"]: r["job_id"] for r in run.rows}
    assert jobs["wide"] == jobs["deep"] != jobs["loose"]  # two jobs, one per settings group
    assert [c[1] for c in calls[2:]] == [jobs["wide"], jobs["loose"]]
    assert {ServiceJobs(service.store()).get(j).priority for j in jobs.values()} == {"nightly"}


def test_a_later_gang_of_the_same_shape_runs_on_the_warm_ranks_of_an_earlier_one(service, ray_cluster, tmp_path):
    def gang_job(seed: int) -> dict:
        out = tmp_path / f"dp{seed}"
        out.mkdir()
        pattern = replicas(out, 2, seed=seed)  # other weights, another key: each job compiles
        job = {"name": f"dp{seed}", "gangs": [{"name": "dp", "ranks": pattern, "world_size": 2}], "targets": [CHEAP]}
        handle = client.submit(job, address=ray_cluster.address, wait=False)
        assert _wait(handle)["state"] == "done"
        rows = read_results(handle.store, handle.job_id)
        assert sorted(r["status"] for r in rows) == ["compiled", "hit"], [(r["status"], r["error"]) for r in rows]
        return {r["graph"]: r["worker"] for r in rows}

    def gang_ranks() -> set[str]:
        return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("farm-service/gang-rank/")}

    first = gang_job(1)
    warm = gang_ranks()
    assert len(warm) == 2, warm  # the gang's two ranks outlived it, named for the dashboard
    second = gang_job(2)
    assert second == first  # the same rank processes, rank for rank
    assert gang_ranks() == warm and call(find_service(), "load")["gang_ranks"]["reused"] >= 2


def test_cancel_stops_a_job_and_leaves_nothing_half_published(service, ray_cluster, zoo_dir):
    graphs = ["mlp", "cnn", "encoder_block", "gpt"]
    handle = client.submit(_job(zoo_dir, graphs, "cancelled", target="aoti-cpu:x86-64"), address=ray_cluster.address,
                           wait=False)
    deadline = time.monotonic() + 300
    while handle.status().get("running", 0) < 1:
        assert handle.status()["state"] not in ("done", "failed"), [r["error"] for r in read_results(handle.store, handle.job_id)]
        assert time.monotonic() < deadline, ("the job never ran a unit", call(service.actor, "load"), service.jobs())
        time.sleep(0.2)
    said = service.cancel(handle.job_id)
    assert said["units_stopped"] >= 1
    seen = []  # read often: a client polling its status must never see `done`, not even for a moment
    while not seen or seen[-1] not in ("done", "cancelled", "failed"):
        assert time.monotonic() < deadline + 600, seen[-5:]
        seen.append(handle.status()["state"])
        time.sleep(0.02)
    assert set(seen) <= {"running", "cancelled"}, seen
    assert _wait(handle)["state"] == "cancelled"
    rows = read_results(handle.store, handle.job_id)
    assert sorted(r["graph"] for r in rows) == sorted(graphs)
    assert any(r["status"] == "skipped" and "cancelled" in r["error"] for r in rows)
    for key in handle.store.manifest_keys():
        assert handle.store.complete_manifest(key)[1] is None
    with pytest.raises(ServiceRefused, match="already ended"):
        service.cancel(handle.job_id)
    with pytest.raises(ServiceRefused, match="no job nope"):
        service.cancel("nope")
    listed = {j["job_id"]: j for j in service.jobs()}
    assert listed[handle.job_id]["state"] == "cancelled" and listed[handle.job_id]["priority"] == "batch"


def test_a_client_that_goes_away_leaves_its_job_running_and_imports_no_torch(service, ray_cluster, zoo_dir, tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text(json.dumps(_job(zoo_dir, ["mlp"], "orphan", verify={"atol": 0.5})))
    code = ("import sys, ray; from farm import client; "
            f"h = client.submit({str(spec)!r}, address={ray_cluster.address!r}, wait=False); "
            "print(h.job_id, 'torch' in sys.modules, ray.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**ray_cluster.env})
    assert out.returncode == 0, out.stderr[-2000:]
    job_id, torch_imported, joined = out.stdout.split()[-3:]
    # it named only the cluster, read the service's store from it and used that store's inbox:
    # no Ray driver started (a second of start-up) and none to leave behind
    assert torch_imported == "False" and joined == "False"
    handle = client.job(job_id, service.store())
    assert _wait(handle)["state"] == "done"
    assert [r["status"] for r in read_results(handle.store, job_id)] in (["compiled"], ["hit"])


def test_a_client_finds_the_services_store_from_the_cluster_and_goes_through_ray_where_it_cannot_reach_it(
        service, ray_cluster, tmp_path, monkeypatch):
    import os

    from ray.experimental.internal_kv import _internal_kv_put

    from farm.service_client import find
    from scheduler.ray_session import NAMESPACE, SERVICE_STORE_KEY

    known = tmp_path / "services.json"
    monkeypatch.setenv("FARM_KNOWN_SERVICES", str(known))
    # A client imports no Ray at all: the first time on a machine it reads the service's store from the
    # cluster's KV over gRPC (scheduler/gcs_kv.py) and remembers it; later it checks that store's heartbeat
    no_ray = ("import sys; sys.modules['ray'] = None; from farm.service_client import find; "
              f"print(find({ray_cluster.address!r}, None).via)")
    for visit in ("first", "remembered"):
        done = subprocess.run([sys.executable, "-c", no_ray], capture_output=True, text=True, timeout=120,
                              env={**os.environ, **ray_cluster.env, "FARM_KNOWN_SERVICES": str(known)})
        assert done.returncode == 0 and done.stdout.strip() == "its store's inbox", (visit, done.stderr[-2000:])
        assert json.loads(known.read_text())[ray_cluster.address]["store"] == service.store_uri

    known.unlink()  # a machine that has not seen this cluster, where the service's store is out of reach
    elsewhere = tmp_path / "on-the-head-node-only"  # a local store of another machine
    _internal_kv_put(SERVICE_STORE_KEY, f"file://{elsewhere}".encode(), overwrite=True, namespace=NAMESPACE.encode())
    try:
        found = find(ray_cluster.address, None)
        assert found.via == "Ray" and found.store_uri == service.store_uri
        assert not elsewhere.exists() and not known.exists()  # not created here by looking, nor remembered
    finally:
        _internal_kv_put(SERVICE_STORE_KEY, service.store_uri.encode(), overwrite=True, namespace=NAMESPACE.encode())


def test_the_kv_read_without_ray_agrees_with_rays_client_and_says_when_it_cannot_read(service, ray_cluster,
                                                                                      monkeypatch):
    from ray.core.generated import gcs_service_pb2

    from scheduler import gcs_kv
    from scheduler.ray_session import service_store

    def shape(kind):
        return [(f.name, f.number, f.type, f.message_type and f.message_type.name) for f in kind.DESCRIPTOR.fields]

    for name, kind in gcs_kv._messages().items():  # the wire format Ray's GCS speaks, as its generated classes say
        assert shape(kind) == shape(getattr(gcs_service_pb2, name)), name

    for key, value in ray_cluster.env.items():
        if key.startswith("RAY_AUTH"):
            monkeypatch.setenv(key, value)
    assert gcs_kv.read_service_store(ray_cluster.address) == service_store(ray_cluster.address)
    assert gcs_kv.read_service_store(ray_cluster.address)[0] == service.store_uri
    monkeypatch.setenv("RAY_AUTH_TOKEN", "not-the-clusters-token")
    with pytest.raises(gcs_kv.Unread, match="UNAUTHENTICATED"):
        gcs_kv.read_service_store(ray_cluster.address)
    with pytest.raises(gcs_kv.Unread, match="UNAVAILABLE"):
        gcs_kv.read_service_store("127.0.0.1:9")  # nothing answers: the caller falls back to Ray's client
    with pytest.raises(gcs_kv.Unread, match="HOST:PORT"):
        gcs_kv.read_service_store("auto")


def test_bad_requests_are_refused_and_change_nothing(service, ray_cluster, zoo_dir, tmp_path, monkeypatch):
    before = [j["job_id"] for j in service.jobs()]
    with pytest.raises(SpecError, match="priority"):
        client.submit({**_job(zoo_dir, ["mlp"], "bad"), "priority": "urgent"}, address=ray_cluster.address)
    with pytest.raises(ServiceRefused, match="unknown priority 'urgent'"):
        client.submit(_job(zoo_dir, ["mlp"], "bad"), address=ray_cluster.address, priority="urgent")
    with pytest.raises(SpecError, match="targets"):
        client.submit({"graphs": [str(zoo_dir / "mlp.pt2")]}, address=ray_cluster.address)
    said = call(service.actor, "submit", {"graphs": ["/etc/passwd"], "targets": [CHEAP]}, None)
    assert "path on the submitting machine" in said["error"]
    with pytest.raises(ServiceRefused, match="keeps its artifacts in"):
        client.submit(_job(zoo_dir, ["mlp"], "bad"), address=ray_cluster.address, store=str(tmp_path / "other"))
    from farm import nightly  # a nightly into another store: refused before it exports anything

    monkeypatch.setattr(nightly, "run_tasks", lambda *args, **kwargs: pytest.fail("exported for a refused run"))
    with pytest.raises(ServiceRefused, match="keeps its artifacts in"):
        nightly.run_suite(str(Path(__file__).parent / "fixtures" / "two_groups_zoo.py"),
                          store_from_uri(str(tmp_path / "other")), address=ray_cluster.address)
    assert [j["job_id"] for j in service.jobs()] == before
    with pytest.raises(ServiceError, match="already runs"):
        start_service(str(tmp_path / "second"), ServiceConfig())
    assert call(find_service(), "ping")["store"] == service.store_uri
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with monkeypatch.context() as m:  # beside the running service: one whose store cannot be made says why
        m.setattr("scheduler.ray_service.NAMESPACE", "farm-cannot-start")
        with pytest.raises(ServiceError, match=r"could not start on the cluster: .*cannot create store directory"):
            start_service(str(blocked / "store"), ServiceConfig())
        assert find_service() is None  # stopped, its name free
    env = {**ray_cluster.env, "RAY_ADDRESS": ""}
    twice = farm_cmd(["serve", "--address", ray_cluster.address, "--store", str(tmp_path / "x")], env=env)
    assert twice.returncode == 2 and "already runs" in twice.stdout + twice.stderr
    nothing = farm_cmd(["serve", "--address", "127.0.0.1:9"], env=env)
    assert nothing.returncode == 2 and "nothing answers" in nothing.stdout + nothing.stderr
    unknown = farm_cmd(["cancel", "no-such-job", "--address", ray_cluster.address], env=env)
    assert unknown.returncode == 2 and "no job no-such-job" in unknown.stdout + unknown.stderr
    spec = tmp_path / "job.yaml"
    spec.write_text(json.dumps(_job(zoo_dir, ["mlp"], "cli")))
    urgent = farm_cmd(["submit", str(spec), "--address", ray_cluster.address, "--priority", "urgent"], env=env)
    assert urgent.returncode == 2 and "interactive" in urgent.stderr
    listed = farm_cmd(["jobs", "--json", "--address", ray_cluster.address], env=env)
    assert listed.returncode == 0 and {j["job_id"] for j in json.loads(listed.stdout)} == set(before)
    # and a good one, from the command line: handed over, its id printed, the client gone at once
    detached = farm_cmd(["submit", str(spec), "--address", ray_cluster.address, "--priority", "interactive",
                         "--detach"], env=env)
    assert detached.returncode == 0, detached.stdout + detached.stderr
    job_id = detached.stdout.strip().splitlines()[-1]
    handle = client.job(job_id, service.store())
    assert _wait(handle)["state"] == "done"
    assert {j["job_id"]: j["priority"] for j in service.jobs()}[job_id] == "interactive"
    assert SERVICE == "farm-scheduler"


def test_serve_warns_when_no_node_offers_the_farms_resources(service, ray_cluster, monkeypatch):
    """A head started without `--resources "$(farm resources)"` and no farm node yet: `farm serve`
    says every unit would fail, and how to add a node; on this cluster, which has one, nothing."""
    import ray

    from farm.service_cli import _builders_missing

    assert _builders_missing(ray_cluster.address) is None
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0, "memory": 1e9})
    said = _builders_missing(ray_cluster.address)
    assert "no node of this cluster offers the farm's resources" in said
    assert f'ray start --address {ray_cluster.address} --resources "$(farm resources)"' in said


def test_a_client_without_ray_hands_its_job_over_through_the_store(service, zoo_dir, tmp_path):
    """A laptop or CI runner that has the store but no Ray: `farm submit --store` sees the service's
    heartbeat, puts the job in the store's inbox and follows it there. A bad entry written straight
    into the inbox is refused in that job's status, and the service goes on."""
    import re

    from storage.service_jobs import ServiceInbox

    spec = tmp_path / "job.yaml"
    spec.write_text(json.dumps(_job(zoo_dir, ["mlp"], "no-ray", verify={"atol": 0.5})))
    done = _without_ray("submit", str(spec), "--store", service.store_uri, "--priority", "interactive")
    said = done.stdout + done.stderr
    assert done.returncode == 0 and "through its store's inbox" in said, said[-3000:]
    job_id = re.search(r"job (\S+) handed to the farm service", said).group(1)
    assert {j["job_id"]: j["priority"] for j in service.jobs()}[job_id] == "interactive"
    assert [r["status"] for r in read_results(service.store(), job_id)] in (["compiled"], ["hit"])
    listed = _without_ray("jobs", "--json", "--store", service.store_uri)
    assert listed.returncode == 0, listed.stderr[-3000:]
    row = {j["job_id"]: j for j in json.loads(listed.stdout)}[job_id]  # the same listing, from the store alone
    assert (row["priority"], row["state"], row["total"], row["hit"] + row["compiled"]) == ("interactive", "done", 1, 1)

    inbox = ServiceInbox(service.store())
    inbox.post("hostile-1", {"graphs": ["/etc/passwd"], "targets": [CHEAP]}, None)
    handle = client.JobHandle("hostile-1", service.store())
    handle.wait(timeout=60, every=0.25)
    doc = handle.status()
    assert doc["state"] == "rejected" and "path on the submitting machine" in doc["error"], doc
    assert not inbox.waiting("hostile-1") and "hostile-1" not in {j["job_id"] for j in service.jobs()}


def _without_ray(*args: str) -> subprocess.CompletedProcess:
    """`farm ARGS` on a machine with no Ray: `import ray` fails, and no cluster is named."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    no_ray = "import sys; sys.modules['ray'] = None; from farm.cli import app; app()"
    return subprocess.run([sys.executable, "-c", no_ray, *args], capture_output=True, text=True, env=env, timeout=300,
                          stdin=subprocess.DEVNULL)


def test_a_client_without_ray_cancels_a_job_through_the_store(service, zoo_dir, tmp_path):
    """`farm cancel --store`: the request goes in the store's inbox and the service answers there;
    a job that ended, or none, is refused with the reason."""
    spec = tmp_path / "job.yaml"  # keys no other test makes (weights: shapes), so its units compile, not hit
    spec.write_text(json.dumps(_job(zoo_dir, ["gpt", "encoder_block", "cnn", "mlp"], "cancelled-no-ray",
                                    target="aoti-cpu:x86-64", weights="shapes")))
    detached = _without_ray("submit", str(spec), "--store", service.store_uri, "--detach")
    assert detached.returncode == 0, detached.stderr[-3000:]
    job_id = detached.stdout.split()[-1]
    said = _without_ray("cancel", job_id, "--store", service.store_uri)
    assert said.returncode == 0 and f"job {job_id} cancelled" in " ".join(said.stdout.split()), said.stderr[-3000:]
    assert _wait(client.JobHandle(job_id, service.store()))["state"] == "cancelled"
    for job, reason in ((job_id, "already ended"), ("nope-1", "no job nope-1")):
        refused = _without_ray("cancel", job, "--store", service.store_uri)
        assert refused.returncode != 0 and reason in " ".join(refused.stderr.split()), refused.stderr[-3000:]


def test_the_service_serves_its_store_to_pytorchs_remote_caches_and_says_where_but_not_the_tokens(service):
    import redis

    info = call(find_service(), "ping")
    assert info["cache"].startswith("redis://NAME:TOKEN@127.0.0.1:") and info["cache_error"] is None
    assert CACHE_WRITER not in json.dumps(info) and CACHE_READER not in json.dumps(info)
    where = info["cache"].rsplit("@", 1)[1]
    key = "pt2:fx-graph-v1::service:c1"
    assert redis.Redis.from_url(f"redis://ci:{CACHE_WRITER}@{where}").set(key, b"entry")
    reader = redis.Redis.from_url(f"redis://alice:{CACHE_READER}@{where}")
    assert reader.get(key) == b"entry"
    with pytest.raises(redis.exceptions.NoPermissionError):
        reader.set(key, b"no")
    from storage import store_from_uri

    assert any(p.startswith("remote-cache/fx-graph-v1/") for p in store_from_uri(info["store"]).backend.list("remote-cache/"))


def test_the_services_metrics_reach_prometheus_and_its_dashboard_names_only_them(service, ray_cluster):
    import re
    import urllib.request
    from pathlib import Path

    dashboard = json.loads((Path(__file__).resolve().parents[1] / "infra" / "grafana" / "farm-service.json").read_text())
    named = {re.sub(r"_bucket$", "", m) for p in dashboard["panels"] for t in p["targets"]
             for m in re.findall(r"\b(ray_\w+)", t["expr"])}
    wanted = {"ray_farm_queue_wait_seconds", "ray_farm_service_units", "ray_farm_service_workers", "ray_farm_remote_cache"}
    assert named == wanted
    import redis

    where = call(find_service(), "ping")["cache"].rsplit("@", 1)[1]  # something for the cache's series to count
    redis.Redis.from_url(f"redis://alice:{CACHE_READER}@{where}").get("pt2:fx-graph-v1::metrics:c1")
    deadline, seen = time.monotonic() + 60, set()
    while not wanted <= seen and time.monotonic() < deadline:
        for url in ray_cluster.metrics:
            with urllib.request.urlopen(url, timeout=10) as r:
                text = r.read().decode()
            seen |= {re.sub(r"_(bucket|count|sum)$", "", m) for m in re.findall(r"^(ray_farm_\w+)", text, re.M)}
        time.sleep(1)
    assert wanted <= seen, seen


# Last in the module: Ray ends the scheduler's workers with it, so the tests after it would
# start theirs cold again.
def test_a_killed_scheduler_resumes_its_jobs_and_compiles_nothing_twice(service, ray_cluster, zoo_dir):
    graphs = ["mlp", "cnn", "encoder_block", "gpt"]
    handle = client.submit(_job(zoo_dir, graphs, "survivor", target="executorch:portable"), address=ray_cluster.address,
                           wait=False)
    deadline = time.monotonic() + 300
    while handle.status().get("compiled", 0) + handle.status().get("hit", 0) < 1:
        assert time.monotonic() < deadline, "no unit ended"
        time.sleep(0.3)
    before = set(handle.store.manifest_keys())
    ray.kill(find_service(), no_restart=False)  # as a crash would; Ray restarts it
    assert _wait(handle)["state"] == "done"
    rows = read_results(handle.store, handle.job_id)
    assert sorted(r["graph"] for r in rows) == sorted(graphs)  # one result per unit
    assert all(r["status"] in ("compiled", "hit") for r in rows), [r["error"] for r in rows]
    assert all(r["status"] == "hit" for r in rows if r["key"] in before), rows
    assert handle.job_id in call(find_service(), "ping")["resumed"]
