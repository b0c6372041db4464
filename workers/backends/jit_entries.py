"""The farm feeds PyTorch's remote caches (issue 37): an `inductor-cache` unit's compile also
yields the entries torch's remote FX graph and AOTAutograd caches hold, and the worker publishes them
with the unit, under `remote-cache/` (storage/remote_cache.py), where `use_farm_cache` and
`farm cache-serve` readers find them: a nightly's graphs are hits for JIT users who compile the
same graph with the same torch and settings.

In the sandbox child (`recording`), the entries come from what torch itself recorded for the
unit's bundle (`torch.compiler.save_cache_artifacts`: each FX graph the compile made or found in
the worker's local cache, by its key), encoded as torch's remote FX graph cache encodes them,
with the CPU kernels loaded meanwhile (as a `use_farm_cache` writer ships them), the command
they were built with, and what torch hashed into each key (published with `note_graph`, so a
`use_farm_cache` process that misses the same graph under another key says which settings
differ). The lowering's output is unchanged; only its AOTAutograd lookups miss (see `recording`).
The worker (`published`) reads the outbox as hostile input: bounded, keys of torch's shape,
files inside the outbox.

AOTAutograd entries are fed too, under the key a JIT user of a remote cache computes: their key
hashes functorch's whole config, the remote-cache switch included, and the unit compiles with it
off (turning it on would change the keys of the training bundles it builds), so the unit also
computes each key with the switch on (`keying`) and publishes the entry under that one. Not fed:
autotune entries, which torch keys differently in its local and remote caches.
"""
from __future__ import annotations

import base64
import contextlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from storage.remote_cache import AUTOGRAD_KIND, FX_KIND, KERNEL_PATH, MAX_PARTS, kind_of, remote_key

OUTBOX = "jit-entries"
INDEX = "index.json"
KEY = re.compile(rf"pt2:({FX_KIND}|{AUTOGRAD_KIND})::[a-z0-9]{{20,80}}:c1".encode())
MAX_ENTRIES = 1000
GM_HASH = re.compile(r"[a-z0-9]{8,128}")  # the graph's own hash in torch's key (remote_cache._graph_path)
MAX_INDEX_BYTES = 4 << 20
MAX_BYTES = 512 << 20  # values and kernels of one unit together


