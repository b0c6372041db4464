"""What a worker works out before its sandbox starts (the compiler in every key, where Inductor
keeps its caches) is what Inductor itself would say, without importing Inductor: that import
brings Dynamo, over a second of CPU in every worker and every rank of a gang (issue 11)."""
from __future__ import annotations

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
