"""The plug-in point for lowering targets: one protocol, one file per backend."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from workers.unit import Target

if TYPE_CHECKING:  # torch is the sandbox's: a worker that only plans, keys and places never imports it
    from torch.export import ExportedProgram


class LoweringError(Exception):
    """Lowering, or loading what was lowered, failed in a way the user can act on."""

    def __init__(self, message: str, retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True)
class Placement:
    """What one unit's worker needs from Ray.

    `device_class` is the custom resource that routes the unit (a node offers it once per worker
    slot that can build the target: `farm_cpu_avx2`, `farm_cuda_sm90`); `cpus` and `gpus` are
    Ray's own resources per worker (a fraction of a GPU lets several lowering workers share one)."""
    device_class: str
    cpus: float = 1.0
    gpus: float = 0.0
    unoffered: str = ""  # what to do when no node offers device_class, besides starting one that does
    # device classes whose units a worker of this one can build too (an AVX2 host builds x86-64
    # code), so a job's mix of them needs no worker per class
    covers: tuple[str, ...] = ()
    # those of them a pool worker is placed to take: it holds one of each of their resources too,
    # so it runs only where all are offered (scheduler/pool.py sets it)
    holding: tuple[str, ...] = ()
    # modules its workers' sandbox zygotes import before they fork a child, so that no child pays
    # them in its first unit (a farm service's worker forks one per job): for a class whose workers
    # build only its backend's targets, whose imports then meet no other backend's lowering
    warm_imports: tuple[str, ...] = ()

    @property
    def resources(self) -> dict[str, float]:
        """The custom resources (Ray's `resources=` option)."""
        return {self.device_class: 1.0, **{c: 1.0 for c in self.holding}}


class Backend(Protocol):
    name: str
    # True if the generated code depends on weight values, so `weights: shapes` is impossible.
    weights_in_code: bool
    # Where the program, its example inputs and the artifact run: "cpu" or "cuda".
    device: str
    # What its artifacts serve: ("inference",), or also "train" (forward and backward of a step).
    modes: tuple[str, ...]
    # True if the artifact serves only the sizes it was built for (checked and measured at those only)
    static_shapes: bool

    def validate(self, target: Target) -> None:
        """Raise LoweringError if the target's fields make no sense for this backend."""

    def target_components(self, target: Target) -> dict[str, Any]:
        """What about the target decides the artifact (device class, ISA or SM, flags): goes into the key."""

    def toolchain(self, target: Target) -> dict[str, Any]:
        """The tools besides torch and Python that decide the artifact (compiler, CUDA, Triton): goes into the key."""

    def placement(self, target: Target) -> Placement:
        """What a worker must hold to take this target (routes units to matching nodes)."""

    def offers(self, slots: int) -> dict[str, float]:
        """The custom resources this host offers for this backend's targets, with `slots` workers."""

    def device_fingerprint(self, target: Target) -> dict[str, Any]:
        """What about this worker's device decides kernel timings (autotuning is shared by it)."""

    def host_problem(self, target: Target) -> str | None:
        """Why this host cannot build (or run) for the target, or None."""

    def prepare(self, ep: ExportedProgram, target: Target) -> ExportedProgram:
        """The program as it is lowered, verified and benchmarked (e.g. moved to the GPU)."""

    def lower(self, ep: ExportedProgram, target: Target, workdir: Path) -> Path:
        """Compile ep (as `prepare` gave it) into a single artifact file under workdir and return its path."""

    def load(self, artifact: Path, target: Target, ep: ExportedProgram | None = None) -> Callable[..., Any]:
        """A callable taking the program's (args, kwargs), refusing artifacts this host can't run.
        With `weights: shapes`, ep's weights are the ones it runs with."""

    def describe(self, artifact: Path, target: Target) -> dict[str, Any]:
        """Facts about the artifact for the manifest (format, ISA recorded in it, how to load)."""
