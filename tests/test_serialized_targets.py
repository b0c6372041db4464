"""Serialized programs for other runtimes (issue 15): ExecuTorch .pte, portable and with the
XNNPACK delegate, and a canonical core-ATen program, built by the same keys, store, results,
autotune and nightly paths as AOTInductor.

The smoke zoo goes through `farm zoo run` on the test cluster with the three targets: every
model compiles and verifies with ExecuTorch's own runtime, the ops XNNPACK cannot take stay on
portable kernels, and the report shows the targets side by side. An op no runtime knows fails
with its name; a host without the extra says which extra to install (those, in one process:
tests/test_serialized_in_process.py). (A .pte compiled into S3 and run in a fresh process:
tests/test_s3_end_to_end.py.)"""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest
import torch

from storage import store_from_uri
from storage.history import read_history

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
