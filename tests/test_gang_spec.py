"""A multi-rank entry in the job spec: one program per rank, checked against the world size,
with errors that name the field; and what a runner without gangs says about them."""
from __future__ import annotations

import shutil

import pytest

from scheduler.spec import SpecError, parse_job
from scheduler.jobs import execute
from scheduler.plan import plan_gangs
from storage import store_from_uri


def _gang(**fields):
    return {"gangs": [{"name": "tp", "world_size": 4, "ranks": "tp/rank{rank}.pt2", **fields}], "targets": ["aoti-cpu"]}


def test_a_pattern_expands_to_one_program_per_rank():
    job = parse_job(_gang(), base_dir="/models")
    assert job.gangs[0].paths() == [f"tp/rank{r}.pt2" for r in range(4)]
    assert job.resolve(job.gangs[0].paths()[3]) == "/models/tp/rank3.pt2"


@pytest.mark.parametrize("fields, says", [
    ({"ranks": ["a.pt2", "b.pt2"]}, "2 programs listed for world_size 4"),
    ({"ranks": "tp/rank.pt2"}, "has no {rank}"),
    ({"devices": ["cpu", "cpu"]}, "devices: 2 listed for world_size 4"),
    ({"devices": ["cpu", "cuda", "cpu", "cpu"]}, "all cpu (gloo) or all cuda (NCCL)"),
    ({"name": "a/b"}, "plain name"),
])
def test_a_wrong_gang_is_rejected_naming_the_field(fields, says):
    with pytest.raises(SpecError) as e:
        parse_job(_gang(**fields), "job.yaml")
    assert "job.yaml" in str(e.value) and "gangs.0" in str(e.value) and says in str(e.value)


def test_a_job_needs_graphs_or_gangs():
    with pytest.raises(SpecError, match="graphs: .*at least one graph, or a multi-rank model under gangs"):
        parse_job({"targets": ["aoti-cpu"]})


def test_a_target_for_another_device_fails_the_gangs_ranks_with_the_reason(zoo_dir, tmp_path):
    for r in range(2):
        shutil.copy(zoo_dir / "mlp.pt2", tmp_path / f"rank{r}.pt2")
    job = parse_job({"gangs": [{"name": "m", "world_size": 2, "ranks": "rank{rank}.pt2"}],
                     "targets": ["aoti-cuda:sm_90"]}, base_dir=tmp_path)
    (gang,) = plan_gangs(job, store_from_uri(str(tmp_path / "store")))
    assert [u.graph for u in gang.ranks] == ["m.rank0", "m.rank1"]
    assert all("builds for cuda, but gang m's ranks run on cpu" in u.ingest_error for u in gang.ranks)


def test_without_ray_a_gang_fails_saying_where_it_runs(zoo_dir, tmp_path):
    for r in range(2):
        shutil.copy(zoo_dir / "mlp.pt2", tmp_path / f"rank{r}.pt2")
    job = parse_job({"gangs": [{"name": "m", "world_size": 2, "ranks": "rank{rank}.pt2"}], "targets": ["aoti-cpu"]},
                    base_dir=tmp_path)
    outcome = execute(job, store_from_uri(str(tmp_path / "store")))
    assert [r.status for r in outcome.results] == ["failed", "failed"]
    assert all("on Ray" in r.error and "farm run" in r.error for r in outcome.results)
