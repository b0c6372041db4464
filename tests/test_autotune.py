"""Autotune: candidates compiled and measured as units, the fastest verified one published
if it beats the default by more than the noise, and every measurement kept."""
from __future__ import annotations

import json

import pytest

from scheduler.jobs import execute
from scheduler.spec import SpecError, parse_job
from storage import store_from_uri
from workers.autotune.space import Measured, decide

SPACE = ["single_thread", {"name": "broken", "options": {"no_such_inductor_setting": 1}}]


def _job(zoo_dir, retune=False):
    return parse_job({"name": "tune", "graphs": [str(zoo_dir / "mlp.pt2")],
                      "targets": [{"backend": "aoti-cpu", "autotune": {"candidates": SPACE, "retune": retune}}]})


@pytest.fixture(scope="module")
def tuned(zoo_dir, tmp_path_factory):
    store = store_from_uri(str(tmp_path_factory.mktemp("tune-store")))
    first = execute(_job(zoo_dir), store)
    again = execute(_job(zoo_dir), store)
    return store, first, again


def _rows(outcome):
    return {r.target: r for r in outcome.results}


@pytest.mark.slow
def test_the_winner_is_published_with_a_record_of_all_three(tuned):
    store, first, _ = tuned
    rows = _rows(first)
    assert set(rows) == {"aoti-cpu[default]", "aoti-cpu[single_thread]", "aoti-cpu[broken]", "aoti-cpu (autotuned)"}
    unit = rows["aoti-cpu (autotuned)"]
    assert unit.status == "compiled"
    manifest = store.get_manifest(unit.key)
    record = json.loads(store.backend.read(manifest["autotune"]["tuning_record"]))
    by_name = {c["name"]: c for c in record["candidates"]}
    assert set(by_name) == {"default", "single_thread", "broken"}
    assert by_name["broken"]["status"] == "failed" and "no_such_inductor_setting" in by_name["broken"]["error"]
    ok = [c for c in record["candidates"] if c["status"] == "compiled"]
    assert all(c["median_ms"] > 0 and c["spread_ms"] >= 0 and c["device"]["device"] == "cpu" for c in ok)

    fastest = min(ok, key=lambda c: c["median_ms"])
    winner = manifest["autotune"]["winner"]
    assert winner == record["winner"] == unit.candidate != "broken"
    if winner != fastest["name"]:  # the default keeps its place unless beaten by more than the noise
        assert winner == "default" and "within the noise" in record["reason"]
    assert manifest["blobs"]["artifact"] == store.get_manifest(by_name[winner]["key"])["blobs"]["artifact"]


@pytest.mark.slow
def test_the_same_job_again_benchmarks_nothing(tuned):
    _, first, again = tuned
    rows = _rows(again)
    assert rows["aoti-cpu (autotuned)"].status == "hit"
    assert rows["aoti-cpu (autotuned)"].candidate == _rows(first)["aoti-cpu (autotuned)"].candidate
    assert rows["aoti-cpu[default]"].status == rows["aoti-cpu[single_thread]"].status == "hit"
    assert rows["aoti-cpu[broken]"].status == "failed"  # failures are not cached, and never chosen
    assert not any("benchmark" in r.timings for r in again.results)


@pytest.mark.slow
def test_retune_measures_every_candidate_again(tuned, zoo_dir):
    store, first, _ = tuned
    retuned = execute(_job(zoo_dir, retune=True), store)
    rows = _rows(retuned)
    assert all("benchmark" in rows[f"aoti-cpu[{n}]"].timings for n in ("default", "single_thread"))
    manifest = store.get_manifest(rows["aoti-cpu (autotuned)"].key)
    record = json.loads(store.backend.read(manifest["autotune"]["tuning_record"]))
    assert {c["name"] for c in record["candidates"] if c["remeasured"]} == {"default", "single_thread"}


def test_decision_needs_more_than_noise():
    default = Measured("default", "compiled", median_ms=1.00, spread_ms=0.05)
    assert decide([default, Measured("fast", "compiled", median_ms=0.80, spread_ms=0.05)]).winner == "fast"
    assert decide([default, Measured("close", "compiled", median_ms=0.95, spread_ms=0.05)]).winner == "default"
    assert decide([default, Measured("broken", "failed", error="boom")]).winner == "default"
    assert decide([Measured("default", "failed"), Measured("other", "hit", median_ms=2.0, spread_ms=0.1)]).winner == "other"
    assert decide([Measured("default", "failed")]) is None


@pytest.mark.parametrize("autotune, message", [
    ({"candidates": ["max_autotune", "warp_speed"]}, "unknown candidate 'warp_speed'"),
    ({"candidates": ["freezing", "freezing"]}, "listed twice: freezing"),
    ({"candidates": []}, "at least one candidate besides `default`"),
])
def test_a_bad_space_is_rejected_when_the_job_loads(autotune, message):
    with pytest.raises(SpecError, match="targets.0") as e:
        parse_job({"graphs": ["m.pt2"], "targets": [{"backend": "aoti-cpu", "autotune": autotune}]}, "job.yaml")
    assert message in str(e.value) and "job.yaml" in str(e.value)


def test_gpu_targets_have_gpu_presets():
    job = parse_job({"graphs": ["m.pt2"], "targets": [
        {"backend": "aoti-cuda", "isa": "sm_90", "autotune": {"candidates": ["max_autotune_triton_gemm",
                                                                              "coordinate_descent_tuning"]}}]})
    space = job.targets[0].space()
    assert space["max_autotune_triton_gemm"] == {"max_autotune": True, "max_autotune_gemm_backends": "TRITON"}
    assert list(space) == ["default", "max_autotune_triton_gemm", "coordinate_descent_tuning"]
    with pytest.raises(SpecError, match="unknown candidate 'cpp_wrapper' for aoti-cuda"):
        parse_job({"graphs": ["m.pt2"], "targets": [{"backend": "aoti-cuda", "autotune": {"candidates": ["cpp_wrapper"]}}]})
