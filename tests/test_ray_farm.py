"""The farm on a real two-node Ray cluster: routing by device class, a worker killed
mid-compile, a unit past its timeout, and `farm submit` from the command line."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import yaml
import ray

from scheduler.spec import parse_job
from scheduler.jobs import execute
from scheduler.ray_pool import PoolConfig, RayRunner
from storage import store_from_uri
from storage.results import read_results

pytestmark = pytest.mark.slow


def _node_offering(resource: str) -> str:
    (node,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"]]
    return node[:8]


def _ray_listeners() -> list[tuple[str, str, int]]:
    """(process, address, port) of every TCP socket listening in a Ray process on this machine
    (GCS, raylets, agents, workers) or in this test process (a driver listens too)."""
    import psutil

    found = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status != psutil.CONN_LISTEN or conn.pid is None:
            continue
        try:
            proc = psutil.Process(conn.pid)
            command = " ".join(proc.cmdline()) or proc.name()
        except psutil.Error:
            continue  # ended since
        if conn.pid == os.getpid() or "ray" in command:
            found.append((command[:120], conn.laddr.ip, conn.laddr.port))
    return found


def test_the_cluster_listens_on_loopback_alone_and_the_farm_joins_it_by_127_0_0_1(ray_cluster):
    import ipaddress

    assert ray_cluster.address.startswith("127.0.0.1:")  # the fixture joined as any farm command does
    listeners = _ray_listeners()
    assert any("gcs_server" in p for p, _, _ in listeners) and any("raylet" in p for p, _, _ in listeners)
    exposed = []
    for entry in listeners:
        ip = ipaddress.ip_address(entry[1])
        if not (getattr(ip, "ipv4_mapped", None) or ip).is_loopback:  # gRPC lists 127.0.0.1 as ::ffff:127.0.0.1
            exposed.append(entry)
    assert not exposed, exposed  # 0.0.0.0 or :: would be every interface


def test_units_run_only_on_the_node_that_offers_their_isa(ray_cluster, zoo_dir, tmp_path):
    job = parse_job({"graphs": [str(zoo_dir / "mlp.pt2")], "targets": ["aoti-cpu:avx2", "aoti-cpu:x86-64"]})
    outcome = execute(job, store_from_uri(str(tmp_path)), RayRunner(PoolConfig(), job_id="routing"))
    assert len(outcome.results) == 2
    for r in outcome.results:
        assert r.status == "compiled", r.error
        resource = "farm_cpu_avx2" if r.target.endswith("avx2") else "farm_cpu_x86_64"
        assert f"node-{_node_offering(resource)}" in r.worker, (r.target, r.worker)


def test_a_killed_worker_is_replaced_and_its_unit_retried(ray_cluster, zoo_dir, tmp_path):
    job = parse_job({"graphs": [str(zoo_dir / "encoder_block.pt2"), str(zoo_dir / "cnn.pt2")],
                     "targets": ["aoti-cpu:avx2"]})
    runner = RayRunner(PoolConfig(retries=2), job_id="killed")
    store = store_from_uri(str(tmp_path))
    box = {}
    thread = threading.Thread(target=lambda: box.update(outcome=execute(job, store, runner)))
    thread.start()
    deadline = time.monotonic() + 120
    busy = {}
    while not busy and time.monotonic() < deadline:
        time.sleep(0.2)
        busy = runner.busy_workers() if runner.slots else {}
    assert busy, "no unit started within 120s"
    victim_unit, pid = next(iter(busy.items()))
    os.kill(pid, signal.SIGKILL)  # as the OOM killer would
    thread.join(timeout=600)
    outcome = box["outcome"]
    ids = [f"{r.graph}@{r.target}" for r in outcome.results]
    assert sorted(ids) == sorted(["encoder_block@aoti-cpu:avx2", "cnn@aoti-cpu:avx2"])  # each exactly once
    assert all(r.status == "compiled" for r in outcome.results), [r.error for r in outcome.results]
    assert outcome.retries >= 1
    retried = next(r for r in outcome.results if f"{r.graph}@{r.target}" == victim_unit)
    assert retried.retries == 1 and f"pid-{pid}" not in retried.worker
    rows = read_results(store, outcome.job_id)
    assert sum(r["retries"] for r in rows) >= 1


def test_a_unit_past_its_timeout_fails_fast_and_the_rest_compile(ray_cluster, zoo_dir, tmp_path):
    job = parse_job({
        "graphs": [str(zoo_dir / "cnn.pt2"), str(zoo_dir / "mlp.pt2")],
        "targets": [{"backend": "aoti-cpu", "isa": "avx2", "timeout_s": 2,
                     "options": {"max_autotune": True}},  # a compile that really takes longer than 2 s
                    "aoti-cpu:x86-64"],
    })
    runner = RayRunner(PoolConfig(), job_id="timeout")
    outcome = execute(job, store_from_uri(str(tmp_path)), runner)
    by_id = {f"{r.graph}@{r.target}": r for r in outcome.results}
    for uid in ("cnn@aoti-cpu:avx2", "mlp@aoti-cpu:avx2"):
        r = by_id[uid]
        # ended by its sandbox at the unit's own limit, not by the pool's grace period past it (which
        # would say "still running ... after its limit"); no wall-clock bound, since the sandbox's own
        # start on a busy machine is rightly not the unit's time
        assert r.status == "failed" and r.error and "timeout: no answer within the unit's time limit" in r.error, \
            (uid, r.error)
        assert r.retries == 0, (uid, r.retries)  # a timeout is the unit's, never retried
    for uid in ("cnn@aoti-cpu:x86-64", "mlp@aoti-cpu:x86-64"):
        assert by_id[uid].status == "compiled", by_id[uid].error
    avx2_slots = [s for s in runner.slots if s.resource == "farm_cpu_avx2"]
    assert avx2_slots and all(s.generation == 1 for s in avx2_slots)  # the sandbox died, never the worker


def test_two_jobs_submitted_at_once_compile_each_key_once(ray_cluster, zoo_dir, tmp_path):
    """Two users submit overlapping jobs to one cluster and store at the same moment; each job
    gets one avx2 worker, and between them each key is compiled once."""
    store = str(tmp_path / "store")
    graphs = [str(zoo_dir / "encoder_block.pt2"), str(zoo_dir / "cnn.pt2")]
    # an option no other test uses, so the cluster's Inductor cache has nothing for these compiles
    target = {"backend": "aoti-cpu", "isa": "avx2", "options": {"cpp.threads": 1}}
    procs = []
    for user in ("alice", "bob"):
        job_file = tmp_path / f"{user}.yaml"
        job_file.write_text(yaml.safe_dump({"name": user, "graphs": graphs, "targets": [target], "limits": {"workers": 1}}))
        procs.append(subprocess.Popen([sys.executable, "-m", "farm", "submit", str(job_file), "--store", store,
                                       "--address", ray_cluster.address], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs

    s = store_from_uri(store)
    rows = [r for job in s.job_ids() for r in read_results(s, job)]
    assert len(rows) == 4
    for key in {r["key"] for r in rows}:
        assert sorted(r["status"] for r in rows if r["key"] == key) == ["compiled", "hit"], rows
    assert len(list(s.manifest_keys())) == 2 and not list(s.backend.list("leases/"))
    # a hit that waited on the other job's lease (recorded only when a holder was seen), however long
    assert any(r["lease_wait_s"] is not None for r in rows if r["status"] == "hit"), rows


def test_hits_are_answered_before_any_worker_starts(ray_cluster, zoo_dir, tmp_path):
    """With lookup_first (the embedded Ray, whose workers share the driver's environment), a
    unit already in the store never waits for a worker; only misses start workers."""
    store = store_from_uri(str(tmp_path / "store"))
    graphs = [str(zoo_dir / "mlp.pt2")]
    (done,) = execute(parse_job({"graphs": graphs, "targets": ["aoti-cpu"]}), store).results  # in this process
    assert done.status == "compiled", done.error
    job = parse_job({"graphs": graphs, "targets": ["aoti-cpu", "aoti-cpu:x86-64"]})
    runner = RayRunner(PoolConfig(), job_id="lookup", lookup_first=True)
    outcome = execute(job, store, runner)
    status = {r.target: r.status for r in outcome.results}
    assert status == {"aoti-cpu": "hit", "aoti-cpu:x86-64": "compiled"}, [r.error for r in outcome.results]
    assert [s.resource for s in runner.slots] == ["farm_cpu_x86_64"]  # no avx2 worker was started


def test_workers_that_die_while_starting_fail_their_units_after_bounded_restarts(ray_cluster, zoo_dir, tmp_path,
                                                                                  monkeypatch):
    from scheduler import ray_pool

    class BrokenNode(ray_pool.CompileWorker):  # as on a node with a bad FARM_CACHE_GB: workers die in their constructor
        def __init__(self, *args):
            raise ValueError("FARM_CACHE_GB='lots' is not a number of gigabytes")

    monkeypatch.setattr(ray_pool, "_RemoteWorker", ray.remote(max_restarts=0)(BrokenNode))
    job = parse_job({"graphs": [str(zoo_dir / "mlp.pt2"), str(zoo_dir / "cnn.pt2")], "targets": ["aoti-cpu:avx2"]})
    outcome = execute(job, store_from_uri(str(tmp_path)), RayRunner(PoolConfig(start_attempts=3), job_id="broken"))
    assert [r.status for r in outcome.results] == ["failed", "failed"]
    for r in outcome.results:
        assert "farm_cpu_avx2 died while starting 3 times in a row" in r.error, r.error
        assert "ValueError: FARM_CACHE_GB='lots' is not a number of gigabytes" in r.error, r.error


def test_tasks_beside_a_services_workers_run_on_farm_nodes_no_more_at_once_than_their_cpus(ray_cluster):
    """Tasks that take none of Ray's CPUs (a zoo run's exports beside a farm service's warm
    workers: scheduler/ray_tasks.py) would all start at once, however many. On the test cluster
    (farm nodes of 2 and 1 CPUs) five of them run at most three at a time, and each reply comes
    back in its call's place; a task past the deadline, or never started by then, fails saying so."""
    from scheduler.ray_tasks import TaskFailed, run_tasks

    probe = ["sh", "-c", "date +%s.%N; sleep 1; date +%s.%N; echo $0"]  # $0: the call's number
    replies = run_tasks(subprocess.check_output, [([*probe, str(i)],) for i in range(5)], "probe", 120, beside=True)
    spans = [tuple(map(float, r.split()[:2])) for r in replies]
    assert [r.split()[2].decode() for r in replies] == [str(i) for i in range(5)]  # in the calls' order
    assert max(sum(a <= t < b for a, b in spans) for t, _ in spans) <= 3, spans  # one at a time per CPU
    late = run_tasks(subprocess.check_output, [(["sleep", "30"],)] * 4, "late", 3.0, beside=True)
    assert [r.error for r in late] == ["GetTimeoutError: the task ran past 3s"] * 3 + \
        ["the task did not start within 3s"] and all(isinstance(r, TaskFailed) for r in late)
