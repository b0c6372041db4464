"""The compiled CPU kernels a `use_farm_cache` writer ships with its FX graph entries, and their
install in a reader (farm/jit_cache.py): a hit then runs no g++ where the reader's build command
is the writer's (workers/backends/kernels.py does the same for training bundles). Inductor's ISA
probes, CPU binaries too, go in an entry of their own per toolchain (`probes_key`)."""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from storage.remote_cache import KERNEL_PATH, remote_key

log = logging.getLogger("farm.jit_cache")

PROBES_KIND = "farm-isa-probes-v1"  # Inductor's ISA probes, an entry per toolchain


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


def probes_key() -> bytes:
    """The probes' entry: named by where this torch and compiler put the x86 probes (naming
    them builds nothing), so a toolchain that builds other ones never takes these."""
    from torch._inductor.cpu_vec_isa import supported_vec_isa_list

    from workers.backends import kernels

    names = sorted(Path(p).name for isa in supported_vec_isa_list if (p := kernels.isa_probe_path(str(isa))))
    return remote_key(PROBES_KIND, hashlib.sha256("\n".join(names).encode()).hexdigest()).encode()


def put_probes(cache: Any, source: Any) -> None:
    """The probes this process's Inductor built, once: as it builds them under the probes' lease,
    or with its first entry that holds CPU kernels (Inductor had picked a vector ISA for them).
    `source`: farm/jit_cache.py's, where entries go."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from workers.backends.kernels import probes_in

    if cache._probes_put:
        return
    cache._probes_put = True
    built = {name: str(p) for name, p in probes_in(Path(cache_dir())).items()}
    try:
        if built:
            source.put(cache._probes_key, json.dumps(sorted(built)).encode(), built, {})
    finally:
        cache.release(cache._probes_key)
