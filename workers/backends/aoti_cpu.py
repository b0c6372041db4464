"""AOTInductor for CPU, pinned to an x86 ISA so the package runs on every host of that ISA.

Inductor defaults to `-march=native` and to the widest vector ISA of the build host; we pin
both (`cpp.march`, `cpp.simdlen`) and also narrow Inductor's list of vector ISAs to the one
named, because on a host with AMX `simdlen=512` alone would pick AMX over plain AVX-512.
The package records its ISA (AOTI_CPU_ISA); at load a mismatch is only a warning in torch,
so `load` enforces it.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch._inductor import cpu_vec_isa
from torch.export import ExportedProgram

from workers.backends.base import LoweringError
from workers.unit import Target


@dataclass(frozen=True)
class Isa:
    march: str
    simdlen: int
    vec_isa: str  # Inductor's name of the vector ISA ("" for scalar code)
    recorded: str  # what the package's AOTI_CPU_ISA then says


ISAS = {
    "x86-64": Isa("x86-64", 0, "", "INVALID_VEC_ISA"),
    "avx2": Isa("x86-64-v3", 256, "avx2", "AVX2"),
    "avx512": Isa("x86-64-v4", 512, "avx512", "AVX512"),
}
DEFAULT_ISA = "avx2"


def host_vec_isas() -> set[str]:
    return {str(i) for i in cpu_vec_isa.valid_vec_isa_list()}


@contextlib.contextmanager
def _only_vec_isa(name: str) -> Iterator[None]:
    """Make Inductor see exactly one vector ISA while it lowers (one compile per process)."""
    original = cpu_vec_isa.valid_vec_isa_list
    chosen = [i for i in original() if str(i) == name]
    cpu_vec_isa.valid_vec_isa_list = lambda: chosen  # type: ignore[assignment]
    try:
        yield
    finally:
        cpu_vec_isa.valid_vec_isa_list = original  # type: ignore[assignment]


def isa_resource(isa: str) -> str:
    """The Ray custom resource a node offers for each CPU slot that can build this ISA."""
    return "farm_cpu_" + isa.replace("-", "_")


def host_resources(slots: int) -> dict[str, float]:
    """What this host offers: every ISA it can build and run, `slots` each."""
    have = host_vec_isas()
    return {isa_resource(name): float(slots) for name, isa in ISAS.items() if not isa.vec_isa or isa.vec_isa in have}


def package_metadata(artifact: Path) -> dict[str, str]:
    return dict(torch._C._aoti.AOTIModelPackageLoader.load_metadata_from_package(str(artifact), "model"))


class AotiCpu:
    name = "aoti-cpu"
    weights_in_code = False  # weights are packaged beside the .so (still part of the key by value)

    def _isa(self, target: Target) -> tuple[str, Isa]:
        name = target.isa or DEFAULT_ISA
        if name not in ISAS:
            raise LoweringError(f"target {target.label}: unknown ISA {name!r}; choose one of {', '.join(ISAS)}")
        return name, ISAS[name]

    def validate(self, target: Target) -> None:
        self._isa(target)

    def target_components(self, target: Target) -> dict[str, Any]:
        name, isa = self._isa(target)
        return {"backend": self.name, "device": "cpu", "isa": name, "march": isa.march, "simdlen": isa.simdlen}

    def placement(self, target: Target) -> dict[str, float]:
        return {isa_resource(self._isa(target)[0]): 1}

    def host_problem(self, target: Target) -> str | None:
        name, isa = self._isa(target)
        if isa.vec_isa and isa.vec_isa not in host_vec_isas():
            return f"this host cannot build or run {name} code (it has: {', '.join(sorted(host_vec_isas())) or 'no vector ISA'})"
        return None

    def lower(self, ep: ExportedProgram, target: Target, workdir: Path) -> Path:
        name, isa = self._isa(target)
        configs = {**target.options_dict, "cpp.march": isa.march, "cpp.simdlen": isa.simdlen}
        out = workdir / "artifact.pt2"
        with _only_vec_isa(isa.vec_isa):
            path = torch._inductor.aoti_compile_and_package(ep, package_path=str(out), inductor_configs=configs)
        recorded = package_metadata(Path(path)).get("AOTI_CPU_ISA", "")
        if recorded != isa.recorded:
            raise LoweringError(f"asked for {name} but the package records ISA {recorded!r}; not publishing it")
        return Path(path)

    def load(self, artifact: Path, target: Target) -> Callable[..., Any]:
        recorded = package_metadata(artifact).get("AOTI_CPU_ISA", "")
        needed = next((i for i in ISAS.values() if i.recorded == recorded), None)
        if needed is None:
            raise LoweringError(f"{artifact} records an unknown CPU ISA {recorded!r}")
        if needed.vec_isa and needed.vec_isa not in host_vec_isas():
            raise LoweringError(f"{artifact} needs {recorded}, which this host lacks; fetch the build for a lower ISA", retryable=True)
        return torch._inductor.aoti_load_package(str(artifact))

    def describe(self, artifact: Path) -> dict[str, Any]:
        meta = package_metadata(artifact)
        return {
            "format": "aoti-package",
            "isa": meta.get("AOTI_CPU_ISA"),
            "device": meta.get("AOTI_DEVICE_KEY"),
            "load": "torch._inductor.aoti_load_package(PATH)",
        }
