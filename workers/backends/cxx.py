"""The C++ compiler AOTInductor builds wrappers and CPU kernels with: part of every key whose
artifact it builds."""
from __future__ import annotations

import functools
import shutil
import subprocess
from typing import Any

def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"


@functools.cache
def compiler() -> dict[str, Any]:
    """Inductor's C++ compiler (its `cpp.cxx`, from $CXX when set) and its version: part of every
    key whose artifact it builds."""
    from torch._inductor import config

    cxx = config.cpp.cxx[1] if isinstance(config.cpp.cxx, tuple) else str(config.cpp.cxx)
    path = shutil.which(cxx)
    version = _run([path, "--version"]).splitlines()[0] if path else "not found"
    return {"cxx": cxx, "cxx_version": version or "unknown"}
