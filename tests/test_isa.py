"""Artifacts are pinned to an x86 ISA, not to the build host; the farm enforces it at load."""
from __future__ import annotations

import pytest

from scheduler.spec import parse_job
from scheduler.jobs import execute
from storage import store_from_uri
from workers.backends import LoweringError, get_backend
from workers.backends import cpu_isa
from workers.unit import Target

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_isas(zoo_dir, tmp_path_factory):
    store = store_from_uri(str(tmp_path_factory.mktemp("isa")))
    job = parse_job({"graphs": [str(zoo_dir / "mlp.pt2")], "targets": ["aoti-cpu:x86-64", "aoti-cpu:avx2"]})
    return store, {r.target: r for r in execute(job, store).results}


def test_each_isa_is_its_own_key_and_package(two_isas):
    store, results = two_isas
    base, avx2 = results["aoti-cpu:x86-64"], results["aoti-cpu:avx2"]
    assert base.status == avx2.status == "compiled"
    assert base.key != avx2.key
    assert store.get_manifest(base.key)["artifact"]["isa"] == "INVALID_VEC_ISA"  # scalar: any x86-64 host
    assert store.get_manifest(avx2.key)["artifact"]["isa"] == "AVX2"
    assert store.get_manifest(avx2.key)["components"]["target"]["isa"] == "avx2"


def test_loading_on_a_host_without_the_isa_is_refused(two_isas, tmp_path, monkeypatch):
    store, results = two_isas
    path = store.fetch(results["aoti-cpu:avx2"].artifact.digest, tmp_path / "a.pt2")
    monkeypatch.setattr(cpu_isa, "host_vec_isas", lambda: set())  # an old host: no AVX2
    with pytest.raises(LoweringError, match="needs AVX2, which this host lacks"):
        get_backend("aoti-cpu").load(path, Target("aoti-cpu", "avx2"))


def test_unknown_isa_fails_the_unit_with_the_choices(zoo_dir, tmp_path):
    job = parse_job({"graphs": [str(zoo_dir / "mlp.pt2")], "targets": ["aoti-cpu:avx9000"]})
    (r,) = execute(job, store_from_uri(str(tmp_path))).results
    assert r.status == "failed" and "unknown ISA 'avx9000'" in r.error and "avx2" in r.error
