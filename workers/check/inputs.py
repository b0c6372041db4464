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

    def to(self, device: str) -> "InputSet":
        """The same inputs on device (tensors moved, everything else as is)."""
        move = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
        return InputSet(self.label, pytree.tree_map(move, self.args), pytree.tree_map(move, self.kwargs))


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
    """Random values of the example's kind, on its device (drawn on the CPU, where `gen` is, so a
    program moved to a GPU gets the same values as on the CPU)."""
    if example.dtype.is_floating_point or example.dtype.is_complex:
        drawn = torch.randn(shape, dtype=example.dtype, generator=gen)
    elif example.dtype == torch.bool:
        drawn = torch.randint(0, 2, shape, generator=gen).bool()
    else:  # integer inputs are usually indices (token ids): stay within the example's value range
        lo = int(example.min()) if example.numel() else 0
        hi = int(example.max()) if example.numel() else 1
        drawn = torch.randint(lo, hi + 1, shape, dtype=example.dtype, generator=gen)
    return drawn.to(example.device)


def _symbol_examples(ep: ExportedProgram) -> dict[sympy.Symbol, int]:
    """Every dynamic dimension's symbol and its size in the example inputs."""
    flat, _ = pytree.tree_flatten(ep.example_inputs)
    examples: dict[sympy.Symbol, int] = {}
    for val, ex in zip(_user_input_vals(ep), flat):
        if isinstance(val, torch.Tensor) and isinstance(ex, torch.Tensor):
            for dim, size in zip(val.shape, ex.shape):
                if isinstance(dim, torch.SymInt) and isinstance(dim.node.expr, sympy.Symbol):
                    examples[dim.node.expr] = int(size)
    return examples


def inputs_at(ep: ExportedProgram, sizes: dict[sympy.Symbol, int], label: str, gen: torch.Generator) -> InputSet:
    """The example inputs with dynamic dimensions set to `sizes` (others as in the example)."""
    args, kwargs = ep.example_inputs
    flat, spec = pytree.tree_flatten((args, kwargs))
    subs = {**_symbol_examples(ep), **sizes}
    new_flat = []
    for val, ex in zip(_user_input_vals(ep), flat):
        if isinstance(val, torch.Tensor) and isinstance(ex, torch.Tensor):
            shape = [int(sympy.sympify(d.node.expr).subs(subs)) if isinstance(d, torch.SymInt) else int(d) for d in val.shape]
            new_flat.append(ex if list(ex.shape) == shape else _like(ex, shape, gen))
        else:
            new_flat.append(ex)
    new_args, new_kwargs = pytree.tree_unflatten(new_flat, spec)
    return InputSet(label, new_args, new_kwargs)


def dynamic_dims(ep: ExportedProgram) -> dict[str, tuple[sympy.Symbol, int, int | None]]:
    """`<input>.<dim>` → (symbol, lowest, highest or None) for every dynamic dimension of a user input."""
    dims: dict[str, tuple[sympy.Symbol, int, int | None]] = {}
    for name, val in zip(ep.graph_signature.user_inputs, _user_input_vals(ep)):
        if isinstance(val, torch.Tensor):
            for i, d in enumerate(val.shape):
                if isinstance(d, torch.SymInt) and isinstance(d.node.expr, sympy.Symbol):
                    vr = ep.range_constraints.get(d.node.expr)
                    lo = int(vr.lower) if vr is not None and vr.lower.is_finite else 0
                    hi = int(vr.upper) if vr is not None and vr.upper.is_finite else None
                    dims[f"{name}.{i}"] = (d.node.expr, lo, hi)
    return dims


def input_sets(ep: ExportedProgram, extra_sizes: int = 2, seed: int = 0) -> list[InputSet]:
    if ep.example_inputs is None:
        raise ValueError("the program carries no example inputs; export it with torch.export.export(model, args)")
    args, kwargs = ep.example_inputs
    sets = [InputSet("example", args, kwargs)]
    flat, _ = pytree.tree_flatten((args, kwargs))
    if len(_user_input_vals(ep)) != len(flat):
        return sets  # unusual signature (e.g. non-tensor inputs folded away): check at the example only
    examples = _symbol_examples(ep)
    gen = torch.Generator().manual_seed(seed)
    for sym, example in sorted(examples.items(), key=lambda kv: str(kv[0])):
        lo, hi = _bounds(ep, sym, example)
        for value in _other_values(example, lo, hi, extra_sizes):
            sets.append(inputs_at(ep, {sym: value}, f"{sym}={value}", gen))
    return sets


def static_sets(ep: ExportedProgram, sizes: tuple[tuple[str, int], ...]) -> list[InputSet]:
    """An artifact with static shapes is built and checked at these only: the example inputs,
    and for each (`<input>.<dim>`, size) the example with that dimension at that size."""
    dims = dynamic_dims(ep)
    gen = torch.Generator().manual_seed(0)
    return input_sets(ep, 0) + [inputs_at(ep, {dims[where][0]: size}, f"{where}={size}", gen)
                                for where, size in sizes if where in dims]
