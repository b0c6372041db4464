"""Static specializations: the program re-exported with one dynamic dimension fixed at a hot
size (every other dynamic dimension stays dynamic), so Inductor can compile code for exactly
that size. The dynamic artifact stays the fallback for every other size."""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.export import Dim, ExportedProgram

from workers.check.inputs import _like, dynamic_dims


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
    return reexport(ep, dynamic={w: (lo, hi) for w, (sym, lo, hi) in dims.items() if sym != fixed},
                    sizes={w: size for w, (sym, _, _) in dims.items() if sym == fixed})


def reexport(ep: ExportedProgram, dynamic: dict[str, tuple[int, int | None]], sizes: dict[str, int]) -> ExportedProgram:
    """The program exported again from its own module, with exactly the dimensions in `dynamic`
    (`<input>.<dim>` → range) dynamic, and example inputs of `sizes` (others as in its example).
    Dimensions that shared a symbol keep sharing one."""
    args, kwargs = ep.example_inputs
    if kwargs:
        raise ValueError("re-exporting a program with keyword inputs is not supported; export it with positional inputs")
    symbols = {where: sym for where, (sym, _, _) in dynamic_dims(ep).items()}
    made: dict[object, Dim] = {}
    gen = torch.Generator().manual_seed(0)
    flat, structure = pytree.tree_flatten(args)
    new_flat, shapes = [], []
    for name, example in zip(ep.graph_signature.user_inputs, flat):
        if not isinstance(example, torch.Tensor):
            new_flat.append(example)
            shapes.append(None)
            continue
        shape = [sizes.get(f"{name}.{i}", n) for i, n in enumerate(example.shape)]
        new_flat.append(example if list(example.shape) == shape else _like(example, shape, gen))
        spec = {}
        for i in range(example.dim()):
            where = f"{name}.{i}"
            if where in dynamic:
                lo, hi = dynamic[where]
                shared = symbols.get(where, where)
                if shared not in made:
                    made[shared] = Dim(f"d{len(made)}", min=max(lo, 0), **({"max": hi} if hi is not None else {}))
                spec[i] = made[shared]
        shapes.append(spec or None)
    new_args = pytree.tree_unflatten(new_flat, structure)
    dynamic_shapes = pytree.tree_unflatten(shapes, structure) if made else None
    return torch.export.export(ep.module(), tuple(new_args), dynamic_shapes=dynamic_shapes)
