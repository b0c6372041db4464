"""Using what the farm built, from Python (after `farm fetch KEY model.pt2`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from torch.export import ExportedProgram


def load_compiled(artifact: str | Path, weights_from: ExportedProgram | str | Path | None = None) -> Callable[..., Any]:
    """Load an `aoti-cpu` package. For a package built with `weights: shapes`, `weights_from`
    (an exported program, or the .pt2 it was saved to) supplies the checkpoint it runs with;
    without it the package runs with the weights it was built with."""
    import torch

    from workers.backends.aoti_cpu import load_with_weights, program_constants
    from workers.program import load_program

    if weights_from is None:
        return torch._inductor.aoti_load_package(str(artifact))
    ep = weights_from if isinstance(weights_from, ExportedProgram) else load_program(Path(weights_from), str(weights_from))
    return load_with_weights(Path(artifact), program_constants(ep))
