"""The plug-in point for lowering targets: one protocol, one file per backend."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol

from torch.export import ExportedProgram

from workers.unit import Target


class LoweringError(Exception):
    """Lowering, or loading what was lowered, failed in a way the user can act on."""

    def __init__(self, message: str, retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable


class Backend(Protocol):
    name: str
    # True if the generated code depends on weight values, so `weights: shapes` is impossible.
    weights_in_code: bool

    def validate(self, target: Target) -> None:
        """Raise LoweringError if the target's fields make no sense for this backend."""

    def target_components(self, target: Target) -> dict[str, Any]:
        """What about the target decides the artifact (device class, ISA, flags): goes into the key."""

    def placement(self, target: Target) -> dict[str, float]:
        """Custom resources a worker must hold to take this target (routes units to matching nodes)."""

    def device_fingerprint(self, target: Target) -> dict[str, Any]:
        """What about this worker's device decides kernel timings (autotuning is shared by it)."""

    def host_problem(self, target: Target) -> str | None:
        """Why this host cannot build (or run) for the target, or None."""

    def lower(self, ep: ExportedProgram, target: Target, workdir: Path) -> Path:
        """Compile ep into a single artifact file under workdir and return its path."""

    def load(self, artifact: Path, target: Target, ep: ExportedProgram | None = None) -> Callable[..., Any]:
        """A callable taking the program's (args, kwargs), refusing artifacts this host can't run.
        With `weights: shapes`, ep's weights are the ones it runs with."""

    def describe(self, artifact: Path, target: Target) -> dict[str, Any]:
        """Facts about the artifact for the manifest (format, ISA recorded in it, how to load)."""

