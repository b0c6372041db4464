"""A training step, checked and measured: outputs and gradients against the program run eagerly.

The loss weighs every output element by a fixed random number (a plain `.sum()` sends the same
gradient into every element, which hides a transposed or permuted gradient), and gradients are
taken with `torch.autograd.grad`, so two modules sharing parameter tensors never see each
other's `.grad`.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from workers.check.inputs import InputSet
from workers.check.verify import VerifyReport, compare


def _trainable_outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]


def loss(out: Any) -> torch.Tensor:
    """A scalar to train on: every output that carries a gradient, each element weighed by a
    number fixed by the output's shape (the same in the eager and compiled runs)."""
    outs = _trainable_outputs(out)
    if not outs:
        raise ValueError("no output of the program depends on a parameter or an input that requires grad; "
                         "there is nothing to train")
    total = torch.zeros((), dtype=torch.float64)
    for t in outs:
        total = total + (t * _weight(tuple(t.shape), t.dtype, t.device)).sum().double().cpu()
    return total


@functools.lru_cache(maxsize=64)
def _weight(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The loss's weights for an output of this shape: made once, not in every timed step."""
    gen = torch.Generator().manual_seed(math.prod(shape))
    return torch.rand(shape, generator=gen, dtype=torch.float64).to(device, dtype)


def step(module: Callable) -> Callable[..., None]:
    """One training step's forward and backward (what a benchmark times)."""
    def run(*args: Any, **kwargs: Any) -> None:
        loss(module(*args, **kwargs)).backward()

    return run


def _draws(node: torch.fx.Node) -> bool:
    """Whether a call to an op tagged as random really draws: attention and dropout with a
    probability of 0, or dropout outside training, draw nothing."""
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return True
    given = {a.name: node.args[i] if i < len(node.args) else node.kwargs.get(a.name, a.default_value)
             for i, a in enumerate(schema.arguments)}
    if given.get("train") is False or given.get("dropout_p", 1) == 0:
        return False
    return not ("dropout" in schema.name and given.get("p") == 0)


def random_ops(ep: ExportedProgram) -> list[str]:
    """The program's ops that draw random numbers (dropout and the like)."""
    return sorted({str(n.target) for n in ep.graph.nodes if n.op == "call_function" and _draws(n)})


def undifferentiable_collectives(ep: ExportedProgram) -> list[str]:
    """The program's functional collectives that autograd has no formula for (torch 2.13:
    `broadcast`). Autograd backpropagates through such an op as if it were the identity, with
    only a warning, so a training step through one would train on wrong gradients."""
    found = set()
    for n in ep.graph.nodes:
        op = n.target
        if n.op == "call_function" and isinstance(op, torch._ops.OpOverload) and op.namespace == "_c10d_functional":
            name = op._schema.name
            if not any(torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
                       for key in ("Autograd", "CompositeImplicitAutograd")):
                found.add(str(op))
    return sorted(found)


def _grads(module: Any, s: InputSet, seed: int | None) -> tuple[Any, list[tuple[str, torch.Tensor | None]]]:
    if seed is not None:
        torch.manual_seed(seed)
    named = [(f"grad of {n}", p) for n, p in module.named_parameters() if p.requires_grad]
    named += [(f"grad of input {i}", t) for i, t in enumerate(pytree.tree_leaves((s.args, s.kwargs)))
              if isinstance(t, torch.Tensor) and t.requires_grad]
    out = module(*s.args, **s.kwargs)
    grads = torch.autograd.grad(loss(out), [t for _, t in named], allow_unused=True)
    return out, [(name, g) for (name, _), g in zip(named, grads)]


def verify_training(eager: Any, compiled: Any, inputs: list[InputSet], atol: float, rtol: float,
                    seeded: bool = False) -> VerifyReport:
    """Outputs, then every parameter's gradient (and the inputs' that require grad), compiled
    against eager, on each input set. `seeded`: the program draws random numbers, and the
    compiled side draws them as eager does (Inductor's fallback_random), so both runs start
    from the same seed."""
    report = VerifyReport(ok=True, max_abs_err=0.0, max_rel_err=0.0)
    seed = 0 if seeded else None
    with torch.enable_grad():
        for s in inputs:
            want_out, want = _grads(eager, s, seed)
            try:
                got_out, got = _grads(compiled, s, seed)
            except Exception as e:  # the artifact rejected a size inside the declared range
                report.problems.append(f"{s.label}: compiled training step raised {type(e).__name__}: {e}")
                continue
            compare(want_out, got_out, atol, rtol, s.label, report)
            for (name, w), (_, g) in zip(want, got):
                if (w is None) != (g is None):
                    report.problems.append(f"{s.label}: {name} is {'missing' if g is None else 'extra'} in the compiled step")
                elif w is not None:
                    compare(w, g, atol, rtol, f"{s.label}, {name}", report)
            report.checked.append(s.label)
    report.ok = not report.problems
    return report


def saved_for_backward(out: Any, params: list[torch.Tensor]) -> dict[str, int]:
    """What the compiled forward kept for the backward (AOTAutograd's choice), found on the
    autograd graph from `out`: tensors and bytes, the parameters it keeps left out (they are in
    memory anyway). That is the activation memory a user plans for at this size."""
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    seen_nodes: set[int] = set()
    storages: dict[int, int] = {}
    tensors = 0
    todo = [t.grad_fn for t in _trainable_outputs(out) if t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if "CompiledFunction" in type(node).__name__:
            for t in getattr(node, "saved_tensors", ()):
                ptr = t.untyped_storage().data_ptr()
                if ptr not in param_storages:
                    tensors += 1
                    storages[ptr] = t.untyped_storage().nbytes()
        todo.extend(n for n, _ in node.next_functions if n is not None)
    return {"tensors": tensors, "bytes": sum(storages.values())}
