"""Pinning Inductor's CPU code to an x86 ISA, shared by every CPU backend.

Inductor defaults to `-march=native` and to the widest vector ISA of the build host; we pin
both (`cpp.march`, `cpp.simdlen`) and also narrow Inductor's list of vector ISAs to the one
named, because on a host with AMX `simdlen=512` alone would pick AMX over plain AVX-512.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

from workers.backends import cxx
from workers.backends.base import LoweringError, Placement
from workers.backends.inductor_host import can_pin as _can_pin
from workers.backends.inductor_host import ISA_EXTRAS, cpu_model, inductor_host, inductor_host_known
from workers.unit import Target

if TYPE_CHECKING:
    from torch.export import ExportedProgram


@dataclass(frozen=True)
class Isa:
    march: str
    simdlen: int
    vec_isa: str  # Inductor's name of the vector ISA ("" for scalar code)
    recorded: str  # what an AOTInductor package's AOTI_CPU_ISA then says

    @property
    def inductor_configs(self) -> dict[str, Any]:
        # Left alone, Inductor compiles the worker's thread count into every CPU kernel and into
        # its cache keys (`cpp_runtime_thread_count`): a consumer with another core count, or a
        # jailed child that sees no /sys, then misses every entry of a bundle, and an AOTInductor
        # package from a 2-core worker runs on 2 threads of a 64-core host. `dynamic_threads`
        # makes the kernels ask OpenMP at run time instead.
        return {"cpp.march": self.march, "cpp.simdlen": self.simdlen, "cpp.dynamic_threads": True}


ISAS = {
    "x86-64": Isa("x86-64", 0, "", "INVALID_VEC_ISA"),
    "avx2": Isa("x86-64-v3", 256, "avx2", "AVX2"),
    "avx512": Isa("x86-64-v4", 512, "avx512", "AVX512"),
}
DEFAULT_ISA = "avx2"


def _cpu_vec_isa():
    """Inductor's module, imported when first needed: importing Inductor imports Dynamo (over a
    second of CPU), which a worker naming keys, or a gang rank waiting on another, never needs."""
    from torch._inductor import cpu_vec_isa

    return cpu_vec_isa


def host_vec_isas() -> set[str]:
    """Inductor's vector ISAs on this host (asked once per host: workers/backends/inductor_host.py)."""
    return set(inductor_host()["vec_isas"])


@functools.cache
def _recorded_vec_isas() -> frozenset[str] | None:
    """The host record's vector ISAs, read once per process (a file lock and a read, 0.2 ms, and
    Pin.held asks at every compiled call); None where the host had no record then, and Inductor's
    own check, which Inductor caches, answers instead."""
    known = inductor_host_known()
    return None if known is None else frozenset(known["vec_isas"])


def _one_vec_isa(name: str, probe: bool = True) -> list[Any]:
    """[Inductor's ISA `name`] if this host can build and run it, else []: from the host's record
    where it has one, else Inductor's own check (CPU flags, then a probe build loaded in a fresh
    Python) for that one ISA. Its check of every ISA costs a fresh machine ~10 g++ builds (8 s
    here) before a pinned model's first step. Without `probe`, the CPU's flags alone answer: what
    a process that loads code built elsewhere needs to know (it runs here), without the probe's
    build and fresh Python (0.9 s of a warm_start here); were it to compile after all, g++ would say what it lacks."""
    cpu_vec_isa = _cpu_vec_isa()
    known = _recorded_vec_isas()
    if known is not None:
        return [i for i in cpu_vec_isa.supported_vec_isa_list if str(i) == name and name in known]
    flags = _cpu_flags()
    return [i for i in cpu_vec_isa.supported_vec_isa_list
            if str(i) == name and all(f in flags for f in name.split()) and (not probe or i)]


def _pinned(name: str, probe: bool = True) -> list[Any]:
    """_one_vec_isa(name), to compile with: a pinned ISA builds with its own flags alone, on any
    host; with a host's extras (avx512_bf16 on a Sapphire Rapids), its kernels would not run on
    every host of the class it names."""
    return _with_extras(_one_vec_isa(name, probe), {})


@functools.cache
def _cpu_flags() -> tuple[str, ...]:
    """The vector ISAs this CPU runs, by its flags (Inductor's reading of them; asked once per process)."""
    return tuple(_cpu_vec_isa().x86_isa_checker())


