"""The comparisons behind a gang's compiler collectives (issue 11), on rank graphs exported
under torch's fake process group: the functional collectives a graph issues, where ranks'
collectives first differ, and one set of dynamic ranges for every rank."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.export import Dim

from workers.gang.collectives import collective_ops, dim_ranges, first_divergence, reconcile_dims, regroup


class RowParallel(torch.nn.Module):
    """A tensor-parallel-style block: local matmul, then the ranks' partial sums all-reduced."""

    def __init__(self, extra_all_reduce: bool = False, reduce_op: str = "sum"):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.extra, self.reduce_op = extra_all_reduce, reduce_op

    def forward(self, x):
        y = funcol.all_reduce(self.proj(x), self.reduce_op, dist.group.WORLD)
        if self.extra:
            y = funcol.all_reduce(y * 2, "sum", dist.group.WORLD)
        return funcol.all_gather_tensor(y, 0, dist.group.WORLD)


@pytest.fixture(scope="module")
def fake_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def _export(model, batch=(1, 32)):
    return torch.export.export(model, (torch.randn(4, 8),), dynamic_shapes={"x": {0: Dim("b", min=batch[0], max=batch[1])}})


def test_a_graphs_functional_collectives_are_listed_in_order(fake_group):
    ops = collective_ops(_export(RowParallel()))
    assert [(o.op, o.group) for o in ops] == [("all_reduce", "0"), ("all_gather_into_tensor", "0")]
    assert ops[0].args == ("reduce_op=sum",) and ops[0].dtypes == ("float32",) and ops[0].shapes[0][1] == "8"
    assert "group_size=2" in ops[1].args


def test_the_eager_reference_can_issue_its_collectives_on_a_group_of_its_own(fake_group):
    ep = _export(RowParallel())
    other = dist.new_group([0, 1])
    module = regroup(ep.module(), {"0": other.group_name})
    groups = [n.args[-1] for n in module.graph.nodes if getattr(n.target, "namespace", None) == "_c10d_functional"
              and n.target._schema.arguments[-1].name == "group_name"]
    assert groups == [other.group_name] * 2 and other.group_name != "0"
    assert module(torch.randn(4, 8)).shape == (8, 8)  # runs over that group (fake: nothing is sent)
    assert [o.group for o in collective_ops(ep)] == ["0", "0"]  # the program itself is untouched


def test_identical_ranks_agree_and_an_extra_all_reduce_is_named(fake_group):
    same = [collective_ops(_export(RowParallel())) for _ in range(4)]
    assert first_divergence(same) is None
    extra = same[:3] + [collective_ops(_export(RowParallel(extra_all_reduce=True)))]
    report = first_divergence(extra)
    assert "collective #2" in report and "rank 3 issue all_reduce" in report and "ranks 0, 1, 2 issue all_gather" in report


def test_a_different_reduce_op_is_a_divergence(fake_group):
    report = first_divergence([collective_ops(_export(RowParallel())), collective_ops(_export(RowParallel(reduce_op="max")))])
    assert "collective #1" in report and "reduce_op=max" in report and "reduce_op=sum" in report


def test_ranks_with_different_dynamic_ranges_reconcile_to_one(fake_group):
    (r0, s0), (r1, s1) = dim_ranges(_export(RowParallel(), (1, 32))), dim_ranges(_export(RowParallel(), (2, 64)))
    agreed, conflicts = reconcile_dims([r0, r1], [s0, s1])
    assert agreed == {"x.0": (2, 32)} and not conflicts


def test_ranges_that_do_not_overlap_and_static_sizes_outside_are_conflicts():
    _, conflicts = reconcile_dims([{"x.0": (1, 8)}, {"x.0": (16, 32)}], [{}, {}])
    assert conflicts == ["x.0: the ranges of rank 0 [1, 8], rank 1 [16, 32] do not overlap"]
    agreed, conflicts = reconcile_dims([{"x.0": (1, 8)}, {}], [{"x.0": 4}, {"x.0": 12}])
    assert agreed == {"x.0": (1, 8)}
    assert conflicts == ["x.0: rank 1 traced it static at 12, outside the others' range [1, 8]"]