@contextlib.contextmanager
def recording(workdir: Path) -> Iterator[None]:
    """In the sandbox child, around a lowering: the FX graph and AOTAutograd entries and the
    kernels it recorded go to `workdir/jit-entries`."""
    from torch._functorch import config as functorch_config
    from torch._functorch._aot_autograd import autograd_cache
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
    from torch._inductor import codecache
    from torch._inductor.codecache import CppCodeCache
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    from torch.compiler._cache import CacheArtifactManager

    from storage.remote_cache import key_parts
    from workers.backends import kernels

    used: set[str] = set()  # CppCodeCache keys of the kernels this unit compiled or reused
    command: list[str] = []  # how they are built: asked within the compile, where the target's ISA is pinned
    recorded: list[tuple[str, bytes]] = []  # (remote FX graph or AOTAutograd key, its pickled entry)
    remote_keys: dict[str, str] = {}  # AOTAutograd key here → the key a remote-cache user computes
    parts: dict[str, dict[str, list[str]]] = {}  # remote FX graph key → what torch hashed into it
    original_load = CppCodeCache.load_async.__func__  # type: ignore[attr-defined]
    original_serialize = CacheArtifactManager.serialize.__func__  # type: ignore[attr-defined]
    original_hash = codecache.compiled_fx_graph_hash
    original_key = autograd_cache.autograd_cache_key

    def hashing(*args: Any, **kwargs: Any) -> Any:
        key, lines = original_hash(*args, **kwargs)
        parts[remote_key(FX_KIND, key)] = key_parts(lines)
        return key, lines

    def keying(*args: Any, **kwargs: Any) -> Any:
        key, lines = original_key(*args, **kwargs)
        remote_keys[key] = key
        if not functorch_config.enable_remote_autograd_cache:
            # the same graph keyed as a JIT user of a remote cache keys it: the switch is the only
            # difference, and it decides where entries are looked up, not what they hold. Its
            # DEBUG lines stay unsaid: a training bundle records the keys that line names.
            disabled, autograd_cache.log.disabled = autograd_cache.log.disabled, True
            try:
                with functorch_config.patch(enable_remote_autograd_cache=True):
                    remote_keys[key] = original_key(*args, **kwargs)[0]
            finally:
                autograd_cache.log.disabled = disabled
        return key, lines

    keys: dict[int, str] = {}  # torch's cache, its loaders back to their keys (grown as it grows)

    def loading(cls: Any, *args: Any, **kwargs: Any) -> Any:
        # a worker's child is long-lived: a kernel an earlier unit loaded is not loaded again, so
        # the kernels this unit used are the ones it asked for (torch's cache, by its key)
        load = original_load(cls, *args, **kwargs)
        key = keys.get(id(load))
        if key is None or cls.cache.get(key) is not load:  # a kernel new to this map: torch's cache grew
            keys.update((id(v), k) for k, v in cls.cache.items())
            key = keys.get(id(load))
        if key is not None:
            used.add(key)
        if not command:
            command.extend(kernels.build_command())
        return load

    def serializing(cls: Any) -> Any:  # the bundle is made: what it holds is read before torch clears it
        made = cls._new_cache_artifacts
        recorded.extend((remote_key(FX_KIND, a.key), a.content) for a in made.get("inductor", []))
        recorded.extend((remote_key(AUTOGRAD_KIND, remote_keys[a.key]), a.content)
                        for a in made.get("aot_autograd", []) if a.key in remote_keys)
        return original_serialize(cls)

    # An AOTAutograd hit (a graph this worker compiled before) loads its FX graphs by their keys
    # without hashing them again, so what went into those keys would be missing: the unit's
    # AOTAutograd lookups miss instead (it traces again; its FX graphs still hit, and are saved
    # whole, as the bundle needs them).
    original_lookup = AOTAutogradCache.__dict__.get("_lookup")
    CppCodeCache.load_async = classmethod(loading)  # type: ignore[method-assign]
    CacheArtifactManager.serialize = classmethod(serializing)  # type: ignore[method-assign]
    codecache.compiled_fx_graph_hash = hashing
    autograd_cache.autograd_cache_key = keying
    if original_lookup is not None:
        AOTAutogradCache._lookup = staticmethod(lambda *args, **kwargs: None)  # type: ignore[method-assign]
    try:
        yield
    finally:
        if original_lookup is not None:
            AOTAutogradCache._lookup = original_lookup  # type: ignore[method-assign]
        CppCodeCache.load_async = classmethod(original_load)  # type: ignore[method-assign]
        CacheArtifactManager.serialize = classmethod(original_serialize)  # type: ignore[method-assign]
        codecache.compiled_fx_graph_hash = original_hash
        autograd_cache.autograd_cache_key = original_key
    root = Path(cache_dir())
    loaded = {name: str(root / name) for key in used
              if KERNEL_PATH.fullmatch(name := f"{key[1:3]}/{key}.main.so") and (root / name).is_file()}
    _write_outbox(workdir / OUTBOX, recorded, loaded, command, parts)


def _write_outbox(outbox: Path, recorded: list[tuple[str, bytes]], loaded: dict[str, str],
                  build_command: list[str], parts: dict[str, dict[str, list[str]]]) -> None:
    from torch._inductor.remote_cache import RemoteCacheJsonSerde

    outbox.mkdir(parents=True, exist_ok=True)
    for name, path in loaded.items():
        (outbox / "kernels" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, outbox / "kernels" / name)
    index = []
    for n, (key, content) in enumerate(dict(recorded).items()):
        if n >= MAX_ENTRIES:
            break
        value = {"data": base64.b64encode(content).decode("ascii"), "time_taken_ms": 0}
        (outbox / f"{n}.value").write_bytes(RemoteCacheJsonSerde().encode(value))
        fx = kind_of(key.encode()) == FX_KIND  # an AOTAutograd entry names its FX graphs, which carry the kernels
        index.append({"key": key, "value": f"{n}.value", "files": sorted(loaded) if fx else [],
                      "facts": {"build_command": build_command} if fx else {}, "parts": parts.get(key, {})})
    (outbox / INDEX).write_text(json.dumps(index))


@dataclass
class Entry:
    key: bytes
    value: bytes
    files: dict[str, bytes]  # kernel name under Inductor's cache dir → its bytes
    facts: dict[str, Any]
    parts: dict[str, list[str]]  # what torch hashed into the key: part → [hash, value]


