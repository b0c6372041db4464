"""What a worker works out before its sandbox starts (the compiler in every key, where Inductor
keeps its caches) is what Inductor itself would say, without importing Inductor: that import
brings Dynamo, over a second of CPU in every worker and every rank of a gang (issue 11)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import sys
from scheduler.ray_pool import CompileWorker, GangMember  # what a Ray worker imports
from workers.backends import cxx, resolve
from workers.sandbox.env import child_env
from workers.sandbox.process import Sandbox
from workers.unit import Target, UnitLimits

named = {"compiler": cxx.compiler(), "cache": child_env(Path("."))["TORCHINDUCTOR_CACHE_DIR"]}
for target in (Target("aoti-cpu", "avx2"), Target("inductor-cache")):
    backend = resolve(target)
    backend.toolchain(target), backend.target_components(target)
assert "torch._dynamo" not in sys.modules and "torch._inductor" not in sys.modules, "Inductor was imported"

import torch._inductor.config
from torch._inductor.runtime.cache_dir_utils import cache_dir
cxx.compiler.cache_clear()
print(named == {"compiler": cxx.compiler(), "cache": cache_dir()}, named["compiler"]["cxx"])
"""


@pytest.mark.parametrize("env_cxx", [None, "c++"])
def test_a_worker_names_inductors_compiler_and_cache_without_importing_inductor(env_cxx, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "TORCHINDUCTOR_CACHE_DIR")}
    env |= ({"CXX": env_cxx} if env_cxx else {}) | {"PYTHONPATH": str(Path(__file__).parents[1])}
    out = subprocess.run([sys.executable, "-c", "from pathlib import Path\n" + PROBE], env=env, cwd=tmp_path,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", env_cxx or "g++"]


def test_a_gang_rank_lowers_its_priority_before_it_imports_torch(tmp_path):
    """The gang actor's module (what Ray imports to start a rank) imports no torch: a rank that
    only waits (scheduler/gang_actor.py) is niced before torch's import costs it a second of CPU."""
    probe = "import sys; import scheduler.gang_actor; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
                         cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False"]


WAITING = """
import os, threading
from pathlib import Path
from scheduler.gang_actor import _wait_in_a_session_of_its_own
threading.Thread(target=threading.Event().wait, daemon=True).start()  # an actor has threads before its first line
sid = os.getsid(0)
_wait_in_a_session_of_its_own()
tasks = Path("/proc/self/task").iterdir()
nice = {int(t.joinpath("stat").read_text().rsplit(")", 1)[1].split()[16]) for t in tasks}
autogroup = Path("/proc/self/autogroup")
print(os.getsid(0) != sid, os.getsid(0) == os.getpgid(0) == os.getpid(), sorted(nice),
      autogroup.read_text().split()[-1] if autogroup.exists() else "19")
"""


def test_a_waiting_rank_yields_the_cpu_in_a_session_of_its_own(tmp_path):
    """Rank 0 compiles in a sandbox child, a session of its own; Linux shares the CPU between
    sessions by each session's niceness, so a waiting rank at nice 19 in the Ray processes' session
    would still take a session's share. Started as Ray starts an actor (a process group leader),
    it ends in a session of its own, every thread and the session at nice 19."""
    out = subprocess.run([sys.executable, "-c", WAITING], env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
                         cwd=tmp_path, capture_output=True, text=True, process_group=0, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True", "[19]", "19"]


ASK_AGAIN = """
import sys
from workers import host_check
from workers.unit import Target
print(host_check.problem(Target("aoti-cpu", "avx2")), "torch._inductor.cpu_vec_isa" in sys.modules)
"""


def test_a_hosts_second_worker_takes_the_first_ones_host_check_without_importing_inductor(monkeypatch, tmp_path):
    """The CPU check's probes are per host and toolchain: one worker's "yes" (here, this process's)
    serves the host's others (workers/host_check.py), which then never import Inductor for it."""
    from workers import host_check
    from workers.unit import Target

    monkeypatch.setattr(host_check, "shared_cache_dir", lambda: str(tmp_path / "cache"))
    assert host_check._answer(Target("aoti-cpu", "avx2")) is None
    (answer,) = (tmp_path / "cache" / "farm-host-checks").glob("*.json")
    assert json.loads(answer.read_text())["toolchain"]["cxx"]  # what it was asked with: host, compiler, torch
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"),
           "FARM_SHARED_CACHE": str(tmp_path / "cache")}
    second = subprocess.run([sys.executable, "-c", ASK_AGAIN], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr[-2000:]
    assert second.stdout.split() == ["None", "False"]  # the answer, and Inductor never imported


ISAS = """
import json, sys
from workers.backends.cpu_isa import host_vec_isas
print(json.dumps([sorted(host_vec_isas()), "torch._inductor.cpu_vec_isa" in sys.modules]))
"""


def test_a_worker_with_a_fresh_inductor_cache_takes_what_inductor_said_of_the_node(tmp_path):
    """Inductor's answer on the host's vector ISAs (a probe build and a fresh Python per ISA) is the
    node's, whatever Inductor cache dir a worker uses: a worker given a fresh one (an operator's dir
    per worker, a test's) neither imports Inductor nor builds a probe for it."""
    from workers.backends.inductor_host import inductor_host

    known = inductor_host()["vec_isas"]  # the node's record, as its first worker made it
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "fresh")}
    out = subprocess.run([sys.executable, "-c", ISAS], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout) == [sorted(known), False]
    assert not list((tmp_path / "fresh").rglob("*.so"))


