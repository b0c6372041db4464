"""The farm in Ray's views and in scripts (issue 14): metrics scraped from a real Ray metrics
agent, the Grafana dashboard's queries, a Ray Job's progress through the dashboard's REST API,
the Python API against `--json`, key prefixes, and a trace per compile rendered by tlparse."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from farm import client
from tests.cli import farm
from tests.sockets import free_port

ROOT = Path(__file__).resolve().parents[1]
GRAFANA = ROOT / "infra" / "grafana" / "farm-dashboard.json"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def api_session(ray_cluster, zoo_dir, tmp_path_factory):
    """tests/fixtures/api_session.py in its own process, while the session's cluster runs: an
    embedded Ray, the job twice with metrics on."""
    d = tmp_path_factory.mktemp("api")
    job = d / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "api", "graphs": [str(zoo_dir / "mlp.pt2"), str(zoo_dir / "cnn.pt2")],
                                   "targets": ["aoti-cpu"]}))
    store = str(d / "store")
    # RAY_AUTH_MODE unset, as a newcomer's is (its token from RAY_AUTH_TOKEN, so none is written to HOME)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    # Ray's agents export every 2 s, not every 10; a gauge stays two intervals after its last export
    env["RAY_metrics_report_interval_ms"] = "2000"
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "fixtures" / "api_session.py"), str(job), store,
                           str(free_port())], env=env, cwd=d, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return store, {**json.loads(proc.stdout.strip().splitlines()[-1]), "stderr": proc.stderr}


def test_the_embedded_ray_is_its_own_while_another_cluster_runs(api_session, ray_cluster):
    _, seen = api_session
    assert seen["embedded"] == [True, True]  # the second submit reused the first one's Ray
    assert seen["gcs"][0] == seen["gcs"][1] and seen["gcs"][0] != ray_cluster.address
    # …on loopback alone: its GCS, raylet, workers, dashboard and agents
    assert len(seen["listening"]) >= 5 and {address for _, address, _ in seen["listening"]} == {"127.0.0.1"}, \
        seen["listening"]
    # token auth on, as Ray sets it for a local cluster, without Ray's advice to opt out or its INFO lines
    assert "RAY_AUTH_MODE=disabled" not in seen["stderr"] and "Started a local Ray instance" not in seen["stderr"], \
        seen["stderr"][-3000:]


def test_a_job_then_its_repeat_are_counted_in_rays_metrics(api_session):
    _, seen = api_session
    assert seen["units"].get("compiled") == 2 and seen["units"].get("hit") == 2, seen["units"]
    for name in ("ray_farm_phase_seconds_bucket", "ray_farm_queue_depth", "ray_farm_workers", "ray_farm_bytes_total",
                 "ray_farm_hit_rate", "ray_farm_compile_seconds_saved_total", "ray_farm_compile_seconds_total"):
        assert name in seen["metric_names"], (name, seen["metric_names"])


def test_every_grafana_query_names_a_metric_the_farm_exports(api_session):
    _, seen = api_session
    dashboard = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for what in ("throughput", "hit rate", "phase time", "queue depth", "failures"):
        assert what in titles
    named = {m for e in exprs for m in re.findall(r"\b(ray_\w+)", e)}
    assert named and named <= set(seen["metric_names"]), named - set(seen["metric_names"])


def test_the_python_api_matches_the_cli_json(api_session):
    store, seen = api_session
    warm = seen["warm"]
    rows = json.loads(farm("results", warm["job_id"][:-3], "--json", "--store", store))  # a unique prefix
    assert rows == warm["rows"] and {r["status"] for r in rows} == {"hit"}
    status = json.loads(farm("status", warm["job_id"], "--json", "--store", store))
    assert status["state"] == "done" and status["hit"] == 2 and status["stats"] == warm["stats"]
    assert client.job(warm["job_id"], store).results().to_pylist() == rows
    # and for people: the same job as a line and a table
    assert "done" in farm("status", warm["job_id"], "--store", store) and "hit 2" in farm("status", warm["job_id"], "--store", store)
    table = farm("results", warm["job_id"], "--store", store)
    assert "mlp" in table and "cnn" in table and "hit rate 100%" in table
    assert warm["stats"]["hit_rate"] == 1.0 and seen["cold"]["stats"]["compiled"] == 2


def test_a_ray_job_shows_its_progress_in_the_dashboards_job_list(api_session, ray_cluster):
    """`farm submit` as a Ray Job on the session's cluster (all hits), then the dashboard's REST
    API, with Ray's token, as an operator's tools would read it."""
    import time
    import urllib.request

    from ray.job_submission import JobStatus, JobSubmissionClient

    store, seen = api_session
    job_file = Path(store).parent / "job.yaml"
    auth = {"Authorization": f"Bearer {os.environ['RAY_AUTH_TOKEN']}"}
    jobs = JobSubmissionClient(ray_cluster.dashboard, headers=auth)
    submission = jobs.submit_job(entrypoint=f"{sys.executable} -m farm submit {job_file} --store {store}")
    deadline = time.monotonic() + 300
    while not jobs.get_job_status(submission).is_terminal() and time.monotonic() < deadline:
        time.sleep(1)
    logs = "\n".join(line for line in jobs.get_job_logs(submission).splitlines() if "│" not in line)[-3000:]
    assert jobs.get_job_status(submission) == JobStatus.SUCCEEDED, logs
    with urllib.request.urlopen(urllib.request.Request(f"{ray_cluster.dashboard}/api/jobs/", headers=auth)) as r:
        listed = next(j for j in json.loads(r.read()) if j.get("submission_id") == submission)
    meta = listed["metadata"]
    assert meta.get("farm_progress", "").startswith("farm: 2/2 units") and "hits 2" in meta["farm_progress"], (meta, logs)
    results = meta["farm_results"].removeprefix("file://")
    assert results == f"{Path(store).resolve()}/jobs/{meta['farm_job_id']}/results.parquet" and Path(results).is_file()
    assert "hit rate 100%" in meta["farm_stats"] and meta["farm_status"].startswith(f"farm status {meta['farm_job_id']}")


def test_fetch_explain_and_trace_take_the_prefix_tables_print(api_session, tmp_path):
    store, seen = api_session
    key = next(r["key"] for r in seen["warm"]["rows"] if r["graph"] == "mlp")
    fetched = json.loads(farm("fetch", key[:16], str(tmp_path / "mlp.pt2"), "--json", "--store", store))
    assert fetched["key"] == key and (tmp_path / "mlp.pt2").stat().st_size == fetched["bytes"]
    same = json.loads(farm("explain", key[:16], key[:12] + "…", "--json", "--store", store))
    assert same == {"a": key, "b": key, "diffs": []}
    assert "give at least 6 characters" in farm("fetch", key[:4], str(tmp_path / "x.pt2"), "--store", store)

    out = farm("trace", key[:16], "--out", str(tmp_path / "trace"), "--store", store)
    index = tmp_path / "trace" / "report" / "index.html"
    assert str(index) in out and index.is_file()
    report = " ".join(p.read_text(errors="replace") for p in (tmp_path / "trace" / "report").rglob("*.txt"))
    assert "addmm" in report and "gelu" in report  # the MLP's operators, as Inductor saw them
    (tmp_path / "a-file").write_text("")
    said = farm("trace", key[:16], "--out", str(tmp_path / "a-file"), "--store", store)
    assert f"cannot write {tmp_path / 'a-file'}: " in said and "Traceback" not in said, said


def test_a_failed_lowering_keeps_its_trace(zoo_dir, tmp_path, monkeypatch):
    """The worker's CXX (a job may not name the compiler) is g++ that refuses to link: the lowering
    gets as far as the C++ compile and fails there. The scalar target needs no ISA probe (a link)."""
    store = str(tmp_path / "store")
    tools = tmp_path / "tools"  # on PYTHONPATH, so the jail binds it in (read-only)
    tools.mkdir(mode=0o755)
    cxx = tools / "g++-that-cannot-link"
    cxx.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = -shared ] && { echo "cannot link" >&2; exit 1; }; done\n'
                   'exec g++ "$@"\n')
    cxx.chmod(0o755)
    tools.chmod(0o755)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tools), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("CXX", str(cxx))
    run = client.run({"name": "broken", "graphs": [str(zoo_dir / "mlp.pt2")], "targets": ["aoti-cpu:x86-64"]}, store)
    (row,) = run.results().to_pylist()
    assert row["status"] == "failed" and row["trace_digest"], row["error"]
    assert "cannot link" in row["error"] or "CppCompileError" in row["error"], row["error"]
    out = farm("trace", row["key"][:12], "--out", str(tmp_path / "trace"), "--store", store)
    assert "failed" in out
    report = " ".join(p.read_text(errors="replace") for p in (tmp_path / "trace" / "report").rglob("*.txt"))
    assert "addmm" in report


def test_a_cluster_nothing_answers_on_fails_fast_and_says_what_to_do(tmp_path, zoo_dir):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"graphs": [str(zoo_dir / "mlp.pt2")], "targets": ["aoti-cpu"]}))
    port = free_port()
    done = subprocess.run([sys.executable, "-m", "farm", "submit", str(job), "--address", f"127.0.0.7:{port}",
                           "--store", str(tmp_path / "s")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    err = done.stderr
    assert f"could not join the Ray cluster at 127.0.0.7:{port}" in err and "nothing answers" in err
    assert "RAY_AUTH_TOKEN is set" in err and "ray get-auth-token" in err and "Traceback" not in err
    assert os.environ["RAY_AUTH_TOKEN"] not in err  # where the token was looked for, never the token


def _watched(store_dir: Path, *extra: str) -> str:
    """`farm status JOB --watch` in a process of its own (its output a pipe, as in CI) while the
    job's status document goes from running (one unit compiled, one in flight) to done: once the
    watch has printed the running state (in a log), or a second after it started (--json, which
    prints only the end); its stdout."""
    import select
    import time

    from scheduler.jobs import STATUS_FILE
    from storage import store_from_uri

    store = store_from_uri(str(store_dir))
    doc = {"job_id": "w-20261123-120000-abcd", "state": "running", "total": 2, "queued": 0, "running": 1, "compiled": 1,
           "hit": 0, "failed": 0, "retries": 0, "running_units": [{"graph": "cnn", "target": "aoti-cpu", "since": time.time()}]}
    store.put_job_file(doc["job_id"], STATUS_FILE, json.dumps(doc).encode())
    watch = subprocess.Popen([sys.executable, "-m", "farm", "status", "w-2026", "--watch", "--every", "0.2", *extra,
                              "--store", str(store_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        if "--json" in extra:
            first = ""
            time.sleep(1.0)
        else:  # the watch has read the running state (bounded: a watch that says nothing fails here)
            assert select.select([watch.stdout], [], [], 120)[0], "the watch printed nothing in 120 s"
            first = watch.stdout.readline()
        store.put_job_file(doc["job_id"], STATUS_FILE, json.dumps({**doc, "state": "done", "running": 0, "compiled": 2,
                                                                  "running_units": []}).encode())
        out, err = watch.communicate(timeout=120)
    finally:
        watch.kill()
    assert watch.returncode == 0, err
    return first + out


def test_status_watch_follows_the_job_in_the_store_until_it_ends(tmp_path):
    """The store's status document goes from running to done while `farm status --watch` reads it.
    In a log, each change is one line (no table redrawn); with --json, stdout is the JSON alone."""
    lines = _watched(tmp_path / "store").splitlines()
    assert [line.split(" · ")[0] for line in lines] == ["w-20261123-120000-abcd: running", "w-20261123-120000-abcd: done"]
    assert "compiled 1" in lines[0] and "compiled 2" in lines[1]
    final = json.loads(_watched(tmp_path / "store-json", "--json"))
    assert final["state"] == "done" and final["compiled"] == 2


def test_a_cluster_that_refuses_this_process_is_said_at_once_with_the_fix(ray_cluster, tmp_path, zoo_dir):
    """The session's cluster wants its token. A process with RAY_AUTH_MODE unset (Ray then sends
    none, though ~/.ray/auth_token may exist, and `ray start` turned auth on because it did), or
    with another token, is told so at once, not after Ray's 20 s of retries, with what to set."""
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"graphs": [str(zoo_dir / "mlp.pt2")], "targets": ["aoti-cpu"]}))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    for case, extra in (("no mode", {}), ("another token", {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "f" * 64})):
        done = subprocess.run([sys.executable, "-m", "farm", "submit", str(job), "--address", ray_cluster.address,
                               "--store", str(tmp_path / "s")], capture_output=True, text=True, timeout=120,
                              env={**env, **extra}, stdin=subprocess.DEVNULL)
        err = done.stderr
        # these words come only from the check made before `ray.init` (ray_session._joinable); after Ray's
        # own 20 s of retries the cause would be Ray's error (no time is compared: machines differ)
        assert done.returncode == 2 and "the cluster refused this process" in err and "Traceback" not in err, (case, err)
        assert ("export RAY_AUTH_MODE=token" in err) == (case == "no mode"), (case, err)
        assert "f" * 64 not in err and os.environ["RAY_AUTH_TOKEN"] not in err


