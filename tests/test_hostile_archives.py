"""Hostile graphs (issue 9): each case is generated from a real exported program and submitted
in a job next to a good graph. The hostile unit fails with a message naming the graph and
the member, nothing it carries runs (its canary, outside the unit's temp dir, never appears),
and the good unit still completes."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scheduler.spec import SpecError, load_job, parse_job
from scheduler.jobs import execute
from storage import store_from_uri
from tests import hostile

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory):
    return store_from_uri(str(tmp_path_factory.mktemp("hostile-store")))


def _run(case: str, maker, zoo_dir: Path, tmp_path: Path, store, limits: dict | None = None):
    canary = tmp_path / "outside-the-unit" / "CANARY"
    canary.parent.mkdir()
    bad = tmp_path / f"{case}.pt2"
    member = maker(zoo_dir / "mlp.pt2", bad, canary)
    # core-aten: every target loads the program through the same checked loader, and the good
    # graph's unit then completes without a C++ build
    job = parse_job({"name": case, "graphs": [str(bad), str(zoo_dir / "mlp.pt2")], "targets": ["core-aten"],
                     "limits": limits or {}})
    outcome = execute(job, store)
    return {r.graph: r for r in outcome.results}, member, canary


@pytest.mark.parametrize("case", sorted(hostile.CODE) + sorted(hostile.STRUCTURE))
def test_a_hostile_archive_fails_its_unit_runs_nothing_and_the_job_completes(case, zoo_dir, tmp_path, shared_store):
    maker = {**hostile.CODE, **hostile.STRUCTURE}[case]
    results, member, canary = _run(case, maker, zoo_dir, tmp_path, shared_store)
    bad, good = results[case], results["mlp"]
    assert bad.status == "failed", bad
    assert f"graph {case}" in bad.error and member in bad.error, bad.error
    assert not canary.exists(), f"{case}: the payload ran"
    assert good.status in ("compiled", "hit"), good.error
    assert bad.log is not None  # the unit log is kept for people


def test_totals_over_the_archive_limit_are_refused(zoo_dir, tmp_path, shared_store):
    def padded(good: Path, dest: Path, canary: Path) -> str:
        root, members = hostile._members(good)
        members["extra/padding"] = b"\0" * (2 << 20)  # stored, not compressed: no ratio to catch
        hostile._write(dest, root, members)
        return "extra/padding"
    results, member, _ = _run("big", padded, zoo_dir, tmp_path, shared_store, limits={"archive_gb": 0.001})
    assert results["mlp"].status in ("compiled", "hit"), results["mlp"].error
    assert results["big"].status == "failed" and "zip bomb" in results["big"].error, results["big"].error
    assert "declare more than" in results["big"].error


def test_the_generated_attack_is_real_torch_itself_runs_it(zoo_dir, tmp_path):
    """A control: torch.export.load on the reported attack runs the payload (in a throwaway process)."""
    canary = tmp_path / "CANARY"
    bad = tmp_path / "attack.pt2"
    hostile.sample_inputs(zoo_dir / "mlp.pt2", bad, canary)
    subprocess.run([sys.executable, "-c", f"import torch; torch.export.load({str(bad)!r})"], capture_output=True)
    assert canary.exists()


def test_job_specs_refuse_alias_bombs_oversized_files_and_sources_outside_the_allowed(tmp_path, monkeypatch, zoo_dir):
    bomb = tmp_path / "bomb.yaml"
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"] + [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]"
                                                          for i in range(1, 9)]
    bomb.write_text("\n".join(lines + ["graphs: [*a8]", "targets: [aoti-cpu]"]))
    with pytest.raises(SpecError, match="aliases"):
        load_job(bomb)
    big = tmp_path / "big.yaml"
    big.write_text("graphs: [m.pt2]\ntargets: [aoti-cpu]\n" + "#" * (2 << 20))
    with pytest.raises(SpecError, match="too big"):
        load_job(big)
    job = tmp_path / "job.yaml"
    job.write_text(f"graphs: [{zoo_dir / 'mlp.pt2'}, s3://models/bert.pt2]\ntargets: [aoti-cpu]\n")
    monkeypatch.setenv("FARM_ALLOWED_SOURCES", "s3://models/")
    with pytest.raises(SpecError, match=r"graphs\.0\.path: .*outside the sources"):
        load_job(job)
    monkeypatch.setenv("FARM_ALLOWED_SOURCES", f"s3://models/,{zoo_dir}/")
    assert len(load_job(job).graphs) == 2
