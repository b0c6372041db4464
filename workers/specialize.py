"""Static specializations: the program re-exported with one dynamic dimension fixed at a hot
size (every other dynamic dimension stays dynamic), so Inductor can compile code for exactly
that size. The dynamic artifact stays the fallback for every other size."""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.export import Dim, ExportedProgram

from workers.inputs import _user_input_vals, dynamic_dims, inputs_at


def specialization_problems(ep: ExportedProgram, where: str, sizes: list[int]) -> list[str]:
    """Why sizes cannot be specializations of the dimension `<input>.<dim>` (empty if they can)."""
    dims = dynamic_dims(ep)
    if where not in dims:
        return [f"{where} is not a dynamic dimension of this program (dynamic: {', '.join(dims) or 'none'})"]
    _, lo, hi = dims[where]
    return [f"{where}={size} is outside the dimension's range [{lo}, {hi if hi is not None else 'inf'}]"
            for size in sizes if size < lo or (hi is not None and size > hi)]


def specialize(ep: ExportedProgram, where: str, size: int) -> ExportedProgram:
    problems = specialization_problems(ep, where, [size])
    if problems:
        raise ValueError("; ".join(problems))
    dims = dynamic_dims(ep)
    fixed = dims[where][0]
    example = inputs_at(ep, {fixed: size}, f"{where}={size}", torch.Generator().manual_seed(0))
    others = {sym: Dim(f"d_{sym}", min=max(lo, 0), max=hi) for sym, lo, hi in dims.values() if sym != fixed}
    shapes = []
    for val in _user_input_vals(ep):
        spec = {}
        if isinstance(val, torch.Tensor):
            for i, d in enumerate(val.shape):
                if isinstance(d, torch.SymInt) and d.node.expr in others:
                    spec[i] = others[d.node.expr]
        shapes.append(spec or None)
    if example.kwargs:
        raise ValueError("specializing a program with keyword inputs is not supported; export it with positional inputs")
    dynamic = pytree.tree_unflatten(shapes, pytree.tree_structure(example.args)) if others else None
    return torch.export.export(ep.module(), example.args, dynamic_shapes=dynamic)
