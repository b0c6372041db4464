"""The sandbox (issue 9): a crashing, hanging artifact fails only its own unit, within the
timeout, and the worker lives on, in process and on Ray; what a child loads and unpacks stays
with its unit, and a jailed child reaches neither the store nor Ray. (The children themselves,
their credentials, limits, zygote and starts: tests/test_sandbox_children.py, which needs no Ray
and so runs beside the Ray modules under xdist.)

The artifacts are real AOTInductor packages whose model library is replaced by one that
aborts, segfaults or sleeps when loaded. They reach a worker the way a poisoned store would
deliver them: a `weights: shapes` hit for another checkpoint loads the cached artifact to
verify it with this checkpoint's weights."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scheduler.jobs import execute
from scheduler.spec import parse_job
from storage import store_from_uri
from storage.store import manifest_path
from tests import hostile
from workers.sandbox import jail
from workers.sandbox.process import Sandbox
from workers.unit import UnitLimits

pytestmark = pytest.mark.slow

CRASHES = {"abort": ("abort();", "SIGABRT"), "segfault": ("raise(SIGSEGV);", "SIGSEGV"),
           "hang": ("for (;;) sleep(1000);", "timeout")}
TIMEOUT_S = 15  # a unit's limit once compiled: a hit's load and check take a few seconds
COMPILE_TIMEOUT_S = 120  # the first compile of the two, on a busy 2-core machine


def _job(zoo_dir: Path, timeout_s: float = TIMEOUT_S):
    return parse_job({"name": "crash", "graphs": [str(zoo_dir / "mlp.pt2"), str(zoo_dir / "cnn.pt2")],
                      "targets": ["aoti-cpu"], "weights": "shapes", "limits": {"timeout_s": timeout_s}})


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, zoo_dir):
    """A store with mlp and cnn compiled weights-agnostic, and mlp's manifest key and package."""
    root = tmp_path_factory.mktemp("crash-store")
    store = store_from_uri(str(root / "store"))
    outcome = execute(_job(zoo_dir, COMPILE_TIMEOUT_S), store)
    mlp = next(r for r in outcome.results if r.graph == "mlp")
    assert mlp.status == "compiled", mlp.error
    package = store.fetch(mlp.artifact.digest, root / "mlp-package.pt2")
    return store, mlp.key, package, root


def _poison(store, key: str, package: Path) -> None:
    """Point the manifest at another artifact, built 'with other weights' so a hit must load it."""
    manifest = store.get_manifest(key)
    manifest["blobs"]["artifact"] = store.put_file(package).to_dict()
    manifest["weights"]["built_with"] = "0" * 64
    store.backend.write(manifest_path(key), json.dumps(manifest).encode())


@pytest.mark.parametrize("crash", sorted(CRASHES))
def test_an_artifact_that_crashes_or_hangs_fails_only_its_unit(crash, compiled, zoo_dir, tmp_path):
    store, key, package, root = compiled
    body, named = CRASHES[crash]
    _poison(store, key, hostile.crashing_package(package, tmp_path / f"{crash}.pt2", body))
    pid = os.getpid()
    outcome = execute(_job(zoo_dir), store)
    results = {r.graph: r for r in outcome.results}
    mlp, cnn = results["mlp"], results["cnn"]
    assert mlp.status == "failed" and named in mlp.error, mlp.error
    assert cnn.status == "hit", cnn.error
    assert os.getpid() == pid  # the worker (this process) lived on
    log = store.get_bytes(mlp.log.digest).decode()
    assert "FAILED" in log and "the sandbox" in log


def test_on_ray_a_segfault_does_not_replace_the_worker(ray_cluster, compiled, zoo_dir, tmp_path):
    from scheduler.ray_pool import PoolConfig, RayRunner

    store, key, package, root = compiled
    _poison(store, key, hostile.crashing_package(package, tmp_path / "segv.pt2", "raise(SIGSEGV);"))
    job = parse_job({"name": "crash-ray", "graphs": [str(zoo_dir / "mlp.pt2"), str(zoo_dir / "cnn.pt2")],
                     "targets": ["aoti-cpu:avx2"], "weights": "shapes", "limits": {"timeout_s": TIMEOUT_S}})
    runner = RayRunner(PoolConfig(workers=1), job_id="crash-ray")
    outcome = execute(job, store, runner)
    results = {r.graph: r for r in outcome.results}
    assert results["mlp"].status == "failed" and "SIGSEGV" in results["mlp"].error, results["mlp"].error
    assert results["cnn"].status in ("hit", "compiled"), results["cnn"].error
    assert results["mlp"].retries == 0 and results["cnn"].retries == 0
    assert results["mlp"].worker == results["cnn"].worker  # one worker, same PID: never replaced
    assert all(s.generation == 1 for s in runner.slots)


