"""torch's own small, dependency-free modules, loaded from their files without importing torch.

Importing `torch.version` or anything under `torch._inductor` by name imports torch's package
first (over a second of CPU) and, for Inductor, Dynamo (another second). A worker that only
names keys and places work needs two strings from them, not torch: its sandbox child has torch.
Also whether torch's modules have bytecode a process here can use (`farm resources` says so)."""
from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


@functools.cache
def standalone(relative: str) -> ModuleType:
    """torch/<relative> (a module that imports nothing of torch's), or the one already imported."""
    name = "torch." + relative.removesuffix(".py").replace("/", ".")
    if name in sys.modules:
        return sys.modules[name]
    root = torch_dir()
    if root is None:
        raise ModuleNotFoundError("torch is not installed in this environment")
    path = root / relative
    loaded = importlib.util.spec_from_file_location("_farm_standalone_" + name.replace(".", "_"), path)
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module


def torch_dir() -> Path | None:
    """torch's package dir, found without importing torch; None if it is not installed."""
    spec = importlib.util.find_spec("torch")
    return None if spec is None or spec.origin is None else Path(spec.origin).parent


# A few of the modules every process that compiles imports (torch's own, Dynamo's, Inductor's)
BYTECODE_SAMPLE = ("__init__.py", "_dynamo/convert_frame.py", "_inductor/codecache.py")


def unusable_bytecode(root: Path | None = None, sample: tuple[str, ...] = BYTECODE_SAMPLE) -> list[str]:
    """The modules of `sample` under `root` (torch's package dir) without bytecode this Python can
    use: each process that imports them and does not write bytecode compiles their sources again,
    and the farm's sandbox children never write it (PYTHONDONTWRITEBYTECODE: workers/sandbox/env.py).
    On a lent GPU host whose torch was installed so, that was 2,299 modules and 10.5 s of every
    Python process."""
    root = root or torch_dir()
    if root is None:
        return []
    return [name for name in sample if (root / name).is_file() and not _bytecode_kept(root / name)]


def _bytecode_kept(source: Path) -> bool:
    """Whether `source` has bytecode this Python uses as it is: hash-based (which Python checks
    if asked to), or recording the source's modification time and size."""
    try:
        with open(importlib.util.cache_from_source(str(source)), "rb") as f:  # sys.pycache_prefix included
            header = f.read(16)
        stat = source.stat()
    except OSError:
        return False
    if len(header) < 16 or header[:4] != importlib.util.MAGIC_NUMBER:
        return False
    return bool(int.from_bytes(header[4:8], "little") & 1) or (
        int.from_bytes(header[8:12], "little") == int(stat.st_mtime) & 0xFFFFFFFF
        and int.from_bytes(header[12:16], "little") == stat.st_size & 0xFFFFFFFF)
