"""Serialized programs for other runtimes (issue 15): ExecuTorch .pte, portable and with the
XNNPACK delegate, and a canonical core-ATen program, built by the same keys, store, results,
autotune and nightly paths as AOTInductor.

The smoke zoo goes through `farm zoo run` on the test cluster with the three targets: every
model compiles and verifies with ExecuTorch's own runtime, the ops XNNPACK cannot take stay on
portable kernels, and the report shows the targets side by side. An op no runtime knows fails
with its name; a host without the extra says which extra to install. (A .pte compiled into S3
and run in a fresh process: tests/test_s3_end_to_end.py.)"""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest
import torch

from scheduler.jobs import execute
from scheduler.spec import parse_job
from storage import store_from_uri
from storage.history import read_history
from workers import host_check
from workers.backends import executorch as et_backend

pytestmark = pytest.mark.slow
TARGETS = ["executorch:portable", "executorch:xnnpack", "core-aten"]
SMOKE = {"mlp", "cnn", "encoder_block", "gpt"}


def _farm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "farm", *args], capture_output=True, text=True, timeout=900,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def night(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("serialized-night")
    store, report = root / "store", root / "report.html"
    targets = [a for t in TARGETS for a in ("--target", t)]
    proc = _farm("zoo", "run", "--suite", "smoke", *targets, "--store", str(store), "--address", ray_cluster.address,
                 "--report", str(report))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_history(store_from_uri(str(store))).to_pylist()
    return store_from_uri(str(store)), report, rows


def _overload(name: str) -> torch._ops.OpOverload:
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def test_the_smoke_zoo_compiles_to_both_pte_flavours_and_core_aten(night):
    store, _, rows = night
    assert {(r["model"], r["target"]) for r in rows} == {(m, t) for m in SMOKE for t in TARGETS}
    failed = [(r["model"], r["target"], r["error"]) for r in rows if r["status"] != "compiled"]
    assert not failed, failed
    assert all(r["max_abs_err"] is not None and r["speedup"] > 0 for r in rows)  # verified and benchmarked
    version = importlib.metadata.version("executorch")
    for r in rows:
        manifest = store.get_manifest(r["key"])
        facts, tools = manifest["artifact"], manifest["components"]["toolchain"]
        if r["target"] == "core-aten":
            assert facts["format"] == "torch-export-core-aten"
            overloads = [_overload(op) for op in facts["ops"]]
            assert overloads and all(torch.Tag.core in o.tags for o in overloads), facts["ops"]
            continue
        assert facts["format"] == "executorch-pte" and tools["executorch"] == version  # the key holds the version
        if r["target"] == "executorch:portable":
            assert facts["delegates"] == [] and facts["portable_ops"], facts
        else:
            assert facts["delegates"] == ["XnnpackBackend"] and tools["xnnpack_schema"] == "XN01", (facts, tools)


def test_an_op_xnnpack_cannot_take_stays_on_portable_kernels(night):
    """The CNN's global mean is not delegated: it must still be in the program, as a portable kernel."""
    store, _, rows = night
    (cnn,) = [r for r in rows if r["model"] == "cnn" and r["target"] == "executorch:xnnpack"]
    facts = store.get_manifest(cnn["key"])["artifact"]
    assert "aten::mean.out" in facts["portable_ops"] and facts["delegate_calls"] >= 1, facts


def test_the_report_shows_the_targets_side_by_side(night):
    _, report, _ = night
    page = report.read_text()
    grid = page.split('<table class="side-by-side">')[1].split("</table>")[0]
    header = grid.split("</thead>")[0]
    assert all(f"<th>{t}</th>" in header for t in TARGETS)
    assert grid.count("<tr>") == 1 + len(SMOKE) and grid.count("compiled ·") == len(SMOKE) * len(TARGETS)


class TwoDynamicDims(torch.nn.Module):
    """An unsqueeze whose output has two dynamic dimensions: XNNPACK's partitioner takes it, its
    preprocessing refuses it ("XNNPACK reshape only supports 1 dynamic dimension")."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(torch.tanh(x).unsqueeze(-1) * torch.ones(4))


def test_a_node_the_xnnpack_delegate_refuses_runs_on_portable_kernels(tmp_path):
    from torch.export import Dim

    program = tmp_path / "two_dims.pt2"
    dims = {"x": {0: Dim("batch", min=1, max=64), 1: Dim("seq", min=2, max=128)}}
    torch.export.save(torch.export.export(TwoDynamicDims(), (torch.randn(3, 5),), dynamic_shapes=dims), str(program))
    store = store_from_uri(str(tmp_path / "store"))
    job = parse_job({"name": "refused", "graphs": [str(program)], "targets": ["executorch:xnnpack"]})
    (result,) = execute(job, store).results
    assert result.status == "compiled", result.error
    assert result.metrics["max_abs_err"] < 1e-4  # verified against eager, at several sizes
    facts = store.get_manifest(result.key)["artifact"]
    assert facts["delegates"] == ["XnnpackBackend"] and "aten::unsqueeze_copy.out" in facts["portable_ops"], facts
    (refused,) = facts["delegate_refused"]
    assert refused["op"] == "aten.unsqueeze_copy.default", refused
    assert refused["reason"] == "XNNPACK reshape only supports 1 dynamic dimension.", refused  # whole, not cut


def test_an_op_no_runtime_knows_fails_with_its_name(tmp_path):
    from tests.fixtures.custom_ops import UsesMystery

    program = tmp_path / "mystery.pt2"
    torch.export.save(torch.export.export(UsesMystery(), (torch.randn(2, 8),)), str(program))
    job = parse_job({"name": "mystery", "graphs": [str(program)], "targets": ["core-aten", "executorch:portable"],
                     "modules": ["tests.fixtures.custom_ops"]})
    results = {r.target: r for r in execute(job, store_from_uri(str(tmp_path / "store"))).results}
    assert results["core-aten"].status == "failed"
    assert "no decomposition to core ATen" in results["core-aten"].error
    assert "farmtest.mystery.default" in results["core-aten"].error
    assert results["executorch:portable"].status == "failed"
    assert "ExecuTorch has no kernel for these operators: {'farmtest::mystery'}" in results["executorch:portable"].error


def test_xnnpack_autotunes_through_the_same_path(zoo_dir, tmp_path):
    job = parse_job({"name": "tune-pte", "graphs": [str(zoo_dir / "mlp.pt2")],
                     "targets": [{"backend": "executorch", "isa": "xnnpack", "autotune": {"candidates": ["per_op"]}}]})
    store = store_from_uri(str(tmp_path / "store"))
    rows = {r.target: r for r in execute(job, store).results}
    tuned = "executorch:xnnpack (autotuned)"
    assert set(rows) == {"executorch:xnnpack[default]", "executorch:xnnpack[per_op]", tuned}, rows
    assert all(r.status == "compiled" for r in rows.values()), {t: r.error for t, r in rows.items()}
    manifest = store.get_manifest(rows[tuned].key)
    assert manifest["autotune"]["winner"] in ("default", "per_op") and manifest["artifact"]["format"] == "executorch-pte"


def test_without_the_extra_the_targets_say_which_to_install(monkeypatch, zoo_dir, tmp_path):
    from workers.backends import get_backend, offered_resources

    monkeypatch.setattr(et_backend, "installed", lambda: None)
    monkeypatch.setattr(host_check, "_asked", {})  # this process's earlier units found ExecuTorch here
    assert et_backend.RESOURCE not in offered_resources(2)  # such a host offers no slots for them
    assert "pip install -e '.[executorch]'" in get_backend("executorch").placement(None).unoffered
    job = parse_job({"name": "no-extra", "graphs": [str(zoo_dir / "mlp.pt2")], "targets": ["executorch:xnnpack"],
                     "limits": {"retries": 0}})
    (result,) = execute(job, store_from_uri(str(tmp_path / "store"))).results
    assert result.status == "failed"
    assert "needs ExecuTorch, which this host lacks: pip install -e '.[executorch]'" in result.error, result.error