PROBES = """
import sys
from torch._inductor import cpu_vec_isa
probed = []
probe = cpu_vec_isa.VecISA._probe_load
cpu_vec_isa.VecISA._probe_load = lambda self, path: probed.append(str(self)) or probe(self, path)
from farm.loading import load_compiled
load_compiled(sys.argv[1])
print(len(probed))
"""


def test_loading_a_package_asks_the_hosts_record_not_a_probe_per_isa(compiled, tmp_path):
    """torch's loader asks Inductor for the host's vector ISAs, which builds a probe per ISA in
    the process's own Inductor cache (4 s of g++ in a jailed child's) and loads each in a fresh
    Python (0.65 s in every process after). The host's record answers instead, in a sandbox child
    and in a training job's process alike."""
    _, _, package, _ = compiled
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    recorded = subprocess.run([sys.executable, "-c", "from workers.backends import cpu_isa; cpu_isa.host_vec_isas()"],
                              env=env, cwd=tmp_path, capture_output=True, text=True)
    assert recorded.returncode == 0, recorded.stderr[-2000:]
    out = subprocess.run([sys.executable, "-c", PROBES, str(package)], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "0", f"the load probed {out.stdout.split()[-1]} ISAs"


def test_what_a_child_unpacks_goes_with_its_unit(compiled, zoo_dir, tmp_path):
    """torch's AOTInductor loader unpacks every artifact it loads into $TMPDIR/aotinductor_*, and
    only the model's destructor removes it; a child is always killed in the end. The unpacked
    files must be in the unit's dir, which goes with the unit, never in /tmp."""
    from workers.unit import Target, Unit

    _, _, package, _ = compiled
    unit = Unit(graph="mlp", source="mlp.pt2", target=Target("aoti-cpu", weights="shapes"), program=None)
    with Sandbox() as sandbox, sandbox.workdir() as workdir:
        deadline = time.monotonic() + 120
        sandbox.call("identify", workdir, UnitLimits(), deadline, unit=unit, program=shutil.copy(zoo_dir / "mlp.pt2", workdir))
        reply = sandbox.call("check", workdir, UnitLimits(), deadline, unit=unit, artifact=shutil.copy(package, workdir),
                             verify_it=True, bench_it=False)
        assert reply["problems"] == [] and reply["checked"], reply
        assert list(workdir.glob("aotinductor_*")), "the loaded artifact was unpacked somewhere else"
        # what the child loaded, as it sees it: a look at /tmp itself would also see the unpacked
        # packages of the tests running beside this one (pytest-xdist), which are not the sandbox's
        maps = Path(f"/proc/{sandbox.pid}/maps").read_text().splitlines()
        loaded = {Path(line.split()[-1]) for line in maps if "/aotinductor_" in line}
        assert loaded and all(p.is_relative_to(workdir) for p in loaded), loaded


@pytest.mark.skipif(jail.problem_here() is not None, reason=f"no jail on this host: {jail.problem_here()}")
def test_a_jailed_child_reaches_neither_the_store_nor_ray(ray_cluster, s3_server, tmp_path):
    """The test's own SeaweedFS and Ray GCS ports, from code in a jailed child (tests/test_jail.py's probe)."""
    from urllib.parse import urlsplit

    from tests.test_jail import run_jailed

    s3, (ray_host, ray_port) = urlsplit(s3_server.endpoint), ray_cluster.address.split(":")
    tries = [("connect", [s3.hostname, s3.port]), ("connect", [ray_host, int(ray_port)])]
    for host, port in (t[1] for t in tries):  # both are up, for the host
        socket.create_connection((host, port), timeout=5).close()
    got = run_jailed(tries, tmp_path)["tries"]
    assert all(r != "ok" for r in got), got
