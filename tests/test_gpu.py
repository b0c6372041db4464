"""aoti-cuda on a real GPU (issue 10): a CUDA crash fails its unit, never the worker, and the
GPU is checked before the next unit; packages load without compiling anything; a target
for another architecture is refused before any work. Skipped where no GPU is visible; on
the lent GPU machine, bench/gpu_zoo.sh runs them."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from scheduler.plan import plan
from scheduler.spec import parse_job
from storage import store_from_uri
from workers.backends import cuda
from workers.pipeline import run_unit
from workers.sandbox.process import Sandbox

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _unit(zoo_dir: Path, store, target: str = "aoti-cuda"):
    (unit,) = plan(parse_job({"graphs": [str(zoo_dir / "mlp.pt2")], "targets": [target]}), store)
    return unit


def _segfault_once_lowering(sandbox: Sandbox, root: Path) -> None:
    """Crash the sandbox child the way a CUDA fault would, once it has started lowering (a unit's
    work dir is in the sandbox's own dir, workers/sandbox/process.py)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if sandbox.pid and list(root.glob("unit-*/.sandbox-lower.log")):
            os.kill(sandbox.pid, signal.SIGSEGV)
            return
        time.sleep(0.2)


@pytest.fixture(scope="module")
def gpu_store(tmp_path_factory):
    return store_from_uri(str(tmp_path_factory.mktemp("gpu-store")))


def test_a_crash_on_the_gpu_fails_the_unit_and_the_gpu_is_checked_before_the_next(gpu_store, zoo_dir, monkeypatch):
    probes = []
    real_probe = cuda.probe
    monkeypatch.setattr(cuda, "probe", lambda *a, **k: probes.append(1) or real_probe(*a, **k))
    unit = _unit(zoo_dir, gpu_store)
    with Sandbox() as sandbox:
        crasher = threading.Thread(target=_segfault_once_lowering, args=(sandbox, sandbox.root()))
        crasher.start()
        crashed = run_unit(unit, gpu_store, sandbox)
        crasher.join()
        assert crashed.status == "failed" and "SIGSEGV" in crashed.error, crashed.error
        probes.clear()
        result = run_unit(unit, gpu_store, sandbox)
    assert probes, "the GPU was not checked after the crash"
    assert result.status == "compiled", result.error
    assert result.metrics["max_abs_err"] < 1e-3 and result.metrics["compiled_ms"] > 0
    assert result.device["arch"] == cuda.own_gpu().arch and result.device["device"] == "cuda"
    assert result.components["target"]["arch"] == cuda.own_gpu().arch
    assert result.components["toolchain"]["cuda"] == torch.version.cuda


LOAD = r"""
import json, sys, torch
m = torch._inductor.aoti_load_package(sys.argv[1])
x = torch.randn(5, 32, device="cuda")
ep = torch.export.load(sys.argv[2])
from torch.export.passes import move_to_device_pass
want = move_to_device_pass(ep, "cuda").module()(x)
print(json.dumps({"err": float((m(x) - want).abs().max())}))
"""


def test_a_package_loads_and_runs_without_compiling_anything(gpu_store, zoo_dir, tmp_path):
    unit = _unit(zoo_dir, gpu_store)
    result = run_unit(unit, gpu_store)  # a hit after the test above, else a compile
    assert result.status in ("hit", "compiled"), result.error
    package = gpu_store.fetch(result.artifact.digest, tmp_path / "mlp.pt2")
    caches = {name: tmp_path / name for name in ("TRITON_CACHE_DIR", "CUDA_CACHE_PATH")}
    for d in caches.values():
        d.mkdir()
    env = {**os.environ, **{k: str(v) for k, v in caches.items()}, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind")}
    done = subprocess.run([sys.executable, "-c", LOAD, str(package), str(zoo_dir / "mlp.pt2")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["err"] < 1e-3
    jitted = {name: [p for p in d.rglob("*") if p.is_file()] for name, d in caches.items()}
    assert not any(jitted.values()), jitted  # no Triton compile, no PTX JIT by the driver


def test_a_target_for_another_architecture_is_refused_before_any_work(gpu_store, zoo_dir):
    other = "sm_80" if cuda.own_gpu().arch != "sm_80" else "sm_90"
    result = run_unit(_unit(zoo_dir, gpu_store, f"aoti-cuda:{other}"), gpu_store)
    assert result.status == "failed" and f"not {other}" in result.error, result.error
    assert "lower" not in result.timings


@pytest.mark.parametrize("target,extra_sizes", [("inductor-cache:cuda", 2), ("aot-compile:cuda", 0)])
def test_a_gpu_training_artifact_trains_a_fresh_process_with_no_compile(zoo_dir, tmp_path, target, extra_sizes):
    from scheduler.jobs import execute
    from tests.test_training import train_in_fresh_process

    store = store_from_uri(str(tmp_path / "store"))
    (r,) = execute(parse_job({"graphs": [str(zoo_dir / "mlp.pt2")], "targets": [f"{target}+train"]}), store).results
    assert r.status == "compiled", r.error
    facts = store.get_manifest(r.key)["artifact"]
    assert facts["saved_for_backward"]["bytes"] > 0
    # a precompiled function is held to the thread count it was compiled under; a bundle is not
    got = train_in_fresh_process(zoo_dir / "mlp.pt2", tmp_path / "store", target, tmp_path, extra_sizes,
                                 threads=facts.get("torch_threads", 1))
    assert got["inductor"].get("fxgraph_cache_miss", 0) == 0 and got["aot"].get("autograd_cache_miss", 0) == 0
    assert got["builds"] == [] and got["ok"], got["problems"]
    if target.startswith("inductor-cache"):
        assert facts["triton_kernels"] >= 1, facts  # Triton's compiled kernels travel in the bundle
