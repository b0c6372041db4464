"""What a rank's graph says about its collectives and dynamic dimensions, and whether the ranks
of a gang agree: the comparisons behind the gang's compiler collectives (issue 11). A gang
all-gathers these summaries over its process group, and every rank runs the same comparison on
the same gathered data, so all ranks reach the same verdict without a coordinator.

Summaries are plain strings and numbers: they cross process boundaries and are compared as values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch.export import ExportedProgram

FUNCTIONAL = "_c10d_functional"
NOT_A_COLLECTIVE = {"wait_tensor"}  # waits for one; issues none


@dataclass(frozen=True)
class CollectiveOp:
    op: str  # e.g. all_reduce, all_gather_into_tensor
    group: str  # the group name baked into the graph ("0" is WORLD)
    args: tuple[str, ...]  # the other non-tensor arguments, e.g. the reduce op or the group size
    shapes: tuple[tuple[str, ...], ...]  # of the tensor inputs, symbolic sizes as their expressions
    dtypes: tuple[str, ...]

    @classmethod
    def from_dict(cls, d: dict) -> "CollectiveOp":
        """Back from `dataclasses.asdict` after a trip through JSON (lists become tuples again)."""
        return cls(op=d["op"], group=d["group"], args=tuple(d["args"]), shapes=tuple(map(tuple, d["shapes"])),
                   dtypes=tuple(d["dtypes"]))

    def describe(self) -> str:
        tensors = ", ".join(f"{d}[{', '.join(s)}]" for s, d in zip(self.shapes, self.dtypes))
        return f"{self.op}({tensors}; {', '.join(self.args)}) on group {self.group!r}"


def _tensors(value: object) -> list[torch.fx.Node]:
    if isinstance(value, torch.fx.Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.fx.Node)]
    return []


def regroup(module: torch.fx.GraphModule, groups: dict[str, str]) -> torch.fx.GraphModule:
    """The module with its functional collectives issued on other groups (old name → new name)."""
    for node in module.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or target.namespace != FUNCTIONAL:
            continue
        for i, spec in enumerate(target._schema.arguments):
            if spec.name != "group_name":
                continue
            if i < len(node.args) and node.args[i] in groups:
                node.args = node.args[:i] + (groups[node.args[i]],) + node.args[i + 1:]
            elif node.kwargs.get("group_name") in groups:
                node.kwargs = {**node.kwargs, "group_name": groups[node.kwargs["group_name"]]}
    module.recompile()
    return module


def collective_ops(ep: ExportedProgram) -> list[CollectiveOp]:
    """The functional collectives the graph issues, in graph order."""
    ops = []
    for node in ep.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target.namespace != FUNCTIONAL or target._schema.name.split("::")[-1] in NOT_A_COLLECTIVE:
            continue
        group, args, inputs = "", [], []
        for spec, value in zip(target._schema.arguments, node.args):
            if spec.name == "group_name":
                group = str(value)
            elif _tensors(value):
                inputs.extend(_tensors(value))
            else:
                args.append(f"{spec.name}={value}")
        vals = [n.meta.get("val") for n in inputs]
        ops.append(CollectiveOp(
            op=target._schema.name.split("::")[-1], group=group, args=tuple(args),
            shapes=tuple(tuple(str(d) for d in v.shape) if isinstance(v, torch.Tensor) else () for v in vals),
            dtypes=tuple(str(v.dtype).removeprefix("torch.") if isinstance(v, torch.Tensor) else "?" for v in vals)))
    return ops


def first_divergence(per_rank: Sequence[Sequence[CollectiveOp]]) -> str | None:
    """Where the ranks' collective sequences first differ, naming the ranks; None if they agree
    (ranks that diverge would hang in their first mismatched collective)."""
    for i in range(max((len(ops) for ops in per_rank), default=0)):
        at = [ops[i] if i < len(ops) else None for ops in per_rank]
        if len(set(at)) == 1:
            continue
        groups: dict[CollectiveOp | None, list[int]] = {}
        for rank, op in enumerate(at):
            groups.setdefault(op, []).append(rank)
        parts = [f"{_ranks(ranks)} {'issue ' + op.describe() if op else 'issue no more collectives'}"
                 for op, ranks in sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[1][0]))]
        return f"the ranks' collectives differ at collective #{i + 1}: " + "; ".join(parts)
    return None


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


DimRanges = dict[str, tuple[int, int | None]]  # `<input>.<dim>` → (lowest, highest or None)


def dim_ranges(ep: ExportedProgram) -> tuple[DimRanges, dict[str, int]]:
    """The program's dynamic dimensions with their ranges, and every user input dimension's size
    in its example inputs (what a rank that traced a dimension static was traced at)."""
    from workers.check.inputs import dynamic_dims

    ranges = {where: (lo, hi) for where, (_, lo, hi) in dynamic_dims(ep).items()}
    args, kwargs = ep.example_inputs
    flat = torch.utils._pytree.tree_leaves((args, kwargs))
    sizes = {f"{name}.{i}": int(n) for name, ex in zip(ep.graph_signature.user_inputs, flat)
             if isinstance(ex, torch.Tensor) for i, n in enumerate(ex.shape)}
    return ranges, sizes


def reconcile_dims(per_rank: Sequence[DimRanges], examples: Sequence[dict[str, int]]) -> tuple[DimRanges, list[str]]:
    """One set of dynamic dimensions for every rank, each with a range valid on all of them.

    A dimension dynamic on any rank is dynamic on all (a rank that traced it static must have
    its size inside the agreed range); the agreed range is the intersection of the ranks'
    ranges. Returns the agreed ranges and the conflicts, each naming the ranks; ranges are
    never guessed: with a conflict the gang must not compile."""
    agreed: DimRanges = {}
    conflicts: list[str] = []
    for dim in sorted({d for ranges in per_rank for d in ranges}):
        declared = {rank: ranges[dim] for rank, ranges in enumerate(per_rank) if dim in ranges}
        lo = max(r[0] for r in declared.values())
        highs = [r[1] for r in declared.values() if r[1] is not None]
        hi = min(highs) if highs else None
        if hi is not None and lo > hi:
            conflicts.append(f"{dim}: the ranges of " + ", ".join(f"rank {r} [{a}, {b if b is not None else 'inf'}]"
                                                                  for r, (a, b) in declared.items()) + " do not overlap")
            continue
        for rank, sizes in enumerate(examples):
            if rank not in declared and dim in sizes:
                size = sizes[dim]
                if size < lo or (hi is not None and size > hi):
                    conflicts.append(f"{dim}: rank {rank} traced it static at {size}, outside the others' range "
                                     f"[{lo}, {hi if hi is not None else 'inf'}]")
        agreed[dim] = (lo, hi)
    return agreed, conflicts