def _kept_record() -> dict[str, Any] | None:
    """The host's record if it has one; else, where torch is imported already (a sandbox, a
    training process), None: ask Inductor here about only what is needed; else the record, asked."""
    known = inductor_host_known()
    if known is None and "torch" not in sys.modules:
        return inductor_host()
    return known


def host_runs(vec_isa: str, probe: bool = True) -> bool:
    """Whether this host builds and runs `vec_isa` (without a record: Inductor's check of that ISA
    alone; without `probe`, whether it runs it, by the CPU's flags)."""
    record = _kept_record()
    return bool(_one_vec_isa(vec_isa, probe)) if record is None else vec_isa in record["vec_isas"]


def _inductor_sees(chosen: list[Any]) -> contextlib.AbstractContextManager[None]:
    """Inductor's list of this host's vector ISAs is `chosen` inside (its own is checked and kept
    once per process, so it is replaced, not re-asked)."""
    return _inductor_asks(lambda: chosen)


def only_vec_isa(name: str, probe: bool = True) -> contextlib.AbstractContextManager[None]:
    """Make Inductor see exactly one vector ISA while it compiles (one compile per process); with
    probe=False, for loading what was built elsewhere (see _one_vec_isa)."""
    return _inductor_sees(_pinned(name, probe) if name else [])


def vec_isas_from_host_record() -> contextlib.AbstractContextManager[None]:
    """Inductor's list of this host's vector ISAs from the host's record (asked of Inductor once
    per host: workers/backends/inductor_host.py) instead of its own check, which loads a probe
    per ISA in a fresh Python in every process: 0.9 CPU-s and 1 s here, a third of a process
    that hits every graph."""
    return _inductor_sees(_host_vec_isa_list())


def _host_vec_isa_list() -> list[Any]:
    record = inductor_host()
    chosen = [i for i in _cpu_vec_isa().supported_vec_isa_list if str(i) in record["vec_isas"]]  # Inductor's order
    return _with_extras(chosen, record["vec_isa_extras"])


def _with_extras(isas: list[Any], extras: dict[str, dict[str, bool]]) -> list[Any]:
    """`isas` (Inductor's ISA objects), each with what Inductor found out about it beyond its name
    set as `extras` says (by the ISA's name; what it does not name is off), as Inductor's own check
    would have left them: they decide its build flags (inductor_host.py, ISA_EXTRAS)."""
    for isa in isas:
        for name in ISA_EXTRAS:
            if hasattr(isa, name):
                setattr(isa, name, extras.get(str(isa), {}).get(name, False))
                getter = getattr(type(isa), name.lstrip("_"), None)  # is_avx512_bf16_supported, which Inductor caches
                if callable(getattr(getter, "cache_clear", None)):
                    getter.cache_clear()
    return isas


def vec_isas_when_asked(vec_isa: str | None, within: Callable[[], contextlib.AbstractContextManager[None]],
                        ) -> contextlib.AbstractContextManager[None]:
    """As vec_isas_from_host_record (vec_isa None) or only_vec_isa(vec_isa), for a process that
    may never compile for a CPU (use_farm_cache in a training script on a GPU): worked out only
    once Inductor first asks, inside `within()` (use_farm_cache installs the probes the farm has
    as it enters). A process whose graphs all run on a GPU never builds or loads a probe."""
    def answer() -> list[Any]:
        with within():
            if vec_isa is None:
                return _host_vec_isa_list()
            return _pinned(vec_isa) if vec_isa else []

    return _inductor_asks(answer)


@contextlib.contextmanager
def _inductor_asks(answer: Callable[[], list[Any]]) -> Iterator[None]:
    """Inductor's list of this host's vector ISAs is answer()'s inside, asked once, as Inductor
    first wants it. Threads that ask meanwhile wait for it; answer() itself asking (the host's
    record is Inductor's own check, kept) gets Inductor's own list."""
    cpu_vec_isa = _cpu_vec_isa()
    original = cpu_vec_isa.valid_vec_isa_list
    lock, known, answering = threading.RLock(), [], []

    def asked() -> list[Any]:
        with lock:
            if answering:  # answer() asking, on this thread (the lock is ours)
                return original()
            if not known:
                answering.append(True)
                try:
                    known.append(answer())
                finally:
                    answering.clear()
            return known[0]

    cpu_vec_isa.valid_vec_isa_list = asked  # type: ignore[assignment]
    try:
        yield
    finally:
        cpu_vec_isa.valid_vec_isa_list = original  # type: ignore[assignment]


