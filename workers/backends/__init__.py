"""The only place that knows which lowering backends exist."""
from __future__ import annotations

import difflib

from workers.backends.base import Backend, LoweringError, Placement
from workers.unit import Target


def _registry() -> dict[str, Backend]:
    from workers.backends.aot_compile import AotCompile
    from workers.backends.aoti_cpu import AotiCpu
    from workers.backends.aoti_cuda import AotiCuda
    from workers.backends.core_aten import CoreAten
    from workers.backends.executorch import ExecuTorch
    from workers.backends.inductor_cache import InductorCache

    return {b.name: b for b in (AotiCpu(), AotiCuda(), InductorCache(), AotCompile(), ExecuTorch(), CoreAten())}


def _gpu_forms() -> dict[str, Backend]:
    """Backends whose targets also name a GPU (`inductor-cache:sm_90`, `:cuda`): that form is its own class."""
    from workers.backends.aot_compile import AotCompileCuda
    from workers.backends.inductor_cache import InductorCacheCuda

    return {b.name: b for b in (InductorCacheCuda(), AotCompileCuda())}


def backend_names() -> list[str]:
    return sorted(_registry())


def get_backend(name: str) -> Backend:
    backends = _registry()
    if name not in backends:
        close = difflib.get_close_matches(name, backends, n=1, cutoff=0.75)
        meant = f" (did you mean {close[0]!r}?)" if close else ""
        raise LoweringError(f"unknown target {name!r}{meant}; known targets: {', '.join(sorted(backends))}")
    return backends[name]


def offered_resources(slots: int) -> dict[str, float]:
    """What this host offers Ray for every backend, with `slots` CPU workers (for `ray start --resources`)."""
    offers: dict[str, float] = {}
    for backend in _registry().values():
        for name, count in backend.offers(slots).items():
            offers[name] = max(offers.get(name, 0.0), count)
    return offers


def resolve(target: Target) -> Backend:
    """The backend for a target, once the target is known to make sense for it."""
    from workers.backends.cuda_target import is_cuda_isa

    backend = get_backend(target.backend)
    if is_cuda_isa(target.isa):
        backend = _gpu_forms().get(target.backend, backend)
    backend.validate(target)
    if target.mode not in backend.modes:
        trains = ", ".join(n for n, b in _registry().items() if target.mode in b.modes)
        raise LoweringError(f"target {target.label}: {target.backend} has no {target.mode} mode; "
                            f"targets that compile a training step: {trains}")
    if target.weights == "shapes" and backend.weights_in_code:
        raise LoweringError(f"target {target.label} bakes weights into its code, so `weights: shapes` cannot apply; "
                            f"use `weights: values`")
    return backend


__all__ = ["Backend", "LoweringError", "Placement", "backend_names", "get_backend", "offered_resources", "resolve"]
