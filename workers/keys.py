"""Unit keys: a hash of everything that decides the compiled artifact, and nothing else.

The components are kept in the manifest so that a miss can be explained by diffing them.
"""
from __future__ import annotations

import functools
import hashlib
import json
import platform
import sys
from typing import Any

from workers.torch_files import standalone

# Bump whenever the inputs to the hash (or their meaning) change.
KEY_VERSION = 3  # 3: backend-specific toolchain (compiler, CUDA, Triton only where the backend uses them)


@functools.cache
def toolchain() -> dict[str, Any]:
    """What every artifact depends on; each backend adds its own tools (Backend.toolchain)."""
    version = standalone("version.py")  # torch's own record of its build, without importing torch
    return {
        "torch": version.__version__,
        "torch_git": version.git_version,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "platform": sys.platform,
    }


def key_components(program: dict[str, str], target: dict[str, Any], options: dict[str, Any],
                   tools: dict[str, Any]) -> dict[str, Any]:
    return {
        "key_version": KEY_VERSION,
        "program": program,
        "target": target,
        "toolchain": {**toolchain(), **tools},
        "options": {k: options[k] for k in sorted(options)},
    }


def identity_variant(weights_mode: str, specialize: Any, agreed: Any = ()) -> str:
    """What besides a program's archive bytes decides its identity (storage/identities.py)."""
    tc = toolchain()
    parts = {"key_version": KEY_VERSION, "torch": tc["torch"], "torch_git": tc["torch_git"],
             "weights_mode": weights_mode, "specialize": specialize}
    if agreed:  # a gang's re-export (absent otherwise, so the variants of plain units stay as they were)
        parts["agreed"] = agreed
    return key_of(parts)[:32]


def key_of(components: dict[str, Any]) -> str:
    canonical = json.dumps(components, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def flatten(components: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"target": {"isa": "avx2"}} → {"target.isa": "avx2"}: the leaves that can differ."""
    flat: dict[str, Any] = {}
    for name, value in components.items():
        path = f"{prefix}{name}"
        if isinstance(value, dict):
            flat.update(flatten(value, path + "."))
        else:
            flat[path] = value
    return flat


def diff_components(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """Every leaf where two keys' components differ, as (path, a's value, b's value); a
    missing leaf reads as None."""
    fa, fb = flatten(a), flatten(b)
    return [(path, fa.get(path), fb.get(path)) for path in sorted(fa.keys() | fb.keys()) if fa.get(path) != fb.get(path)]
