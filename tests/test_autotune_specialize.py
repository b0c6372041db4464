"""Autotune's static specializations: a hot size of a dynamic dimension compiled on its own,
kept only if it beats the dynamic artifact there, which stays the fallback for other sizes."""
from __future__ import annotations

import json

import pytest
import torch

from farm.client import load_tuned
from scheduler.spec import SpecError, parse_job
from farm.zoo import export_model
from scheduler.jobs import execute, read_status
from storage import store_from_uri


def _job(zoo_dir, sizes):
    return parse_job({"name": "hot", "graphs": [str(zoo_dir / "mlp.pt2")], "targets": [
        {"backend": "aoti-cpu", "autotune": {"candidates": ["single_thread"], "specialize": {"x.0": sizes}}}]})


@pytest.fixture(scope="module")
def hot_job(zoo_dir, tmp_path_factory):
    """A plain job, then the hot-size job [8], into one store: the default candidate is in the
    store from the plain job, never timed at batch 8."""
    store = store_from_uri(str(tmp_path_factory.mktemp("hot") / "store"))
    plain = execute(parse_job({"graphs": [str(zoo_dir / "mlp.pt2")], "targets": ["aoti-cpu"]}), store)
    return store, plain, execute(_job(zoo_dir, [8]), store)


@pytest.mark.slow
def test_a_hot_size_is_compiled_measured_and_served(hot_job, tmp_path):
    store, plain, outcome = hot_job
    rows = {r.target: r for r in outcome.results}
    assert rows["aoti-cpu[default]"].key == plain.results[0].key and rows["aoti-cpu[default]"].status == "hit"
    assert rows["aoti-cpu[x.0=8]"].status == "compiled", rows["aoti-cpu[x.0=8]"].error
    for name in ("default", "single_thread"):  # the dynamic candidates were also timed at the hot size
        assert rows[f"aoti-cpu[{name}]"].metrics["compiled_ms@x.0=8"] > 0
    tuned = rows["aoti-cpu (autotuned)"]
    manifest = store.get_manifest(tuned.key)
    record = json.loads(store.backend.read(manifest["autotune"]["tuning_record"]))
    (sp,) = record["specializations"]
    assert sp["dim"] == "x.0" and sp["size"] == 8 and sp["median_ms"] > 0 and sp["dynamic_ms"] > 0
    assert sp["chosen"] == (sp["dynamic_ms"] - sp["median_ms"] > sp["spread_ms"] + sp["dynamic_spread_ms"])
    assert ("static x.0=8" in manifest["blobs"]) == sp["chosen"]

    model, eager = load_tuned(tuned.key, store.uri, tmp_path / "fetched"), export_model("mlp").module()
    for batch in (8, 5):  # the hot size, and one only the dynamic fallback serves
        x = torch.randn(batch, 32)
        torch.testing.assert_close(model(x), eager(x), atol=1e-4, rtol=1e-4)


def test_a_size_outside_the_range_is_rejected_when_the_job_loads(zoo_dir, tmp_path):
    store = store_from_uri(str(tmp_path / "store"))
    with pytest.raises(SpecError, match=r"x.0=65 is outside the dimension's range \[1, 64\]") as e:
        execute(_job(zoo_dir, [8, 65]), store)
    assert "graph mlp" in str(e.value) and "targets.0.autotune.specialize.x.0" in str(e.value)
    (job_id,) = store.job_ids()
    assert read_status(store, job_id)["state"] == "rejected" and not list(store.manifest_keys())


def test_a_dimension_that_is_not_dynamic_is_rejected(zoo_dir, tmp_path):
    with pytest.raises(SpecError, match="x.1 is not a dynamic dimension of this program"):
        execute(parse_job({"graphs": [str(zoo_dir / "mlp.pt2")], "targets": [
            {"backend": "aoti-cpu", "autotune": {"specialize": {"x.1": [4]}}}]}), store_from_uri(str(tmp_path)))
    with pytest.raises(SpecError, match="name a dimension as <input>.<dim>"):
        parse_job({"graphs": ["m.pt2"], "targets": [{"backend": "aoti-cpu", "autotune": {"specialize": {"batch": [4]}}}]})


@pytest.mark.slow
def test_hot_size_timings_of_a_hit_are_kept_so_the_job_again_measures_nothing(hot_job, zoo_dir):
    store, _, first = hot_job
    assert "benchmark" in {r.target: r for r in first.results}["aoti-cpu[default]"].timings  # a hit, timed at batch 8
    again = execute(_job(zoo_dir, [8]), store)
    assert {r.target: r.status for r in again.results}["aoti-cpu (autotuned)"] == "hit"
    assert not any("benchmark" in r.timings for r in again.results)
