"""The C++ compiler AOTInductor builds wrappers and CPU kernels with (part of every key whose
artifact it builds), and whether what it builds can load into this Python.

Code built by a GCC needs the libstdc++ of that GCC or a newer one at run time. On the lent
H100 machine `CXX=/opt/gcc/bin/g++` (not the system compiler) built CUDA packages whose
wrapper died with SIGSEGV in `parse_device_str` (std::regex) as soon as `aoti_load_package`
ran, in any plain process; the same packages built by the system g++ 13 (whose libstdc++,
6.0.33, is the one Python runs with) loaded and ran. So a compiler whose libstdc++ is newer
than the loaded one is refused before anything is built with it. On 2026-11-27 that compiler
linked the system's libstdc++ and its packages still crashed there, for a reason not yet known
(bench/gpu_zoo.sh prints what it adds to the system's g++): a crash as a package loads now names
the compiler $CXX chose and says to try without it (`crash_note`).
"""
from __future__ import annotations

import ctypes
import functools
import os
import re
import shutil
import subprocess
import sys
from typing import Any

LIBSTDCXX = re.compile(r"libstdc\+\+\.so\.6\.0\.(\d+)$")


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"


@functools.cache
def compiler() -> dict[str, Any]:
    """Inductor's C++ compiler (its `cpp.cxx`, from $CXX when set) and its version: part of every
    key whose artifact it builds."""
    config = sys.modules.get("torch._inductor.config")
    if config is None:  # importing Inductor imports Dynamo (1.5 s of CPU in every worker and gang rank)
        cxx = default_cxx()
    else:  # this process may have set it
        cxx = config.cpp.cxx[1] if isinstance(config.cpp.cxx, tuple) else str(config.cpp.cxx)
    path = shutil.which(cxx)
    version = _run([path, "--version"]).splitlines()[0] if path else "not found"
    return {"cxx": cxx, "cxx_version": version or "unknown"}


def default_cxx() -> str:
    """Inductor's `config.cpp.cxx` as that config sets it (tests/test_keys... checks they agree)."""
    return os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")


def _minor(path: str) -> int | None:
    match = LIBSTDCXX.search(os.path.realpath(path))
    return int(match.group(1)) if match else None


def compiler_problem() -> str | None:
    """Why there is no C++ compiler to run here (none installed, $CXX naming nothing runnable), or None.
    Asked before anything that builds: Inductor's ISA probes would fail with less to go on."""
    if shutil.which(compiler()["cxx"]):
        return None
    named = f"CXX={os.environ['CXX']!r}" if os.environ.get("CXX") else repr(compiler()["cxx"])
    return (f"the C++ compiler {named} is not installed here, or cannot be run; Inductor's CPU code and "
            f"AOTInductor packages need one: install g++ (apt-get install g++), or set CXX to a compiler")


@functools.cache
def libstdcxx_problem() -> str | None:
    """Why code built by the compiler would not load here (its libstdc++ is newer than ours), or None."""
    missing = compiler_problem()
    if missing:
        return missing
    path = shutil.which(compiler()["cxx"])
    built = _run([path, "-print-file-name=libstdc++.so.6"])
    try:  # the one torch would run with: a worker that imports no torch may not have loaded any yet
        ctypes.CDLL("libstdc++.so.6")
    except OSError:
        pass
    try:
        with open("/proc/self/maps") as f:
            loaded = next((line.split()[-1] for line in f if "libstdc++.so" in line), None)
    except OSError:
        return None
    mine, theirs = _minor(loaded or ""), _minor(built)
    if mine is None or theirs is None or theirs <= mine:
        return None
    return (f"the C++ compiler {path} links against {os.path.realpath(built)}, newer than the "
            f"{os.path.realpath(loaded)} this Python runs with: AOTInductor packages it builds crash when loaded. "
            f"Set CXX to a compiler of this system's libstdc++ (e.g. CXX=/usr/bin/g++)")


def crash_note() -> str:
    """What to add to a crash as a package loaded, where $CXX names a compiler other than the
    system's g++: on the lent H100 (2026-11-27) CXX=/opt/gcc/bin/g++, the same GCC 13.3 with the
    same libstdc++, libgomp and libgcc_s as /usr/bin/g++, still built CUDA packages that died with
    SIGSEGV in aoti_load_package (a plain process too), and /usr/bin/g++'s loaded and ran."""
    named = os.environ.get("CXX")
    path, system = shutil.which(named or ""), shutil.which("g++")
    if not named or not path or (system and os.path.realpath(path) == os.path.realpath(system)):
        return ""
    return (f"; it was built with CXX={named} ({compiler()['cxx_version']}), not the system's g++ ({system}), and "
            f"packages built by such a compiler have crashed as torch loaded them: try the job with CXX unset "
            f"or CXX={system or '/usr/bin/g++'}")