def test_a_problem_is_asked_again_and_a_new_compiler_asks_again(monkeypatch, tmp_path):
    from workers import host_check
    from workers.backends import cpu_isa, cxx
    from workers.unit import Target

    monkeypatch.setattr(host_check, "shared_cache_dir", lambda: str(tmp_path))
    asked = []
    answers = iter(["no compiler", None, None])
    monkeypatch.setattr(cpu_isa.PinnedCpuTarget, "host_problem", lambda self, t: asked.append(t) or next(answers))
    target = Target("aoti-cpu", "avx2")
    assert host_check._answer(target) == "no compiler" and host_check._answer(target) is None  # a problem: asked again
    assert host_check._answer(target) is None and len(asked) == 2  # a "yes": kept
    monkeypatch.setattr(cxx, "compiler", lambda: {"cxx": "g++", "cxx_version": "g++ (new) 99"})
    assert host_check._answer(target) is None and len(asked) == 3  # another toolchain: asked again


WORKER = """
import json, sys
from scheduler.ray_actors import CompileWorker  # what a pool slot's actor imports
from scheduler.jobs import execute
from scheduler.spec import parse_job
from storage import store_from_uri

job = parse_job({"name": "w", "graphs": [sys.argv[1]], "targets": ["aoti-cpu:avx2"]})
(result,) = execute(job, store_from_uri(sys.argv[2])).results  # the pipeline a worker runs, in this process
print(json.dumps({"status": result.status, "error": result.error, "device": result.device,
                  "torch": "torch" in sys.modules}))
"""


def test_a_pool_worker_compiles_and_benchmarks_a_unit_without_importing_torch(zoo_dir, tmp_path):
    """torch is the sandbox child's: the worker that keys, checks the host, fingerprints its CPU
    and publishes costs no torch import of its own (two per worker otherwise, on a 2-core host a
    tenth of a small job), once the host's first process has asked Inductor about this host."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}  # this host's Inductor cache, warm or not
    first = subprocess.run([sys.executable, "-c", "from workers.backends import cpu_isa; print(cpu_isa.can_pin())"],
                           env=env, cwd=tmp_path, capture_output=True, text=True)
    assert first.returncode == 0 and first.stdout.split() == ["True"], first.stderr[-2000:]
    out = subprocess.run([sys.executable, "-c", WORKER, str(zoo_dir / "mlp.pt2"), str(tmp_path / "store")],
                         env=env, cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    said = json.loads(out.stdout.splitlines()[-1])
    assert (said["status"], said["error"], said["torch"]) == ("compiled", None, False)
    from torch._inductor import cpu_vec_isa

    assert said["device"]["vec_isas"] == sorted(str(i) for i in cpu_vec_isa.valid_vec_isa_list())  # Inductor's answer


def test_what_inductor_says_of_the_host_is_asked_again_for_another_torch_or_a_damaged_record(monkeypatch, tmp_path):
    from workers.backends import inductor_host

    monkeypatch.setattr(inductor_host, "shared_cache_dir", lambda: str(tmp_path))
    asked = []
    monkeypatch.setattr(inductor_host, "_ask_inductor",
                        lambda: asked.append(1) or {"vec_isas": ["avx2"], "vec_isa_extras": {"avx2": {}}, "can_pin": True})

    def ask() -> dict:
        inductor_host.inductor_host.cache_clear()
        return inductor_host.inductor_host()

    assert ask()["vec_isas"] == ["avx2"] and ask()["vec_isas"] == ["avx2"] and len(asked) == 1  # kept
    (record,) = tmp_path.glob("farm-host-checks/inductor-host-*.json")
    record.write_text(json.dumps({**json.loads(record.read_text()), "vec_isas": "avx512"}))  # not a list
    assert ask()["vec_isas"] == ["avx2"] and len(asked) == 2
    record.write_text("{")  # torn
    assert ask()["vec_isas"] == ["avx2"] and len(asked) == 3
    record.write_text(json.dumps({k: v for k, v in json.loads(record.read_text()).items() if k != "vec_isa_extras"}))
    assert ask()["vec_isa_extras"] == {"avx2": {}} and len(asked) == 4  # from before the extras were kept
    monkeypatch.setattr(inductor_host, "cpu_identity", lambda: {"model": "another CPU", "flags": "0"})
    assert ask()["can_pin"] is True and len(asked) == 5 and len(list(tmp_path.glob("farm-host-checks/*.json"))) == 2


@pytest.fixture
def inductors_isas():
    """Inductor's ISA objects (one per process), whatever a test sets on them put back after."""
    from torch._inductor import cpu_vec_isa

    from workers.backends.inductor_host import ISA_EXTRAS

    kept = [(isa, {name: isa.__dict__[name] for name in ISA_EXTRAS if name in isa.__dict__})
            for isa in cpu_vec_isa.supported_vec_isa_list]
    yield {str(isa): isa for isa in cpu_vec_isa.supported_vec_isa_list}
    for isa, attrs in kept:
        for name in ISA_EXTRAS:
            isa.__dict__.pop(name, None)
        isa.__dict__.update(attrs)
        for name in ISA_EXTRAS:  # and Inductor's cached getters of them
            getattr(getattr(type(isa), name.lstrip("_"), None), "cache_clear", lambda: None)()


