"""One bad graph never stops a job: each ends as failed with a message naming the graph and
saying what to do, nothing is published for it, and the good graph still compiles."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from scheduler.spec import parse_job
from scheduler.jobs import execute
from storage import store_from_uri
from storage.results import read_results

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bad_job(zoo_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "notes.pt2").write_text("this is not an archive")
    good = (zoo_dir / "mlp.pt2").read_bytes()
    (d / "truncated.pt2").write_bytes(good[: len(good) // 2])
    # exported in a separate process, so this process has never registered the output type
    subprocess.run([sys.executable, "-c", f"from tests.fixtures.custom_output import export; export({str(d / 'custom.pt2')!r})"],
                   check=True, capture_output=True)
    store = store_from_uri(str(d / "store"))
    job = parse_job({
        "name": "bad",
        "graphs": ["missing.pt2", "notes.pt2", "truncated.pt2", "custom.pt2", str(zoo_dir / "mlp.pt2")],
        "targets": ["core-aten", "no-such-backend"],  # core-aten: bad input fails alike for every target
    }, "bad.yaml", base_dir=d)
    return store, execute(job, store), d


def _result(outcome, graph, target="core-aten"):
    return next(r for r in outcome.results if r.graph == graph and r.target == target)


@pytest.mark.parametrize("graph, says", [
    ("missing", "does not exist; check the path"),
    ("notes", "is not a .pt2 archive: save the program with torch.export.save"),
    ("truncated", "truncated or corrupt .pt2 archive"),
    ("custom", "is not registered. Add the module that registers this output type"),
])
def test_each_bad_graph_fails_with_a_message_naming_it(bad_job, graph, says):
    _, outcome, _ = bad_job
    r = _result(outcome, graph)
    assert r.status == "failed"
    assert f"graph {graph}" in r.error and says in r.error, r.error


def test_unknown_target_fails_its_units_and_lists_known_ones(bad_job):
    _, outcome, _ = bad_job
    r = _result(outcome, "mlp", "no-such-backend")
    assert r.status == "failed" and "unknown target 'no-such-backend'" in r.error and "aoti-cpu" in r.error


def test_good_graph_still_compiles_and_only_it_is_published(bad_job):
    store, outcome, _ = bad_job
    good = _result(outcome, "mlp")
    assert good.status == "compiled", good.error
    assert set(store.manifest_keys()) == {good.key}
    rows = read_results(store, outcome.job_id)
    assert len(rows) == 10 and sum(r["status"] == "failed" for r in rows) == 9
    # every failure keeps a log that says what happened, readable from the store alone
    for row in rows:
        if row["graph"] == "custom" and row["target"] == "core-aten":
            assert "not registered" in store.get_bytes(row["log_digest"]).decode()


def test_naming_the_module_fixes_the_unregistered_output(bad_job):
    store, _, d = bad_job
    job = parse_job({"graphs": ["custom.pt2"], "targets": ["core-aten"], "modules": ["tests.fixtures.custom_output"]},
                    "fixed.yaml", base_dir=d)
    r = execute(job, store).results[0]
    assert r.status == "compiled", r.error


def test_cli_reports_failures_with_nonzero_exit(zoo_dir, tmp_path):
    bad = tmp_path / "bad.pt2"
    bad.write_text("nope")
    proc = subprocess.run([sys.executable, "-m", "farm", "compile", str(bad), "--store", str(tmp_path / "s")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "not a .pt2 archive" in proc.stdout and "some units failed" in proc.stderr


def test_invalid_job_file_names_the_field(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent("""
        graphs: [a.pt2]
        targets: [aoti-cpu]
        verify: {atol: -1}
    """))
    proc = subprocess.run([sys.executable, "-m", "farm", "run", str(job)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"{job}: the job spec is invalid" in proc.stderr and "verify.atol" in proc.stderr
