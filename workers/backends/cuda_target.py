"""Everything but lowering and loading, for a backend whose targets are `<name>:sm_XX` (or
`<name>:cuda`, the worker's own GPU): NVIDIA GPUs, built and checked on a GPU of that
architecture (units route by the node's `farm_cuda_sm90` resource, and the worker checks its
GPU before building)."""
from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING, Any

from workers.backends import cuda, cxx
from workers.backends.base import LoweringError, Placement
from workers.torch_files import standalone
from workers.unit import Target

if TYPE_CHECKING:
    from torch.export import ExportedProgram

OWN_GPU = "cuda"  # `<name>:cuda`: the architecture of the worker's own GPU


def is_cuda_isa(isa: str | None) -> bool:
    """Whether a target's `:isa` part names a GPU (`sm_90`, or `cuda` for the worker's own)."""
    return isa == OWN_GPU or bool(isa and cuda.ARCH.fullmatch(isa))


def current_arch() -> str:
    """The architecture of the GPU this process uses (in the sandbox, where CUDA is up already)."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def _triton_version() -> str | None:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


class CudaTarget:
    name: str
    device = "cuda"
    static_shapes = False

    @staticmethod
    def named_arch(target: Target) -> str | None:
        """The SM the target names, or None for the worker's own GPU."""
        return None if target.isa in (None, OWN_GPU) else target.isa

    def arch(self, target: Target) -> str:
        """The SM the artifact is for: the target's, or this worker's GPU's."""
        named = self.named_arch(target)
        if named:
            return named
        try:
            return cuda.own_gpu().arch
        except cuda.GpuUnavailable as e:
            raise LoweringError(f"target {target.label} means the GPU architecture here, and there is none ({e}); "
                                f"name one, e.g. {self.name}:sm_90", retryable=True) from None

    def device_components(self, target: Target) -> dict[str, Any]:
        """What about the device decides the artifact (a backend's key adds its own)."""
        return {"backend": self.name, "device": "cuda", "arch": self.arch(target)}

    def isa_label(self, target: Target) -> str:
        return self.arch(target)

    def isa_pin(self, target: Target) -> tuple[dict[str, Any], str | None]:
        """Inductor settings that pin the ISA, and the one vector ISA Inductor may see: for a GPU
        target, none (the host CPU is not pinned)."""
        return {}, None

    def toolchain(self, target: Target) -> dict[str, Any]:
        # the driver is not here: artifacts hold cubins for the architecture, which any recent driver loads
        return {**cxx.compiler(), "cuda": standalone("version.py").cuda, "triton": _triton_version()}

    def validate(self, target: Target) -> None:
        if target.isa and not is_cuda_isa(target.isa):
            raise LoweringError(f"target {target.label}: {target.isa!r} is not a GPU architecture; "
                                f"write it as sm_XX, e.g. {self.name}:sm_90 for H100")

    def placement(self, target: Target) -> Placement:
        return Placement(cuda.arch_resource(self.named_arch(target)), cpus=1.0, gpus=1.0 / cuda.WORKERS_PER_GPU)

    def offers(self, slots: int) -> dict[str, float]:
        return cuda.host_resources()

    def device_fingerprint(self, target: Target) -> dict[str, Any]:
        try:
            return cuda.own_gpu().fingerprint
        except cuda.GpuUnavailable as e:
            raise LoweringError(f"no GPU to fingerprint ({e})", retryable=True) from None

    def host_problem(self, target: Target) -> str | None:
        try:
            gpu = cuda.own_gpu()
        except cuda.GpuUnavailable as e:
            return f"this worker cannot build {target.label}: {e}"
        named = self.named_arch(target)
        if named and named != gpu.arch:
            return f"this worker's GPU is {gpu.name} ({gpu.arch}), not {named}; {target.label} is built on a {named} GPU"
        return cxx.libstdcxx_problem()

    def load_problem(self, target: Target) -> str | None:  # before a CPU form's, for the GPU forms of CPU backends
        return self.host_problem(target)

    def prepare(self, ep: ExportedProgram, target: Target) -> ExportedProgram:
        from torch.export.passes import move_to_device_pass

        return move_to_device_pass(ep, "cuda")
