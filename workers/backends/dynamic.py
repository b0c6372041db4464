"""Marking a program's inputs dynamic before torch.compile sees them: shared by the inference
cache bundle (inductor_cache.py) and the training bundle (train_bundle.py), which neither
imports the other for it."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.export import ExportedProgram


def mark_dynamic(ep: ExportedProgram, args: tuple, marks: tuple[str, ...]) -> None:
    """A gang's agreement: these `<input>.<dim>`s are dynamic from the first call on every rank,
    instead of each rank's automatic-dynamic deciding on the sizes it happened to see (maybe_:
    a dimension the graph specializes stays static, on every rank alike)."""
    import torch

    for name, value in zip(ep.graph_signature.user_inputs, torch.utils._pytree.tree_leaves(args)):
        if isinstance(value, torch.Tensor):
            for i in range(value.dim()):
                if f"{name}.{i}" in marks:
                    torch._dynamo.maybe_mark_dynamic(value, i)
