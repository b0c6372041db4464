"""torch's own small, dependency-free modules, loaded from their files without importing torch.

Importing `torch.version` or anything under `torch._inductor` by name imports torch's package
first (over a second of CPU) and, for Inductor, Dynamo (another second). A worker that only
names keys and places work needs two strings from them, not torch: its sandbox child has torch."""
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
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("torch is not installed in this environment")
    path = Path(spec.origin).parent / relative
    loaded = importlib.util.spec_from_file_location("_farm_standalone_" + name.replace(".", "_"), path)
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module
