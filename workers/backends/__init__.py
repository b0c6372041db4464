"""The only place that knows which lowering backends exist."""
from __future__ import annotations

from workers.backends.base import Backend, LoweringError


def _registry() -> dict[str, Backend]:
    from workers.backends.aoti_cpu import AotiCpu

    return {b.name: b for b in (AotiCpu(),)}


def backend_names() -> list[str]:
    return sorted(_registry())


def get_backend(name: str) -> Backend:
    backends = _registry()
    if name not in backends:
        raise LoweringError(f"unknown target {name!r}; known targets: {', '.join(sorted(backends))}")
    return backends[name]


__all__ = ["Backend", "LoweringError", "backend_names", "get_backend"]