def test_a_cluster_that_answers_but_refuses_the_token_is_named_as_the_likely_cause(monkeypatch):
    """What `farm submit --address` says after Ray gave up on a wrong token (Ray retries for about
    20 s first; the README recipe's cluster showed it end to end)."""
    from scheduler.ray_session import join_advice

    monkeypatch.setenv("RAY_AUTH_TOKEN", "not-the-clusters-token")
    text = join_advice("127.0.0.1:6390", ("192.0.2.2", 6390), True, "Failed to connect to Ray cluster at 192.0.2.2:6390")
    assert "could not join the Ray cluster at 127.0.0.1:6390" in text and "Ray connects to 192.0.2.2:6390 instead" in text
    assert "likely cause is the auth token" in text and "RAY_AUTH_TOKEN is set" in text and "ray get-auth-token" in text
    assert "not-the-clusters-token" not in text


_TWO_JOBS = """
import json, sys
from farm.client import run
from scheduler import kept_sandbox
statuses = [run({"name": g, "graphs": [sys.argv[1] + f"/{g}.pt2"], "targets": ["aoti-cpu"]}, sys.argv[2]).results()
            .column("status").to_pylist() for g in ("mlp", "cnn")]
print(json.dumps({"statuses": statuses, "children": kept_sandbox.KEPT.starts}))
"""


def test_a_process_runs_job_after_job_in_one_warm_sandbox(zoo_dir, tmp_path):
    """As a notebook would: two `farm.client.run` jobs in a fresh process whose environment names
    no Inductor cache (Inductor sets its default as it goes). Both compile; each job has a child of
    its own (issue 29: a child never serves two jobs), the next one started as a job ends."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    proc = subprocess.run([sys.executable, "-c", _TWO_JOBS, str(zoo_dir), str(tmp_path / "store")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"statuses": [["compiled"], ["compiled"]], "children": 3}, seen
