"""`core-aten`: the program decomposed to the core ATen opset, saved with torch's export
serializer, for runtimes that consume exported programs rather than compiled code.

Lowering runs `run_decompositions()` with torch's default (core ATen) table. An operator left
outside the core opset (a custom op, or one torch has no decomposition for) fails the unit with
its name: the artifact promises core ATen only. Verification runs the decomposed program
against the original, and the artifact is loaded back the way the farm loads every program
from outside (workers/sandbox/program.py: checked archive, weights-only unpickling).
"""
from __future__ import annotations

import operator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from workers.backends import cpu_isa
from workers.backends.base import LoweringError, Placement
from workers.unit import Target

if TYPE_CHECKING:  # torch is the sandbox child's; the worker that plans and keys never imports it
    from torch.export import ExportedProgram

BASELINE = "x86-64"  # the ISA slot every CPU host offers: the artifact is code-free


def outside_core(ep: ExportedProgram) -> list[str]:
    """The operators of ep that are not core ATen (higher-order and Python operators aside)."""
    import torch

    found = set()
    for node in ep.graph.nodes:
        target = node.target
        if node.op != "call_function" or target is operator.getitem or not isinstance(target, torch._ops.OpOverload):
            continue
        if torch.Tag.core not in target.tags:
            found.add(str(target))
    return sorted(found)


def op_census(ep: ExportedProgram) -> dict[str, int]:
    import torch

    counts: dict[str, int] = {}
    for node in ep.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            counts[str(node.target)] = counts.get(str(node.target), 0) + 1
    return dict(sorted(counts.items()))


class CoreAten:
    name = "core-aten"
    weights_in_code = True  # the saved program carries its weights
    device = "cpu"
    modes = ("inference",)
    static_shapes = False

    def __init__(self) -> None:
        self._lowered: tuple[str, dict[str, int]] | None = None  # the last artifact and its ops, for describe

    def validate(self, target: Target) -> None:
        if target.isa:
            raise LoweringError(f"target {target.label}: core-aten takes no variant; write core-aten")
        if target.options:
            raise LoweringError(f"target {target.label}: core-aten takes no options")

    def target_components(self, target: Target) -> dict[str, Any]:
        return {"backend": self.name, "format": "torch.export", "opset": "core-aten",
                "decompositions": "torch.export.default_decompositions"}

    def toolchain(self, target: Target) -> dict[str, Any]:
        return {}  # torch alone (in every key) decides the decomposition

    def placement(self, target: Target) -> Placement:
        return Placement(cpu_isa.isa_resource(BASELINE))

    def offers(self, slots: int) -> dict[str, float]:
        return {cpu_isa.isa_resource(BASELINE): float(slots)}

    def device_fingerprint(self, target: Target) -> dict[str, Any]:
        return cpu_isa.cpu_fingerprint()

    def host_problem(self, target: Target) -> str | None:
        return None

    def prepare(self, ep: ExportedProgram, target: Target) -> ExportedProgram:
        return ep

    def lower(self, ep: ExportedProgram, target: Target, workdir: Path) -> Path:
        import torch

        core = ep.run_decompositions()
        left = outside_core(core)
        if left:
            raise LoweringError(f"these operators have no decomposition to core ATen, so the program cannot be "
                                f"given as core ATen: {', '.join(left)}")
        out = workdir / "core-aten.pt2"
        torch.export.save(core, str(out))
        self._lowered = (str(out), op_census(core))
        return out

    def load(self, artifact: Path, target: Target, ep: ExportedProgram | None = None) -> Callable[..., Any]:
        from workers.sandbox.program import ProgramError, load_program

        try:
            core = load_program(artifact, f"core-aten artifact {artifact.name}")
        except ProgramError as e:
            raise LoweringError(str(e)) from e
        return core.module()

    def describe(self, artifact: Path, target: Target) -> dict[str, Any]:
        from workers.sandbox.program import load_program

        if self._lowered and self._lowered[0] == str(artifact):  # describe follows lower: no second load
            ops = self._lowered[1]
        else:
            ops = op_census(load_program(artifact, f"core-aten artifact {artifact.name}"))
        return {
            "format": "torch-export-core-aten",
            "ops": ops,
            "load": "torch.export.load(PATH).module()",
        }