def test_isas_from_the_hosts_record_build_as_inductors_own_check_left_them_and_a_pinned_one_with_its_own_flags(
        monkeypatch, tmp_path, inductors_isas):
    """On a host with avx512_bf16 (a Sapphire Rapids), Inductor's check adds -mavx512bf16 to AVX-512's
    flags, and so to every kernel's path. A process that took the ISAs from the host's record built
    without it, and missed every kernel the host's first process had built and shipped."""
    from workers.backends import cpu_isa, inductor_host

    avx512 = inductors_isas["avx512"]
    monkeypatch.setattr(inductor_host, "shared_cache_dir", lambda: str(tmp_path))
    monkeypatch.setattr(inductor_host, "_ask_inductor", lambda: {
        "vec_isas": ["avx2", "avx512"], "can_pin": True,
        "vec_isa_extras": {"avx2": {}, "avx512": {"_is_avx512_bf16_supported": True}}})
    inductor_host.inductor_host.cache_clear()
    monkeypatch.setattr(cpu_isa, "_recorded_vec_isas", lambda: frozenset(inductor_host.inductor_host()["vec_isas"]))
    try:
        avx512._is_avx512_bf16_supported = False  # as before Inductor's check ran in this process
        type(avx512).is_avx512_bf16_supported.cache_clear()
        assert avx512.is_avx512_bf16_supported() is False  # and cached so, as Inductor's codegen asks it
        assert [str(i) for i in cpu_isa._host_vec_isa_list()] == ["avx512", "avx2"]  # Inductor's order
        assert "-mavx512bf16" in avx512.build_arch_flags().split() and avx512.is_avx512_bf16_supported() is True
        # pinned, AVX-512 is x86-64-v4's: its kernels run on every AVX-512 host, this one's extras or not
        assert cpu_isa._pinned("avx512") == [avx512]
        assert "-mavx512bf16" not in avx512.build_arch_flags().split() and avx512.is_avx512_bf16_supported() is False
    finally:
        inductor_host.inductor_host.cache_clear()


FIRST_LOWERING = """
import json, sys, tempfile, threading
from pathlib import Path
from workers.sandbox.steps import warm_up, warm_up_lowering
warm_up()  # what the zygote does before it forks a child per job
warm_up_lowering()  # and once one of its children has lowered
threads = [t.name for t in threading.enumerate()]
from tqdm import std
tqdm_made = [n for c, n in ((std.tqdm, "_lock"), (std.TqdmDefaultWriteLock, "mp_lock")) if n in c.__dict__]
import torch
from torch._inductor.fx_passes import joint_graph
from workers.backends import resolve
from workers.unit import Target
target = Target("aoti-cpu", "avx2")
imported, traced = set(sys.modules), joint_graph.lazy_init.cache_info().misses
resolve(target).lower(torch.export.load(sys.argv[1]), target, Path(tempfile.mkdtemp()))
new = sorted(m for m in set(sys.modules) - imported if m.split(".")[0] in ("torch", "torchgen", "sympy"))
print("FOUND " + json.dumps({"threads": threads, "tqdm_made": tqdm_made, "imported": new,
                             "traced": joint_graph.lazy_init.cache_info().misses - traced}))
"""


def test_a_childs_first_lowering_imports_and_traces_nothing_its_zygote_could_have(zoo_dir, tmp_path):
    """A child is forked per job, so what a process does on its first lowering (import Inductor's
    code generators, sympy's modules, trace Inductor's pattern-matcher passes: 0.9 s of a job's
    first unit here) is done once, in the zygote, once a child of it has lowered. The zygote
    still forks with no Python thread and no lock its children would share (tqdm's, which fx's
    interpreter makes)."""
    out = subprocess.run([sys.executable, "-c", FIRST_LOWERING, str(zoo_dir / "mlp.pt2")], cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]),
                              "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")},
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.split("FOUND ", 1)[1])
    assert found == {"threads": ["MainThread"], "tqdm_made": [], "imported": [], "traced": 0}
