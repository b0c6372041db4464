"""Rank 0 of a gang of identical ranks compiles before its gang has agreed (workers/gang/early.py)
and publishes only once the gang confirms it: a gang that fails meanwhile publishes nothing.
(A whole gang that compiles early runs in tests/test_gang.py.)"""
from __future__ import annotations

import pytest

from scheduler.plan import plan
from scheduler.spec import parse_job
from storage import Leases, store_from_uri
from workers.gang.early import EarlyCompile
from workers.sandbox.process import Sandbox


@pytest.fixture
def unit_and_store(zoo_dir, tmp_path):
    store = store_from_uri(str(tmp_path / "store"))
    (unit,) = plan(parse_job({"graphs": [str(zoo_dir / "mlp.pt2")], "targets": ["core-aten"]}), store)
    return unit, store


def test_a_gang_that_fails_while_rank_0_compiles_early_publishes_nothing(unit_and_store):
    unit, store = unit_and_store
    with Sandbox() as sandbox:
        early = EarlyCompile(unit, store, sandbox)
        assert early.held.wait(300), "the early compile never reached its publication"
        assert early.result is None  # held back, not published
        early.cancel("rank 3 died")
    result = early.result
    assert result.status == "failed" and "not published: rank 3 died" in result.error, result.error
    assert result.key and store.get_manifest(result.key) is None
    assert Leases(store.backend, "x").current(result.key) is None  # its lease let go for the next job


def test_a_confirmed_early_compile_publishes_and_says_so(unit_and_store):
    unit, store = unit_and_store
    with Sandbox() as sandbox:
        early = EarlyCompile(unit, store, sandbox)
        result = early.confirm(unit)
    assert result.status == "compiled", result.error
    assert store.get_manifest(result.key)["key"] == result.key
    assert result.metrics["gang_compiled_early"] == 1.0 and "agree" in result.timings
