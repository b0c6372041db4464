"""The compiled CPU kernels a `use_farm_cache` writer ships with its FX graph entries, and their
install in a reader (farm/jit_cache.py): a hit then runs no g++ where the reader's build command
is the writer's (workers/backends/kernels.py does the same for training bundles)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from storage.remote_cache import KERNEL_PATH

log = logging.getLogger("farm.jit_cache")



def record_loaded_kernels(cache: Any) -> None:
    """Note every kernel binary Inductor loads in this process (`cache._loaded`: its name under
    the cache dir → its path), for the writer's next FX graph entry."""
    from torch._inductor.codecache import CppCodeCache

    from workers.backends import kernels

    original = CppCodeCache._load_library.__func__  # type: ignore[attr-defined]

    def recording(cls: Any, path: str, key: str) -> Any:
        loaded = original(cls, path, key)
        if (name := kernels.relative(path)) is not None:
            cache._loaded[name] = path
        return loaded

    CppCodeCache._load_library = classmethod(recording)  # type: ignore[method-assign]
    cache._undo.append(lambda: setattr(CppCodeCache, "_load_library", classmethod(original)))


def install_kernels(cache: Any, files: dict[str, bytes], facts: dict[str, Any]) -> int:
    """Put an entry's kernels where Inductor looks (only names shaped as its kernels are, never
    outside the cache dir), where this process's build command is the writer's; how many."""
    from workers.backends import kernels

    recorded = facts.get("build_command")
    problem = kernels.build_problem(recorded) if recorded else "the entry does not say how its kernels were built"
    if problem:
        if not cache._build_problem_said:
            log.warning("farm cache: its kernels are not used here: %s", problem)
            cache._build_problem_said = True
        return 0
    safe = {name: data for name, data in files.items() if KERNEL_PATH.fullmatch(name) and ".." not in name}
    return kernels.install(safe)


def read_files(paths: dict[str, str]) -> dict[str, bytes]:
    files = {}
    for name, path in paths.items():
        try:
            files[name] = Path(path).read_bytes()
        except OSError:
            continue  # removed meanwhile: the reader builds that one
    return files
