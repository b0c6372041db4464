"""Inductor's own autotuning, shared: a GEMM choice benchmarked on one worker is not
benchmarked again on another worker of the same device class."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
import yaml

from storage import store_from_uri
from storage.results import read_results

pytestmark = pytest.mark.slow

TARGET = {"backend": "aoti-cpu", "options": {"max_autotune": True, "freezing": True}}


def _run_on_a_fresh_worker(graph, store: str, tmp_path, name: str) -> dict:
    """`farm run` in its own process on an Inductor cache with no autotuning timings in it:
    another machine, as far as autotuning can tell. The cache dir is the test's own, shared by
    its runs, so a later run finds the precompiled headers and C++ kernels an earlier one built
    (each would cost a new machine seconds of g++, and say nothing about timings); the timings
    (Inductor's local autotune cache, `cache/` in each sandbox's part of the dir) are removed
    first."""
    job = tmp_path / f"{name}.yaml"
    job.write_text(yaml.safe_dump({"name": name, "graphs": [str(graph)], "targets": [TARGET]}))
    inductor = tmp_path / "inductor"
    for timings in inductor.glob("**/cache"):
        shutil.rmtree(timings)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor)}
    proc = subprocess.run([sys.executable, "-m", "farm", "run", str(job), "--store", store],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = store_from_uri(store)
    (row,) = read_results(s, next(j for j in s.job_ids() if j.startswith(name + "-")))
    assert row["status"] == "compiled", row["error"]
    return s.get_manifest(row["key"])["metrics"]


def _one_gemm(path, scale: float):
    """A program with one GEMM (its autotuning is what this file is about, and costs seconds per GEMM)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 64)
    with torch.no_grad():
        layer.weight.mul_(scale)
    torch.export.save(torch.export.export(layer, (torch.randn(8, 64),)), str(path))
    return path


def test_second_worker_does_no_gemm_benchmarking(tmp_path):
    store = str(tmp_path / "store")
    first = _run_on_a_fresh_worker(_one_gemm(tmp_path / "v1.pt2", 1.0), store, tmp_path, "first")
    assert first["autotune_benchmarked"] >= 1 and first["autotune_published"] >= 2  # 1 GEMM x its choices
    assert list(store_from_uri(store).backend.list("tuning/inductor/"))

    # the next checkpoint: another key, the same GEMM shape
    second = _run_on_a_fresh_worker(_one_gemm(tmp_path / "v2.pt2", 0.9), store, tmp_path, "second")
    assert second["autotune_seeded"] >= first["autotune_published"]
    assert second["autotune_benchmarked"] == 0 and second["autotune_published"] == 0


def test_seeding_leaves_other_inductor_caches_in_the_local_file_alone(tmp_path, monkeypatch):
    """On CUDA, Inductor keeps other decisions (pad_mm's) in the same local cache file; seeding
    must skip them, not fail the unit (it did on the lent H100)."""
    from torch._inductor.codecache import PersistentCache

    from workers.autotune.share import _entries, _merge_into_local

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    other = {"pad_mm": {"key-a": 1.25, "key-b": True}, "mm": {"[in]": {"highest": {"triton_1": 0.01}}}}
    PersistentCache().update_local_cache(other)
    shared = [("mm", "[in]", "highest", "aten", 0.02), ("pad_mm", "key-a", "highest", "x", 9.0)]
    added, local = _merge_into_local(shared)
    assert added == 1 and local["pad_mm"] == other["pad_mm"]  # pad_mm's entries untouched
    assert sorted(_entries(local)) == [("mm", "[in]", "highest", "aten", 0.02), ("mm", "[in]", "highest", "triton_1", 0.01)]


_RACER = """
import json, pathlib, sys, time
from torch._inductor.codecache import PersistentCache
from workers.autotune.share import recording_timings
me, rounds, gate = sys.argv[1], int(sys.argv[2]), pathlib.Path(sys.argv[3])
(gate / me).touch()
while len(list(gate.iterdir())) < 4:  # all four start writing together (unlocked, they lost two thirds)
    time.sleep(0.01)
with recording_timings() as measured:
    for i in range(rounds):  # what Inductor's PersistentCache.lookup does after benchmarking: read, add, write
        cache = PersistentCache()
        local = cache.get_local_cache()
        local.setdefault("mm", {}).setdefault(f"[{me}-{i}]", {}).setdefault("highest", {})[f"choice-{me}"] = float(i)
        cache.update_local_cache(local)
print(json.dumps(measured))
"""


def test_workers_on_one_host_keep_each_others_timings_and_publish_only_their_own(tmp_path):
    """Four sandboxes autotuning on one host at once: every timing survives in the shared file,
    and each reports exactly the timings it measured (those are what it publishes)."""
    import json

    from workers.autotune.share import _entries

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    gate = tmp_path / "gate"
    gate.mkdir()
    racers = [subprocess.Popen([sys.executable, "-c", _RACER, f"w{n}", "40", str(gate)], env=env, stdout=subprocess.PIPE,
                               text=True) for n in range(4)]
    reported = {f"w{n}": json.loads(p.communicate(timeout=300)[0]) for n, p in enumerate(racers)}
    for me, entries in reported.items():
        assert sorted(tuple(e) for e in entries) == sorted(("mm", f"[{me}-{i}]", "highest", f"choice-{me}", float(i))
                                                           for i in range(40))
    # Inductor's per-host file (read directly: Inductor caches its path in this process), beside the farm's lock
    (timing_file,) = [f for f in (tmp_path / "cache").iterdir() if not f.name.endswith(".farm-lock")]
    assert len(_entries(json.loads(timing_file.read_text())["cache"])) == 4 * 40  # none lost to a racing rewrite
