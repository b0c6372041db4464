"""The whole unit pipeline on the smoke zoo: real exports, real AOTInductor builds."""
from __future__ import annotations

import time

import pytest
import torch

from farm.spec import parse_job
from farm.zoo import ZOO, export_model
from scheduler.jobs import execute
from storage import store_from_uri
from storage.results import read_results

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def zoo_runs(zoo_dir, tmp_path_factory):
    """The zoo job run twice into one local store: cold, then unchanged."""
    store = store_from_uri(str(tmp_path_factory.mktemp("zoo-store")))
    job = parse_job({"name": "zoo", "graphs": sorted(str(p) for p in zoo_dir.glob("*.pt2")), "targets": ["aoti-cpu"]})
    t0 = time.perf_counter()
    cold = execute(job, store)
    t1 = time.perf_counter()
    warm = execute(job, store)
    t2 = time.perf_counter()
    return store, cold, warm, t1 - t0, t2 - t1


def test_every_zoo_model_compiles_and_verifies(zoo_runs):
    store, cold, _, _, _ = zoo_runs
    assert sorted(r.graph for r in cold.results) == sorted(ZOO)
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


def test_second_run_is_all_hits_and_much_faster(zoo_runs):
    _, cold, warm, cold_s, warm_s = zoo_runs
    assert [r.status for r in warm.results] == ["hit"] * len(ZOO)
    assert {r.key for r in warm.results} == {r.key for r in cold.results}
    assert warm_s < 0.25 * cold_s, (warm_s, cold_s)


def test_results_table_has_a_row_per_unit_with_phase_timings(zoo_runs):
    store, cold, _, _, _ = zoo_runs
    rows = read_results(store, cold.job_id)
    assert len(rows) == len(ZOO)
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
    from workers.program import load_program, program_identity

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
