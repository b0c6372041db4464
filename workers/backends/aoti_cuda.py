"""AOTInductor for NVIDIA GPUs: `aoti-cuda[:sm_XX]`.

The program is moved to the GPU with torch's `move_to_device_pass` and lowered where a GPU is
visible (Inductor compiles Triton kernels for the device it sees, so an `sm_90` target is built
on an sm_90 GPU: units route by the node's `farm_cuda_sm90` resource, and the worker checks its
GPU before building). The package carries each kernel as a cubin for that architecture, so
loading it on such a GPU JIT-compiles nothing; loading it on another architecture is refused.

The C++ wrapper runs on the host CPU: it is pinned to x86-64-v3 where Inductor can pin it
(`cpp.march`), else it is built for the build host's CPU and the key says so.
"""
from __future__ import annotations

import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from workers.backends import cpu_isa
from workers.backends.aoti_cpu import (
    WEIGHTS_OUT_OF_CODE,
    compile_and_package,
    load_package,
    package_metadata,
    weights_facts,
)
from workers.backends.base import LoweringError
from workers.backends.cuda_target import CudaTarget, current_arch
from workers.unit import Target

if TYPE_CHECKING:  # torch is the sandbox child's; the worker that plans and keys never imports it
    from torch.export import ExportedProgram

WRAPPER_ISA = "avx2"  # what the wrapper's host code may use when it can be pinned


def _kernels(artifact: Path) -> list[str]:
    with zipfile.ZipFile(artifact) as z:
        return [n for n in z.namelist() if n.endswith((".cubin", ".fatbin"))]


class AotiCuda(CudaTarget):
    name = "aoti-cuda"
    weights_in_code = False  # as aoti-cpu: `weights: shapes` keeps them out of the code
    modes = ("inference",)

    def _wrapper(self) -> tuple[str, dict[str, Any]]:
        if cpu_isa.can_pin():
            return WRAPPER_ISA, cpu_isa.ISAS[WRAPPER_ISA].inductor_configs
        return "native:" + ",".join(sorted(cpu_isa.host_vec_isas())), {}

    def target_components(self, target: Target) -> dict[str, Any]:
        return {**self.device_components(target), "wrapper_isa": self._wrapper()[0]}

    def lower(self, ep: ExportedProgram, target: Target, workdir: Path) -> Path:
        arch = self.named_arch(target) or current_arch()
        configs = {**target.options_dict, **self._wrapper()[1]}
        if target.weights == "shapes":
            configs.update(WEIGHTS_OUT_OF_CODE)
        path = compile_and_package(ep, workdir, configs)
        recorded = package_metadata(path).get("AOTI_COMPUTE_CAPABILITY", "")
        if f"sm_{recorded}" != arch:
            raise LoweringError(f"asked for {arch} but the package records compute capability {recorded!r}; not publishing it")
        if not _kernels(path) and not configs.get("aot_inductor.embed_kernel_binary"):
            raise LoweringError("the package holds no compiled GPU kernels (.cubin); it would compile them when loaded")
        return path

    def load(self, artifact: Path, target: Target, ep: ExportedProgram | None = None) -> Callable[..., Any]:
        recorded, here = "sm_" + package_metadata(artifact).get("AOTI_COMPUTE_CAPABILITY", "?"), current_arch()
        if recorded != here:
            raise LoweringError(f"{artifact} holds {recorded} kernels and this GPU is {here}; "
                                f"fetch the build for this GPU", retryable=True)
        return load_package(artifact, target, ep)

    def describe(self, artifact: Path, target: Target) -> dict[str, Any]:
        meta = package_metadata(artifact)
        return {
            "format": "aoti-package",
            "device": "cuda",
            "arch": "sm_" + meta.get("AOTI_COMPUTE_CAPABILITY", "?"),
            "wrapper_isa": meta.get("AOTI_CPU_ISA"),
            "kernels": len(_kernels(artifact)),
            "load": "torch._inductor.aoti_load_package(PATH)  # on a GPU of this arch; inputs on cuda",
            **weights_facts(target),
        }
