"""Autotuning a target over a candidate space: which candidates exist, and which one wins.

Pure logic (no torch): the job spec validates spaces with it when the job loads, and the
scheduler decides with it once every candidate of a unit has been measured. Each candidate
is an ordinary unit (its own key, so it is compiled once and cached like any other); the
decision only reads their measurements.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# Inductor configuration variants a CPU target can be tuned over, by name.
CPU_PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "max_autotune": {"max_autotune": True},
    "freezing": {"freezing": True},
    "max_autotune_freezing": {"max_autotune": True, "freezing": True},
    "coordinate_descent_tuning": {"coordinate_descent_tuning": True},
    "single_thread": {"cpp.threads": 1},
}
# …and a CUDA target: which GEMM implementations max-autotune may pick from (cuBLAS via ATen,
# Triton templates), Triton's own tuning of pointwise and reduction kernels, CUDA graphs.
CUDA_PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "max_autotune": {"max_autotune": True},
    "max_autotune_triton_gemm": {"max_autotune": True, "max_autotune_gemm_backends": "TRITON"},
    "max_autotune_aten_triton": {"max_autotune": True, "max_autotune_gemm_backends": "ATEN,TRITON"},
    "coordinate_descent_tuning": {"coordinate_descent_tuning": True},
    "max_autotune_coordinate_descent": {"max_autotune": True, "coordinate_descent_tuning": True},
    "freezing": {"freezing": True},
}
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "aoti-cpu": CPU_PRESETS,  # always a C++ wrapper: no wrapper choice to make
    "aoti-cuda": CUDA_PRESETS,
    "inductor-cache": {**CPU_PRESETS, "cpp_wrapper": {"cpp_wrapper": True}},  # torch.compile: Python or C++ wrapper
    # executorch:xnnpack: one delegate call per partition (default) or per op
    "executorch": {"default": {}, "per_op": {"per_op_mode": True}},
}
DEFAULT_SPACE = ("default", "max_autotune", "freezing")


def resolve_space(backend: str, candidates: list[str | dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Candidate name → Inductor options, with `default` (no options) always first: it is the
    baseline a winner must beat. Raises ValueError saying what is wrong."""
    presets = PRESETS.get(backend, {"default": {}})
    space: dict[str, dict[str, Any]] = {"default": {}}
    for c in candidates:
        if isinstance(c, str):
            if c not in presets:
                raise ValueError(f"unknown candidate {c!r} for {backend}; presets: {', '.join(presets)}, "
                                 f"or give {{name: ..., options: {{...}}}}")
            name, options = c, presets[c]
        else:
            name, options = c["name"], dict(c.get("options") or {})
        if name in space and (name != "default" or options):
            raise ValueError(f"candidate {name!r} is listed twice")
        space[name] = options
    if len(space) < 2:
        raise ValueError("an autotune space needs at least one candidate besides `default`")
    return space


@dataclass
class Measured:
    """One candidate's outcome, as the tuning record keeps it."""

    name: str
    status: str  # compiled | hit | failed
    key: str | None = None
    error: str | None = None
    median_ms: float | None = None
    spread_ms: float | None = None
    max_abs_err: float | None = None
    device: dict[str, Any] | None = None
    remeasured: bool = False

    @classmethod
    def of(cls, name: str, result: Any, remeasured: bool = False) -> "Measured":
        """A candidate's outcome from its unit's result (a workers.unit.UnitResult)."""
        m = result.metrics
        return cls(name, result.status, result.key, result.error, m.get("compiled_ms"), m.get("compiled_spread_ms"),
                   m.get("max_abs_err"), result.device, remeasured)

    @property
    def usable(self) -> bool:
        return self.status in ("compiled", "hit") and self.median_ms is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Decision:
    winner: str
    reason: str


def decide(measured: list[Measured]) -> Decision | None:
    """The fastest verified candidate, if it beats `default` by more than the noise measured on
    both (the sum of their interquartile ranges); otherwise `default`. None if nothing ran."""
    usable = [m for m in measured if m.usable]
    if not usable:
        return None
    fastest = min(usable, key=lambda m: m.median_ms)
    default = next((m for m in usable if m.name == "default"), None)
    if default is None:
        return Decision(fastest.name, "default failed; fastest of the rest")
    if fastest is default:
        return Decision("default", f"default is the fastest ({default.median_ms:.4f} ms)")
    gain = default.median_ms - fastest.median_ms
    noise = (default.spread_ms or 0.0) + (fastest.spread_ms or 0.0)
    if gain > noise:
        return Decision(fastest.name, f"{gain:.4f} ms faster than default, more than the noise {noise:.4f} ms")
    return Decision("default", f"{fastest.name} was {gain:.4f} ms faster, within the noise {noise:.4f} ms")
