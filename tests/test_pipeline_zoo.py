"""The whole unit pipeline on the smoke zoo: real exports, real AOTInductor builds."""
from __future__ import annotations

import json

import pytest
import torch

from farm.zoo import SUITES, export_model
from storage.results import read_results

pytestmark = pytest.mark.slow
SMOKE = SUITES["smoke"]


def test_every_zoo_model_compiles_and_verifies(zoo_runs):
    store, cold, _, _, _ = zoo_runs
    assert sorted(r.graph for r in cold.results) == sorted(SMOKE)
    for r in cold.results:
        assert r.status == "compiled", r.error
        assert r.metrics["max_abs_err"] <= 1e-3
        assert r.metrics["eager_ms"] > 0 and r.metrics["compiled_ms"] > 0
        manifest = store.get_manifest(r.key)
        # verified at the example size and at other sizes of every dynamic dimension
        assert len(manifest["verify"]["inputs"]) >= 3, manifest["verify"]
        assert manifest["artifact"]["isa"] == "AVX2"
        assert manifest["components"]["target"]["march"] == "x86-64-v3"
        assert "g++" in manifest["components"]["toolchain"]["cxx"]


def test_second_run_is_all_hits_and_compiles_nothing(zoo_runs):
    """How much faster that is, is bench/warm.py's to measure (a speed is no test's to assert)."""
    _, cold, warm, _, _ = zoo_runs
    assert [r.status for r in warm.results] == ["hit"] * len(SMOKE)
    assert {r.key for r in warm.results} == {r.key for r in cold.results}
    assert not any("lower" in r.timings for r in warm.results), [r.timings for r in warm.results]
    assert warm.stats.compiled == 0 and warm.stats.compile_s == 0


def test_results_table_has_a_row_per_unit_with_phase_timings(zoo_runs):
    store, cold, _, _, _ = zoo_runs
    rows = read_results(store, cold.job_id)
    assert len(rows) == len(SMOKE)
    for row in rows:
        assert row["status"] == "compiled"
        assert row["lower_s"] > 0 and row["verify_s"] > 0 and row["upload_s"] >= 0 and row["load_s"] > 0
        assert row["artifact_bytes"] > 0 and row["speedup"] > 0
        log = store.get_bytes(row["log_digest"]).decode()
        assert "verified on example" in log and "torchinductor" in log.lower()


def test_artifact_from_the_store_runs_at_a_new_batch_size(zoo_runs, tmp_path):
    store, cold, _, _, _ = zoo_runs
    r = next(r for r in cold.results if r.graph == "gpt")
    path = store.fetch(r.artifact.digest, tmp_path / "gpt.pt2")
    compiled = torch._inductor.aoti_load_package(str(path))
    ids = torch.randint(0, 128, (5, 9))
    eager = export_model("gpt").module()
    torch.testing.assert_close(compiled(ids), eager(ids), atol=1e-4, rtol=1e-4)


def test_key_ignores_archive_bytes_but_not_weights(zoo_dir, tmp_path):
    from workers.sandbox.program import load_program, program_identity

    ep = export_model("mlp")
    torch.export.save(ep, str(tmp_path / "again.pt2"))
    again = program_identity(load_program(tmp_path / "again.pt2", "again"))
    original = program_identity(load_program(zoo_dir / "mlp.pt2", "mlp"))
    assert (tmp_path / "again.pt2").read_bytes() != (zoo_dir / "mlp.pt2").read_bytes()
    assert again["program"] == original["program"]

    with torch.no_grad():
        next(iter(ep.state_dict.values())).add_(1.0)
    torch.export.save(ep, str(tmp_path / "retrained.pt2"))
    retrained = program_identity(load_program(tmp_path / "retrained.pt2", "retrained"))
    assert retrained["graph"] == original["graph"]
    assert retrained["program"] != original["program"]


def test_warm_run_reports_hit_rate_and_the_compile_time_it_saved(zoo_runs):
    store, cold, warm, _, _ = zoo_runs
    assert cold.stats.hit_rate == 0 and warm.stats.hit_rate == 1
    compiled_s = {r.key: r.to_row(cold.job_id)["compile_s"] for r in cold.results}
    for r in warm.results:  # a hit saves what its manifest says the compile took
        assert r.saved_s == pytest.approx(compiled_s[r.key], rel=1e-6) and r.saved_s > 0
    assert warm.stats.saved_s == pytest.approx(cold.stats.compile_s, rel=1e-6)
    assert cold.stats.bytes_uploaded > 0 and warm.stats.bytes_uploaded == 0  # nothing new to store
    assert warm.stats.bytes_downloaded == 0  # identities known from the cold run: no program is even fetched
    stored = json.loads(store.get_job_file(warm.job_id, "stats.json"))
    assert stored["hit_rate"] == 1 and stored["saved_s"] == pytest.approx(warm.stats.saved_s)


def test_farm_results_shows_the_stats(zoo_runs):
    from tests.cli import farm

    store, _, warm, _, _ = zoo_runs
    out = farm("results", warm.job_id, "--store", store.uri)
    assert f"hit rate 100% ({len(SMOKE)}/{len(SMOKE)})" in out and "compile time saved" in out


def test_a_300_unit_job_prints_a_summary_and_its_failures_not_300_rows(zoo_runs, zoo_dir, tmp_path):
    """300 copies of the zoo's graphs (all hits in the zoo's store, copied) and one missing graph:
    the job prints counts by target and status and the failed unit, in about 60 lines; `farm
    results` still prints every row."""
    import os
    import re
    import shutil

    from tests.cli import farm

    store = tmp_path / "store"
    shutil.copytree(zoo_runs[0].uri.removeprefix("file://"), store)
    graphs = []
    for i in range(300 // len(SMOKE)):
        for name in SMOKE:
            graphs.append(tmp_path / f"{name}_{i:03d}.pt2")
            os.link(zoo_dir / f"{name}.pt2", graphs[-1])
    out = farm("compile", *map(str, graphs), str(tmp_path / "missing.pt2"), "--store", str(store))
    lines = out.splitlines()
    assert len(lines) <= 60, out
    assert re.search(r"│ aoti-cpu\S* +│ hit +│ +300 │", out), out
    assert re.search(r"│ aoti-cpu\S* +│ failed +│ +1 │", out), out
    assert "1 failed" in out and "missing" in out and "does not exist" in out, out
    assert "300 hits, 1 failed" in out, out
    job_id = re.search(r"farm results (\S+) --store", out).group(1)
    every_row = farm("results", job_id, "--store", str(store))
    assert all(f"{g.stem}" in every_row for g in graphs), every_row[-2000:]


NO_RAY = "import sys; sys.modules['ray'] = None; from farm.cli import app; app()"  # `import ray` fails


def test_farm_compile_needs_no_ray(zoo_runs, zoo_dir, tmp_path):
    """`farm compile` runs in its own process, as on the lent GPU hosts, which have no Ray."""
    import shutil
    import subprocess
    import sys

    store = tmp_path / "store"
    shutil.copytree(zoo_runs[0].uri.removeprefix("file://"), store)
    done = subprocess.run([sys.executable, "-c", NO_RAY, "compile", str(zoo_dir / "mlp.pt2"), "--store", str(store)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "0 compiled, 1 hits, 0 failed" in done.stdout, done.stdout + done.stderr[-3000:]
