"""Inputs to check a program on: its example inputs, and the same at other sizes inside
every dynamic dimension's range (a compiled artifact that only works at the traced size
is not a dynamic artifact)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram


@dataclass
class InputSet:
    label: str  # e.g. "example" or "s77=3"
    args: tuple
    kwargs: dict[str, Any]


def _user_input_vals(ep: ExportedProgram) -> list[Any]:
    user = set(ep.graph_signature.user_inputs)
    return [n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder" and n.name in user]


def _bounds(ep: ExportedProgram, sym: sympy.Symbol, example: int) -> tuple[int, int]:
    vr = ep.range_constraints.get(sym)
    lo = int(vr.lower) if vr is not None and vr.lower.is_finite else 0
    hi = int(vr.upper) if vr is not None and vr.upper.is_finite else 2 * example
    return lo, hi


def _other_values(example: int, lo: int, hi: int, n: int) -> list[int]:
    """Up to n sizes other than example, inside [lo, hi], kept small so checks stay quick."""
    hi = min(hi, max(2 * example, example + 2))
    wanted = [example + 1, max(lo, example // 2), hi, lo]
    out: list[int] = []
    for v in wanted:
        if lo <= v <= hi and v != example and v not in out and v >= 1:
            out.append(v)
    return out[:n]


def _like(example: torch.Tensor, shape: list[int], gen: torch.Generator) -> torch.Tensor:
    if example.dtype.is_floating_point or example.dtype.is_complex:
        return torch.randn(shape, dtype=example.dtype, generator=gen)
    if example.dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    # Integer inputs are usually indices (token ids): stay within the example's value range.
    lo = int(example.min()) if example.numel() else 0
    hi = int(example.max()) if example.numel() else 1
    return torch.randint(lo, hi + 1, shape, dtype=example.dtype, generator=gen)


def input_sets(ep: ExportedProgram, extra_sizes: int = 2, seed: int = 0) -> list[InputSet]:
    if ep.example_inputs is None:
        raise ValueError("the program carries no example inputs; export it with torch.export.export(model, args)")
    args, kwargs = ep.example_inputs
    sets = [InputSet("example", args, kwargs)]
    flat, spec = pytree.tree_flatten((args, kwargs))
    vals = _user_input_vals(ep)
    if len(vals) != len(flat):
        return sets  # unusual signature (e.g. non-tensor inputs folded away): check at the example only

    examples: dict[sympy.Symbol, int] = {}
    for val, ex in zip(vals, flat):
        if isinstance(val, torch.Tensor) and isinstance(ex, torch.Tensor):
            for dim, size in zip(val.shape, ex.shape):
                if isinstance(dim, torch.SymInt) and isinstance(dim.node.expr, sympy.Symbol):
                    examples[dim.node.expr] = int(size)

    gen = torch.Generator().manual_seed(seed)
    for sym, example in sorted(examples.items(), key=lambda kv: str(kv[0])):
        lo, hi = _bounds(ep, sym, example)
        for value in _other_values(example, lo, hi, extra_sizes):
            subs = {**examples, sym: value}
            new_flat = []
            for val, ex in zip(vals, flat):
                if isinstance(val, torch.Tensor) and isinstance(ex, torch.Tensor):
                    shape = [int(sympy.sympify(d.node.expr).subs(subs)) if isinstance(d, torch.SymInt) else int(d) for d in val.shape]
                    new_flat.append(ex if list(ex.shape) == shape else _like(ex, shape, gen))
                else:
                    new_flat.append(ex)
            new_args, new_kwargs = pytree.tree_unflatten(new_flat, spec)
            sets.append(InputSet(f"{sym}={value}", new_args, new_kwargs))
    return sets
