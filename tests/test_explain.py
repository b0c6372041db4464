"""`farm explain`: every miss answers "why did this not hit?" in one command."""
from __future__ import annotations

import pytest
import torch
from scheduler.spec import parse_job
from farm.zoo import export_model
from scheduler.jobs import execute
from tests.cli import farm as _farm
from workers import keys

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def retrained(zoo_runs, tmp_path_factory):
    """The zoo's MLP after another epoch of training, compiled into the zoo's store."""
    store = zoo_runs[0]
    ep = export_model("mlp")
    with torch.no_grad():
        for p in ep.state_dict.values():
            p.mul_(1.01)
    path = tmp_path_factory.mktemp("retrained") / "mlp.pt2"
    torch.export.save(ep, str(path))
    return execute(parse_job({"graphs": [str(path)], "targets": ["aoti-cpu"]}), store)


def test_a_retrained_checkpoint_misses_because_of_its_weights(zoo_runs, retrained):
    store = zoo_runs[0]
    (r,) = retrained.results
    assert r.status == "compiled"
    out = _farm("explain", "--job", retrained.job_id, "--store", store.uri)
    original = next(c.key for c in zoo_runs[1].results if c.graph == "mlp")
    assert f"closest key {original[:16]}" in out and "mlp@aoti-cpu" in out
    assert "program.weights" in out and "program.program" in out
    assert "program.graph" not in out and "toolchain" not in out and "target." not in out


def test_a_new_compiler_shows_up_as_the_difference(zoo_runs, zoo_dir, monkeypatch):
    store = zoo_runs[0]
    from workers.backends import cxx

    upgraded = {**keys.toolchain(), "torch": "2.14.0"}
    compiler = {**cxx.compiler(), "cxx_version": "g++ (GCC) 14.1.0"}
    monkeypatch.setattr(keys, "toolchain", lambda: upgraded)  # as if the worker image had been upgraded
    monkeypatch.setattr(cxx, "compiler", lambda: compiler)
    outcome = execute(parse_job({"graphs": [str(zoo_dir / "cnn.pt2")], "targets": ["aoti-cpu"]}), store)
    assert outcome.results[0].status == "compiled"
    out = _farm("explain", "--job", outcome.job_id, "--store", store.uri)
    assert "toolchain.torch" in out and "2.14.0" in out and torch.__version__ in out
    assert "toolchain.cxx_version" in out and "program." not in out


def test_explain_two_keys_and_by_prefix(zoo_runs, retrained):
    store = zoo_runs[0]
    a = next(c.key for c in zoo_runs[1].results if c.graph == "mlp")
    b = retrained.results[0].key
    out = _farm("explain", a[:10], b, "--store", store.uri)
    assert "program.weights" in out and "target.isa" not in out
    assert "same components" in _farm("explain", a, a, "--store", store.uri)
    assert "no manifest for key" in _farm("explain", a, "f" * 64, "--store", store.uri)
    assert "give two keys" in _farm("explain", a, "--store", store.uri)


def test_hits_need_no_explaining_and_first_compiles_say_so(zoo_runs, zoo_dir, tmp_path):
    store = zoo_runs[0]
    assert "every unit was a hit" in _farm("explain", "--job", zoo_runs[2].job_id, "--store", store.uri)
    (tmp_path / "elsewhere").mkdir()  # a store without that job (one not there is said: test_bad_input)
    out = _farm("explain", "--job", zoo_runs[1].job_id, "--store", str(tmp_path / "elsewhere"))
    assert "no job" in out
