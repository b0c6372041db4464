"""The only place that knows which lowering backends exist."""
from __future__ import annotations

from workers.backends.base import Backend, LoweringError
from workers.unit import Target


def _registry() -> dict[str, Backend]:
    from workers.backends.aoti_cpu import AotiCpu
    from workers.backends.inductor_cache import InductorCache

    return {b.name: b for b in (AotiCpu(), InductorCache())}


def backend_names() -> list[str]:
    return sorted(_registry())


def get_backend(name: str) -> Backend:
    backends = _registry()
    if name not in backends:
        raise LoweringError(f"unknown target {name!r}; known targets: {', '.join(sorted(backends))}")
    return backends[name]


def resolve(target: Target) -> Backend:
    """The backend for a target, once the target is known to make sense for it."""
    backend = get_backend(target.backend)
    backend.validate(target)
    if target.weights == "shapes" and backend.weights_in_code:
        raise LoweringError(f"target {target.label} bakes weights into its code, so `weights: shapes` cannot apply; "
                            f"use `weights: values`")
    return backend


__all__ = ["Backend", "LoweringError", "backend_names", "get_backend", "resolve"]
