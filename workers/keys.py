"""Unit keys: a hash of everything that decides the compiled artifact, and nothing else.

The components are kept in the manifest so that a miss can be explained by diffing them.
"""
from __future__ import annotations

import functools
import hashlib
import json
import platform
import shutil
import subprocess
import sys
from typing import Any

import torch

# Bump whenever the inputs to the hash (or their meaning) change.
KEY_VERSION = 1


@functools.cache
def _compiler_version(cxx: str) -> str:
    path = shutil.which(cxx)
    if not path:
        return f"{cxx}: not found"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"{cxx}: {e}"
    return out.splitlines()[0].strip() if out else cxx


@functools.cache
def toolchain() -> dict[str, Any]:
    from torch._inductor import config

    cxx = config.cpp.cxx[1] if isinstance(config.cpp.cxx, tuple) else str(config.cpp.cxx)
    try:
        import triton  # noqa: F401  (GPU installs only)

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "cxx": _compiler_version(cxx),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "platform": sys.platform,
    }


def key_components(program: dict[str, str], target: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    return {
        "key_version": KEY_VERSION,
        "program": program,
        "target": target,
        "toolchain": toolchain(),
        "options": {k: options[k] for k in sorted(options)},
    }


def key_of(components: dict[str, Any]) -> str:
    canonical = json.dumps(components, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()
