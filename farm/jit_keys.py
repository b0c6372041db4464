"""Why a `use_farm_cache` process misses a graph the farm has: what torch hashed into each FX
graph key (its debug lines: the graph, each input's metadata, each Inductor setting, the thread
count, ...) is recorded as keys are made; a writer publishes it beside the graph's entry
(storage/remote_cache.py, `note_graph`), and a process that misses the same graph under another
key says which parts differ (farm/jit_cache.py)."""
from __future__ import annotations

import logging
from typing import Any

from storage.remote_cache import FX_KIND, key_parts

log = logging.getLogger("farm.jit_cache")

KEPT_PARTS = 256  # keys whose parts a process keeps


def fx_id(key: bytes) -> str:
    return key.decode("utf-8", "replace").removeprefix(f"pt2:{FX_KIND}::").removesuffix(":c1")


def record_key_parts(cache: Any) -> None:
    """What torch hashes into each FX graph key (its debug lines: the graph, each input's
    metadata, each Inductor setting, the thread count, ...), kept by key."""
    from torch._inductor import codecache

    original = codecache.compiled_fx_graph_hash

    def recording(*args: Any, **kwargs: Any) -> Any:
        key, lines = original(*args, **kwargs)
        parts = key_parts(lines)
        if "gm" in parts:
            cache._parts[key] = parts
            while len(cache._parts) > KEPT_PARTS:
                cache._parts.pop(next(iter(cache._parts)))
        return key, lines

    codecache.compiled_fx_graph_hash = recording
    cache._undo.append(lambda: setattr(codecache, "compiled_fx_graph_hash", original))


def explain_miss(cache: Any, source: Any, key: bytes) -> None:
    """Where the farm has this very graph under another key (another setting, another input
    shape, another thread count), say which parts of the key differ."""
    ours = cache._parts.get(fx_id(key))
    if ours is None:
        return
    try:
        found = source.graph(ours["gm"][0])
    except Exception as e:  # noqa: BLE001 - only an explanation is lost
        log.debug("farm cache: no explanation for the miss of %s (%s)", key[:80], e)
        return
    if found is None or found[0] == key.decode("utf-8", "replace"):
        return
    other, writer, theirs = found
    differ = [p for p in sorted(set(ours) | set(theirs)) if ours.get(p, [None])[0] != theirs.get(p, [None])[0]]
    shown = "; ".join(f"{p}: {ours.get(p, ['', 'absent'])[1]!r} here, {theirs.get(p, ['', 'absent'])[1]!r} there"
                      for p in differ[:6])
    more = f" (and {len(differ) - 6} more)" if len(differ) > 6 else ""
    log.warning("farm cache: %s is not in the farm, which has this graph under %s (written by %s); their keys "
                "differ in %s%s; this process compiles its own", key.decode("utf-8", "replace")[:80], other[:80],
                writer, shown, more)
    cache.count("misses_explained")
