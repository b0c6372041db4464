"""CUDA targets where there is no GPU (issue 10): what a unit asks of Ray, what a host offers,
what goes into the key, units routed to a (fake) GPU node or failed at once when no node
offers their architecture, and CUDA sandboxes' limits. The GPU itself: tests/test_gpu.py."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import ray
import torch

from scheduler.jobs import execute
from scheduler.ray_pool import PoolConfig, RayRunner
from scheduler.spec import parse_job
from storage import store_from_uri
from tests.cli import farm
from workers.backends import LoweringError, cuda, cxx, offered_resources, resolve
from workers.keys import key_components, key_of
from workers.sandbox.process import Sandbox, SandboxFailed
from workers.unit import Target, Unit, UnitLimits

NO_CUDA = torch.version.cuda is None or not torch.cuda.is_available()


def test_each_target_asks_ray_for_what_it_needs():
    sm90 = resolve(Target("aoti-cuda", "sm_90")).placement(Target("aoti-cuda", "sm_90"))
    assert sm90.resources == {"farm_cuda_sm90": 1.0}
    assert sm90.gpus == pytest.approx(1 / cuda.WORKERS_PER_GPU) and 0 < sm90.gpus < 1 and sm90.cpus == 1
    assert resolve(Target("aoti-cuda")).placement(Target("aoti-cuda")).resources == {"farm_cuda": 1.0}
    cpu = resolve(Target("aoti-cpu", "avx2")).placement(Target("aoti-cpu", "avx2"))
    assert cpu.resources == {"farm_cpu_avx2": 1.0} and cpu.gpus == 0
    with pytest.raises(LoweringError, match="sm_XX"):
        resolve(Target("aoti-cuda", "avx2"))


@pytest.mark.skipif(not NO_CUDA, reason="checks a host without a GPU")
def test_a_host_without_a_gpu_offers_only_cpu_classes():
    offers = offered_resources(2)
    assert offers.get("farm_cpu_x86_64") == 2 and not [r for r in offers if r.startswith("farm_cuda")]
    assert json.loads(farm("resources", "--slots", "3").strip().splitlines()[-1])["farm_cpu_x86_64"] == 3


def test_inductor_cache_has_a_gpu_form_placed_and_keyed_like_aoti_cuda():
    train = Target("inductor-cache", "sm_90", mode="train")
    gpu = resolve(train)
    assert gpu.device == "cuda" and gpu.placement(train).resources == {"farm_cuda_sm90": 1.0}
    assert gpu.placement(train).gpus == pytest.approx(1 / cuda.WORKERS_PER_GPU)
    own = Target("inductor-cache", "cuda")
    assert resolve(own).placement(own).resources == {"farm_cuda": 1.0}  # the worker's own GPU
    components = gpu.target_components(train)
    assert components["arch"] == "sm_90" and components["mode"] == "train" and "march" not in components
    assert {"cuda", "triton"} <= set(gpu.toolchain(train))
    assert gpu.pin(train).vec_isa is None  # no CPU ISA pin on a GPU target
    cpu = Target("inductor-cache", "avx2", mode="train")
    assert resolve(cpu).device == "cpu" and resolve(cpu).pin(cpu).vec_isa == "avx2"
    assert train.label == "inductor-cache:sm_90+train"
    with pytest.raises(LoweringError, match="unknown ISA"):
        resolve(Target("inductor-cache", "sm90"))


@pytest.mark.parametrize("name", ["inductor-cache", "aot-compile"])
def test_a_gpu_form_checks_the_shapes_and_modes_its_cpu_form_does(name):
    """aot-compile:cuda's functions are static like aot-compile's: checked at other sizes, they
    failed verification on the GPU."""
    cpu, gpu = resolve(Target(name, None)), resolve(Target(name, "sm_90"))
    assert gpu.device == "cuda" and cpu.device == "cpu"
    assert (gpu.static_shapes, gpu.modes, gpu.weights_in_code) == (cpu.static_shapes, cpu.modes, cpu.weights_in_code)


def test_the_key_holds_the_architecture_and_the_gpu_toolchain():
    backend = resolve(Target("aoti-cuda", "sm_90"))
    program = {"program": "0" * 64}

    def key(arch: str) -> str:
        t = Target("aoti-cuda", arch)
        return key_of(key_components(program, backend.target_components(t), {}, backend.toolchain(t)))

    assert backend.target_components(Target("aoti-cuda", "sm_90"))["arch"] == "sm_90"
    assert key("sm_90") != key("sm_80")
    tools = backend.toolchain(Target("aoti-cuda", "sm_90"))
    assert {"cuda", "triton", "cxx", "cxx_version"} <= set(tools)
    cpu_tools = resolve(Target("aoti-cpu")).toolchain(Target("aoti-cpu"))
    assert "cuda" not in cpu_tools and "triton" not in cpu_tools and "cxx_version" in cpu_tools


def test_a_compiler_newer_than_the_loaded_libstdcxx_is_refused(monkeypatch, tmp_path):
    loaded = next(line.split()[-1] for line in open("/proc/self/maps") if "/libstdc++.so" in line)
    minor = int(Path(loaded).resolve().name.rsplit(".", 1)[1])
    newer, older = tmp_path / f"libstdc++.so.6.0.{minor + 1}", tmp_path / f"libstdc++.so.6.0.{minor - 1}"
    for lib in (newer, older):
        lib.touch()
    real_run = cxx._run
    cxx.compiler()  # cached with the real version before `_run` is faked
    try:
        for built, refused in ((older, False), (newer, True)):
            cxx.libstdcxx_problem.cache_clear()
            monkeypatch.setattr(cxx, "_run", lambda cmd, built=built: str(built) if "-print-file-name" in cmd[-1]
                                else real_run(cmd))
            problem = cxx.libstdcxx_problem()
            assert (problem is not None) == refused, problem
        assert str(newer) in problem and "Set CXX" in problem  # the newer one
        backend = resolve(Target("aoti-cpu"))
        assert backend.host_problem(Target("aoti-cpu")) == problem  # a unit fails before it builds anything
    finally:
        cxx.libstdcxx_problem.cache_clear()


def test_a_package_that_crashes_as_it_loads_names_the_compiler_cxx_chose(monkeypatch, tmp_path):
    """On a lent H100, CXX=/opt/gcc/bin/g++ (the machine's default) built packages that crashed as
    torch loaded them, with the same libstdc++ as the system's g++: a crash in the check says so."""
    from workers.lookup import UnitFailed
    from workers.pipeline import check_artifact

    class Crashing:
        def step(self, name, **kwargs):
            raise UnitFailed(f"{name}: the sandbox crashed with SIGSEGV (Segmentation fault)", retryable=False)

    def failure() -> str:
        cxx.compiler.cache_clear()
        with pytest.raises(UnitFailed) as failed:
            check_artifact(Crashing(), tmp_path / "model.pt2", verify_it=True, bench_it=False)
        return str(failed.value)

    wrapper = tmp_path / "bin" / "g++"
    wrapper.parent.mkdir()
    wrapper.write_text('#!/bin/sh\nexec g++ "$@"\n')
    wrapper.chmod(0o755)
    try:
        monkeypatch.setenv("CXX", str(wrapper))
        said = failure()
        assert said.startswith("check: the sandbox crashed with SIGSEGV")
        assert f"built with CXX={wrapper}" in said and f"CXX={shutil.which('g++')}" in said, said
        monkeypatch.setenv("CXX", "g++")  # the system's: the crash is told as it was
        assert failure() == "check: the sandbox crashed with SIGSEGV (Segmentation fault)"
    finally:
        cxx.compiler.cache_clear()


@pytest.mark.skipif(not NO_CUDA, reason="checks a host without a GPU")
def test_in_process_a_cuda_target_on_a_host_without_a_gpu_fails_with_the_reason(zoo_dir, tmp_path):
    job = parse_job({"graphs": [str(zoo_dir / "mlp.pt2")], "targets": ["aoti-cuda:sm_90", "aoti-cuda",
                                                                       "inductor-cache:sm_90+train"]})
    outcome = execute(job, store_from_uri(str(tmp_path / "store")))  # like `farm compile`, in this process
    errors = {r.target: r.error for r in outcome.results if r.status == "failed"}
    assert "cannot build aoti-cuda:sm_90: no CUDA GPU (torch was built without CUDA" in errors["aoti-cuda:sm_90"]
    assert "cannot build inductor-cache:sm_90+train: no CUDA GPU" in errors["inductor-cache:sm_90+train"]
    assert "name one, e.g. aoti-cuda:sm_90" in errors["aoti-cuda"]
    assert all(r.retryable and "lower" not in r.timings for r in outcome.results)
    for backend in ("aot-compile", "inductor-cache"):  # loading their GPU artifacts is the GPU's check too, not the CPU's
        target = Target(backend, "sm_90", mode="train")
        form = resolve(target)
        assert "no CUDA GPU" in form.load_problem(target) and form.load_problem(target) == form.host_problem(target)


def test_warm_start_asks_its_own_process_for_the_gpu_and_says_why_it_has_none(zoo_dir, tmp_path, monkeypatch):
    """A training process that warm-starts a `:cuda` artifact is on its GPU anyway: which GPU it has
    is asked of its own CUDA, not of a child that imports torch again (5-10 s on a GPU host, before
    every first step: bench/gpu_zoo.sh); without one, the error says so, naming the target."""
    from farm.client import WarmStartError, warm_start

    def no_child(*args, **kwargs):
        raise AssertionError(f"a child was started to ask for the GPU: {args[0] if args else kwargs}")

    monkeypatch.setattr(cuda.subprocess, "run", no_child)
    (tmp_path / "store").mkdir()  # a store, without the artifact
    with pytest.raises(WarmStartError) as refused:
        warm_start(zoo_dir / "mlp.pt2", store=str(tmp_path / "store"), target="inductor-cache:cuda")
    said = str(refused.value)
    assert "inductor-cache:cuda+train" in said and "this process sees no CUDA GPU" in said, said
    assert "name one, e.g. inductor-cache:sm_90" in said
    cuda.forget()
    with pytest.raises(AssertionError, match="a child was started"):  # outside warm_start a worker asks a child
        cuda.own_gpu()
    cuda.forget()


def test_a_gpu_that_fails_its_check_after_a_crash_gets_no_new_sandbox(monkeypatch):
    def broken(*args, **kwargs):
        raise cuda.GpuUnavailable("GPU 0 (NVIDIA H100) computed nan for a known sum (1047552)")

    monkeypatch.setattr(cuda, "probe", broken)
    with Sandbox() as sandbox:
        sandbox._gpu_suspect = True  # as after a CUDA child crashed (tests/test_gpu.py crashes a real one)
        with pytest.raises(SandboxFailed, match="GPU failed its check.*computed nan") as failed:
            sandbox.prestart(UnitLimits(), "cuda")
        assert failed.value.retryable and sandbox.pid is None and sandbox.starts == 0
        sandbox.prestart(UnitLimits(), "cpu")  # CPU work on this host goes on
        deadline = time.monotonic() + 120  # its child is forked once the zygote has imported torch
        while sandbox.pid is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sandbox.pid is not None and sandbox.starts == 1
    cuda.forget()


def test_a_cuda_sandbox_limits_its_heap_not_its_address_space(tmp_path, zoo_dir):
    limits = UnitLimits(timeout_s=30, memory_gb=6, file_gb=1)
    unit = Unit(graph="mlp", source="mlp.pt2", target=Target("aoti-cuda", "sm_90"), program=None, limits=limits)
    rows = {}
    with Sandbox() as sandbox, sandbox.workdir() as workdir:
        for device in ("cuda", "cpu"):
            sandbox.call("identify", workdir, limits, time.monotonic() + 120, device=device, unit=unit,
                         program=shutil.copy(zoo_dir / "mlp.pt2", workdir))
            text = Path(f"/proc/{sandbox.pid}/limits").read_text()
            environ = Path(f"/proc/{sandbox.pid}/environ").read_bytes().decode().split("\0")
            rows[device] = ({line[:26].strip(): line[26:].split()[0] for line in text.splitlines()[1:]}, environ)
    (cuda_limits, cuda_env), (cpu_limits, cpu_env) = rows["cuda"], rows["cpu"]
    assert cuda_limits["Max data size"] == str(6 << 30) and cuda_limits["Max address space"] == "unlimited"
    assert cpu_limits["Max address space"] == str(6 << 30)
    assert "CUDA_VISIBLE_DEVICES=" in cpu_env  # a CPU unit's child sees no GPU
    # a CUDA unit's child sees the GPUs its worker sees (hidden only where the worker's are)
    assert ("CUDA_VISIBLE_DEVICES=" in cuda_env) == (os.environ.get("CUDA_VISIBLE_DEVICES") == "")


@pytest.mark.slow
def test_on_ray_gpu_units_go_to_the_gpu_node_and_unoffered_architectures_fail_at_once(ray_cluster, zoo_dir, tmp_path):
    job = parse_job({"graphs": [str(zoo_dir / "mlp.pt2")], "targets": ["aoti-cuda:sm_90", "aoti-cuda:sm_80"]})
    runner = RayRunner(PoolConfig(), job_id="gpu-routing")
    outcome = execute(job, store_from_uri(str(tmp_path)), runner)
    results = {r.target: r for r in outcome.results}
    sm80, sm90 = results["aoti-cuda:sm_80"], results["aoti-cuda:sm_90"]
    assert sm80.status == "failed" and "no Ray node offers resource 'farm_cuda_sm80'" in sm80.error, sm80.error
    assert "farm resources" in sm80.error and sm80.retries == 0
    assert [s.resource for s in runner.slots] == ["farm_cuda_sm90"]  # no worker waited for sm_80
    (gpu_node,) = [n["NodeID"][:8] for n in ray.nodes() if n["Alive"] and "farm_cuda_sm90" in n["Resources"]]
    assert f"node-{gpu_node}" in sm90.worker, sm90.worker
    if NO_CUDA:  # the fake GPU class: Ray placed the unit, and the worker found no GPU there
        assert sm90.status == "failed" and "cannot build aoti-cuda:sm_90: no CUDA GPU" in sm90.error, sm90.error