def cpu_fingerprint() -> dict[str, Any]:
    """What about this host's CPU decides how fast code runs on it (benchmarks are recorded with it)."""
    return {"device": "cpu", "cpu_model": cpu_model(), "vec_isas": sorted(host_vec_isas())}


def isa_resource(isa: str) -> str:
    """The Ray custom resource a node offers for each CPU slot that can build this ISA."""
    return "farm_cpu_" + isa.replace("-", "_")


def host_resources(slots: int) -> dict[str, float]:
    """What this host offers: every ISA it can build and run, `slots` each."""
    missing = cxx.compiler_problem()
    if missing:  # Inductor's probes would build nothing: a node without a compiler builds no CPU code
        raise LoweringError(missing)
    have = host_vec_isas()
    return {isa_resource(name): float(slots) for name, isa in ISAS.items() if not isa.vec_isa or isa.vec_isa in have}


def can_pin() -> bool:
    """Whether this torch's Inductor can pin the ISA at all (`cpp.march` is newer than torch 2.11)."""
    record = _kept_record()
    return _can_pin() if record is None else record["can_pin"]


class PinnedCpuTarget:
    """Everything but lowering and loading, for a backend whose targets are `<name>[:isa]` on x86 CPUs."""

    name: str
    device = "cpu"
    modes: tuple[str, ...] = ("inference",)
    static_shapes = False

    def isa(self, target: Target) -> tuple[str, Isa]:
        name = target.isa or DEFAULT_ISA
        if name not in ISAS:
            raise LoweringError(f"target {target.label}: unknown ISA {name!r}; choose one of {', '.join(ISAS)}")
        return name, ISAS[name]

    def validate(self, target: Target) -> None:
        self.isa(target)

    def device_components(self, target: Target) -> dict[str, Any]:
        """What about the device decides the artifact (a backend's key adds its own)."""
        name, isa = self.isa(target)
        return {"backend": self.name, "device": "cpu", "isa": name, "march": isa.march, "simdlen": isa.simdlen,
                "threads": "at run time"}

    def target_components(self, target: Target) -> dict[str, Any]:
        return self.device_components(target)

    def isa_label(self, target: Target) -> str:
        return self.isa(target)[0]

    def isa_pin(self, target: Target) -> tuple[dict[str, Any], str | None]:
        """Inductor settings that pin the ISA, and the one vector ISA Inductor may see."""
        isa = self.isa(target)[1]
        return isa.inductor_configs, isa.vec_isa

    def toolchain(self, target: Target) -> dict[str, Any]:
        return cxx.compiler()

    def placement(self, target: Target) -> Placement:
        name, isa = self.isa(target)
        below = [other for other, o in ISAS.items() if o.simdlen < isa.simdlen]  # x86-64 < avx2 < avx512
        return Placement(isa_resource(name), covers=tuple(isa_resource(other) for other in below))

    def offers(self, slots: int) -> dict[str, float]:
        return host_resources(slots)

    def prepare(self, ep: ExportedProgram, target: Target) -> ExportedProgram:
        return ep

    def device_fingerprint(self, target: Target) -> dict[str, Any]:
        return {**cpu_fingerprint(), "isa": self.isa(target)[0]}

    def host_problem(self, target: Target, probe: bool = True) -> str | None:
        name, isa = self.isa(target)
        missing = cxx.compiler_problem()
        if missing:
            return missing
        if isa.vec_isa and not host_runs(isa.vec_isa, probe):
            have = host_vec_isas()
            return f"this host cannot build or run {name} code (it has: {', '.join(sorted(have)) or 'no vector ISA'})"
        if not can_pin():
            return (f"torch {importlib.metadata.version('torch')} cannot pin Inductor's CPU ISA (it has no cpp.march setting), so "
                    f"{self.name} would build for this host's CPU only; CPU targets need torch 2.13")
        return cxx.libstdcxx_problem()

    def load_problem(self, target: Target) -> str | None:
        """Why this process cannot load what a worker built for the target: host_problem, with the
        CPU's flags saying whether it runs the ISA (a loader builds nothing: see _one_vec_isa)."""
        return self.host_problem(target, probe=False)