def read_outbox(outbox: Path) -> list[Entry]:
    """The entries a sandbox recorded (hostile: it lowered a graph from anyone); ValueError says
    what is wrong with them, and none are taken then."""
    index_file = outbox / INDEX
    if not index_file.is_file():
        return []
    if index_file.stat().st_size > MAX_INDEX_BYTES:
        raise ValueError(f"its index is over {MAX_INDEX_BYTES} bytes")
    index = json.loads(index_file.read_text())
    if not isinstance(index, list) or len(index) > MAX_ENTRIES:
        raise ValueError(f"its index is not a list of at most {MAX_ENTRIES} entries")
    budget = [MAX_BYTES]
    read: dict[str, bytes] = {}

    def take(name: str) -> bytes:
        if name not in read:
            path = outbox / name
            if ".." in Path(name).parts or path.is_symlink() or not path.resolve().is_relative_to(outbox.resolve()) \
                    or not path.is_file():
                raise ValueError(f"{name[:100]!r} is not a file in the outbox")
            budget[0] -= path.stat().st_size
            if budget[0] < 0:
                raise ValueError(f"its entries are over {MAX_BYTES} bytes together")
            read[name] = path.read_bytes()
        return read[name]

    entries = []
    for item in index:
        key = str(item.get("key", "")).encode() if isinstance(item, dict) else b""
        if not KEY.fullmatch(key):
            raise ValueError(f"an entry's key {key[:100]!r} is not one of torch's FX graph or AOTAutograd keys")
        files = item.get("files") or []
        if not isinstance(files, list) or not all(isinstance(f, str) and KERNEL_PATH.fullmatch(f) for f in files):
            raise ValueError(f"entry {key[:80]!r} names files that are not Inductor kernels")
        if files and kind_of(key) != FX_KIND:
            raise ValueError(f"entry {key[:80]!r} ships kernels, and only FX graph entries carry them")
        facts = item.get("facts") or {}
        command = facts.get("build_command") if isinstance(facts, dict) else None
        if files and not (isinstance(command, list) and all(isinstance(t, str) for t in command)):
            raise ValueError(f"entry {key[:80]!r} ships kernels without the command they were built with")
        entries.append(Entry(key, take(str(item.get("value"))), {f: take(f"kernels/{f}") for f in files},
                             {"build_command": command} if files else {}, _parts(key, item.get("parts"))))
    return entries


def _parts(key: bytes, parts: Any) -> dict[str, list[str]]:
    if parts in (None, {}):
        return {}
    if not (isinstance(parts, dict) and len(parts) <= MAX_PARTS and all(
            isinstance(name, str) and len(name) <= 200 and isinstance(v, list) and len(v) == 2
            and all(isinstance(x, str) and len(x) <= 200 for x in v) for name, v in parts.items())):
        raise ValueError(f"entry {key[:80]!r} says what went into its key in another shape than torch's")
    if not GM_HASH.fullmatch(parts.get("gm", ["", ""])[0]):
        raise ValueError(f"entry {key[:80]!r} names no graph hash of torch's shape")
    return parts


def published(store: Any, outbox: Path, writer: str) -> tuple[int, str | None]:
    """Publish what the sandbox recorded: (how many entries, why not all were, or None). The
    unit's own artifact stands either way: these are a by-product."""
    from storage.backend import StoreError
    from storage.remote_cache import CacheEntries

    try:
        entries = read_outbox(outbox)
    except (OSError, ValueError, TypeError, AttributeError) as e:
        return 0, f"its remote-cache entries were not published: {e}"
    cache = CacheEntries(store)
    blobs: dict[str, Any] = {}  # a kernel uploaded once however many entries name it
    for done, entry in enumerate(entries):
        try:
            for name, data in entry.files.items():
                if name not in blobs:
                    blobs[name] = store.put_bytes(data)
            cache.put(entry.key, entry.value, writer, {n: blobs[n] for n in entry.files}, entry.facts)
            if entry.parts:  # after the entry: a note never names a key that is not there
                cache.note_graph(entry.parts["gm"][0], entry.key, json.dumps(entry.parts).encode(), writer)
        except StoreError as e:
            return done, f"{done} of its {len(entries)} remote-cache entries were published; the store refused the rest: {e}"
    return len(entries), None
