"""Numerics: the compiled artifact against the exported program run eagerly."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from workers.check.inputs import InputSet


@dataclass
class VerifyReport:
    ok: bool
    max_abs_err: float
    max_rel_err: float
    checked: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def compare(eager: Any, compiled: Any, atol: float, rtol: float, label: str, report: VerifyReport) -> None:
    e_leaves, c_leaves = pytree.tree_leaves(eager), pytree.tree_leaves(compiled)
    if len(e_leaves) != len(c_leaves):
        report.problems.append(f"{label}: {len(c_leaves)} outputs, eager gave {len(e_leaves)}")
        return
    for i, (e, c) in enumerate(zip(e_leaves, c_leaves)):
        if not isinstance(e, torch.Tensor):
            if e != c:
                report.problems.append(f"{label}: output {i} is {c!r}, eager gave {e!r}")
            continue
        if tuple(e.shape) != tuple(c.shape):
            report.problems.append(f"{label}: output {i} has shape {tuple(c.shape)}, eager {tuple(e.shape)}")
            continue
        if e.numel() == 0:
            continue
        e64, c64 = e.detach().double(), c.detach().double()
        diff = (e64 - c64).abs()
        abs_err = float(diff.max())
        rel_err = float((diff / (e64.abs() + atol)).max())
        report.max_abs_err = max(report.max_abs_err, abs_err)
        report.max_rel_err = max(report.max_rel_err, rel_err)
        if not torch.allclose(c64, e64, atol=atol, rtol=rtol, equal_nan=True):
            report.problems.append(f"{label}: output {i} max abs error {abs_err:.3g} exceeds atol={atol} rtol={rtol}")


def verify(eager: Callable, compiled: Callable, inputs: list[InputSet], atol: float, rtol: float) -> VerifyReport:
    report = VerifyReport(ok=True, max_abs_err=0.0, max_rel_err=0.0)
    with torch.inference_mode():
        # Every eager run first, then every compiled one (in a gang, the eager runs' collectives
        # also go over a group of their own: workers/gang/steps.py, GangSteps.eager_reference).
        expected = [eager(*s.args, **s.kwargs) for s in inputs]
        for s, want in zip(inputs, expected):
            try:
                got = compiled(*s.args, **s.kwargs)
            except Exception as e:  # the artifact rejected a size inside the declared range
                report.problems.append(f"{s.label}: compiled artifact raised {type(e).__name__}: {e}")
                continue
            compare(want, got, atol, rtol, s.label, report)
            report.checked.append(s.label)
    report.ok = not report.problems
    return report
