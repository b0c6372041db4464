"""The serialized targets in one process, without Ray (the nightly path on the test cluster:
tests/test_serialized_targets.py): a node XNNPACK refuses falls back to portable kernels, an op
no runtime knows fails with its name, XNNPACK autotunes through the common path, and a host
without the extra says which extra to install."""
from __future__ import annotations

import pytest
import torch

from scheduler.jobs import execute
from scheduler.spec import parse_job
from storage import store_from_uri
from workers import host_check
from workers.backends import executorch as et_backend

pytestmark = pytest.mark.slow


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
