"""`use_farm_cache`: one line at the top of a training script that calls `torch.compile` and never
exports, putting PyTorch's own remote caches (FX graph, AOTAutograd, autotune) on the farm:

    from farm.client import use_farm_cache
    use_farm_cache(store="s3://bucket/farm")                       # store credentials: reads and writes
    use_farm_cache(url="redis://train:TOKEN@cache-host:6380")      # `farm cache-serve`: reads

It installs a backend for the three caches through the one hook torch 2.11-2.13 has for it,
`RemoteCache.backend_override_cls` (torch/_inductor/remote_cache.py), and turns them on. Unlike
stock torch against Redis, it:

- checks every entry before torch unpickles it: with FARM_VERIFY_KEY set, an entry whose index
  document is unsigned or wrongly signed is refused (a miss, logged with its key); every value
  and kernel is checked against the digest that document names;
- ships the compiled CPU kernels with each FX graph entry it writes (the kernels this process
  loaded so far, by their path under Inductor's cache dir: farm/jit_kernels.py) and Inductor's
  ISA probes in an entry per toolchain, and puts them in place before torch looks, so a hit
  runs no g++ where the build command is the writer's (checked; another one is logged once and
  compiles as before), not even for Inductor's precompiled header, which it makes only for a
  kernel it builds (workers/backends/kernels.py, skipping_unneeded_headers);
- makes ranks compile once: a writer that misses an FX graph or AOTAutograd key takes a lease
  on it in the store while torch compiles it, and others wait for the entry (bounded; a dead
  holder is taken over). Leases end with the compile, put or not; autotune keys take none
  (a miss there is often never put: a kernel with one config is not benchmarked);
- says why a graph the farm has under another key missed: which parts of torch's key differ
  (farm/jit_keys.py);
- with `isa=`, pins Inductor's CPU code to that ISA (as the farm's own targets do), so every
  machine of a fleet keys, builds and finds the same entries.

Readers through `url=` need a `read` token of `farm cache-serve`, writers a `write` token (their
kernels travel with FARM.PUT). Ranks compiling once, and the explanation of a miss, need `store=`.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from farm.jit_kernels import PROBES_KIND, install_kernels, probes_key, put_probes, record_loaded_kernels
from farm.jit_keys import explain_miss, fx_id, record_key_parts
from farm.jit_sources import EndpointSource, Source, StoreSource
from storage.remote_cache import AUTOGRAD_KIND, FX_KIND, PROBE_PATH

log = logging.getLogger(__name__)

LEASE_TTL_S = 30.0  # a holder renews every ttl/4; one silent this long is taken over
LEASE_POLL_S = 0.25  # how often a waiter looks for the entry
CACHES = ("RemoteFxGraphCache", "RemoteAOTAutogradCache", "RemoteAutotuneCache", "RemoteBundledAutotuneCache")
# The caches whose miss is a compile that ends by putting the entry (within Dynamo's compile, or
# a training graph's lazy backward compile): their misses take leases. An autotune miss is looked up as a kernel first runs, after the
# compile, and is put only if the kernel had configs to benchmark (on a GPU, a lease held for
# the run kept other ranks waiting on a key that never came).
LEASED_KINDS = (FX_KIND, AUTOGRAD_KIND, PROBES_KIND)


@dataclass
class FarmCache:
    """What `use_farm_cache` installed; `stats()` for what it did, `close()` to undo it."""
    source: str
    writes: bool
    counts: dict[str, int] = field(default_factory=dict)
    setup_s: dict[str, float] = field(default_factory=dict)  # use_farm_cache's own steps, timed (bench/gpu_zoo.sh)
    _loaded: dict[str, str] = field(default_factory=dict, repr=False)  # kernels this process loaded: name → path
    _undo: list = field(default_factory=list, repr=False)
    _build_problem_said: bool = field(default=False, repr=False)
    _probes_put: bool = field(default=False, repr=False)
    # named as use_farm_cache starts (within a compile, Inductor's settings differ)
    _probes_key: bytes = field(default=b"", repr=False)
    # storage.leases.Leases, with store=: ranks that miss one key at once compile it once
    leases: Any = field(default=None, repr=False)
    wait_s: float = field(default=3600.0, repr=False)
    _held: dict = field(default_factory=dict, repr=False)  # key → the lease this process holds while torch compiles it
    _parts: dict = field(default_factory=dict, repr=False)  # FX key → what torch hashed into it: {part: [hash, value]}
    # storage.signing.Trust from this process's environment, read once (FARM_VERIFY_KEY)
    trust: Any = field(default=None, repr=False)
    _build_command: list[str] | None = field(default=None, repr=False)
    _holding: dict = field(default_factory=dict, repr=False)  # (thread, cache kind) → the key whose lease it holds

    def stats(self) -> dict[str, int]:
        return dict(self.counts)

    def close(self) -> None:
        for key in list(self._held):
            self.release(key)
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def release(self, key: bytes) -> None:
        lease = self._held.pop(key, None)
        if lease is not None:
            lease.release()

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    def build_command(self) -> list[str]:
        """How this process builds Inductor's CPU kernels (what a reader of its entries checks),
        asked once: the ISA is pinned, if at all, as use_farm_cache starts."""
        if self._build_command is None:
            from workers.backends import kernels

            self._build_command = kernels.build_command()
        return self._build_command


def use_farm_cache(store: Any = None, url: str | None = None, *, write: bool | None = None,
                   isa: str | None = None, wait_s: float = 3600.0) -> FarmCache:
    """Put this process's torch.compile caches on the farm (see the module's doc). `store`: a
    store URI or Store (reads, and writes unless write=False); `url`: a `farm cache-serve`
    endpoint, redis://NAME:TOKEN@HOST:PORT (reads; writes with write=True and a write token,
    without kernels). `isa`: x86-64, avx2 or avx512, pinned for Inductor's CPU code.

    Ranks compile once (writers through store=): a process that misses a key takes a lease on
    it in the store while torch compiles it, and others that miss it meanwhile wait for its
    entry and hit; at most `wait_s` on a live holder (then they compile too), and a holder that
    died is taken over after LEASE_TTL_S without a beat."""
    if (store is None) == (url is None):
        raise ValueError("use_farm_cache: give store= (a store URI) or url= (redis://NAME:TOKEN@HOST:PORT of "
                         "`farm cache-serve`), one of them")
    if url is not None and not url.startswith(("redis://", "rediss://")):
        raise ValueError(f"use_farm_cache: url={_without_token(url)!r} is not a `farm cache-serve` address: give "
                         f"redis://NAME:TOKEN@HOST:PORT (rediss:// behind TLS), or store= for a store URI")
    import torch._functorch.config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor import remote_cache

    if store is not None:
        from farm.stores import open_store

        from storage.leases import Leases, holder_here

        opened = open_store(store) if not hasattr(store, "backend") else store
        backend: Source = StoreSource(opened)
        cache = FarmCache(opened.uri, writes=write is not False)
        if cache.writes:  # a reader never publishes: it must not hold others waiting
            cache.leases = Leases(opened.backend, holder_here(), ttl_s=LEASE_TTL_S)
            cache.wait_s = wait_s
            atexit.register(cache.close)
            _release_when_compiles_end(cache)
    else:
        backend = EndpointSource(url, _without_token(url), write=bool(write))
        cache = FarmCache(backend.name, writes=bool(write))
    from storage.signing import Trust

    cache.trust = Trust.from_env()
    from workers.backends import kernels
    from workers.backends.cpu_isa import ISAS, vec_isas_when_asked

    record_loaded_kernels(cache)
    _hold(cache, kernels.skipping_unneeded_headers())  # a hit builds nothing, not even the header
    record_key_parts(cache)
    if isa is not None:
        _pin_isa(cache, isa)
    cache._probes_key = probes_key()  # named now: within a compile, Inductor's settings differ

    @contextlib.contextmanager
    def first_asked() -> Iterator[None]:
        with _timed(cache, "vec_isas"):  # the host's record, or Inductor's probes loaded one by one
            with _timed(cache, "probes"):
                _install_probes(cache, backend)
            yield

    # Inductor's vector ISAs (pinned: the one), only once Inductor asks: a step on a GPU never does
    _hold(cache, vec_isas_when_asked(ISAS[isa].vec_isa if isa else None, first_asked))

    backend_cls = _backend_class()

    def make() -> remote_cache.RemoteCacheBackend:
        return backend_cls(cache, backend)

    for name in CACHES:
        cls = getattr(remote_cache, name, None)
        if cls is not None:
            before = cls.__dict__.get("backend_override_cls")
            cls.backend_override_cls = make
            cache._undo.append(lambda cls=cls, before=before: setattr(cls, "backend_override_cls", before))
    for module, name in ((inductor_config, "fx_graph_remote_cache"), (inductor_config, "autotune_remote_cache"),
                         (functorch_config, "enable_remote_autograd_cache")):
        before = getattr(module, name)
        setattr(module, name, True)
        cache._undo.append(lambda module=module, name=name, before=before: setattr(module, name, before))
    return cache


# torch's side -------------------------------------------------------------------------
def kind_of_key(key: bytes) -> str:
    from storage.remote_cache import kind_of

    return kind_of(key)


@functools.cache
def _backend_class() -> type:
    """torch's RemoteCacheBackend, subclassed once torch is imported."""
    from torch._inductor.remote_cache import RemoteCacheBackend

    class Backend(RemoteCacheBackend):  # type: ignore[misc, type-arg]
        """What torch calls for each remote-cache get and put."""

        def __init__(self, cache: FarmCache, source: Source):
            super().__init__()
            self.cache, self.source = cache, source

        def _get(self, key: str) -> bytes | None:
            return _get(self.cache, self.source, key.encode())

        def _put(self, key: str, data: bytes) -> None:
            _put(self.cache, self.source, key.encode(), data)

    return Backend


def _get(cache: FarmCache, source: Source, key: bytes) -> bytes | None:
    found = _checked(cache, source, key)
    if found is None and source.resting():  # nothing to explain or wait on: it is not answering
        return None
    if found is None and kind_of_key(key) == FX_KIND:
        explain_miss(cache, source, key)
    if found is None and cache.leases is not None and kind_of_key(key) in LEASED_KINDS:
        found = _waited(cache, source, key)
    if found is None:
        return None
    value, files, facts = found
    if files:
        cache.count("kernels_installed", install_kernels(cache, files, facts))
    cache.count("hits")
    return value


def _compile_once(cache: FarmCache, source: Source, key: bytes) -> tuple[bytes, dict[str, bytes], dict[str, Any]] | None:
    """After a miss: the entry, once the process holding the key's lease published it; or None
    with the lease now held here (torch compiles, `_put` publishes and releases), or after
    waiting `wait_s` on a live holder. A lease whose compile ended without a put (torch failed,
    or did not cache the graph) is released as that compile ends, or as this thread looks up its
    next key of that kind, whichever comes first."""
    import threading

    from storage.leases import Lease

    slot = (threading.get_ident(), kind_of_key(key))
    if (stale := cache._holding.pop(slot, None)) is not None:
        cache.release(stale)
    if key in cache._held:  # another thread of this process compiles it: never wait on ourselves
        cache.count("compiled_twice_here")
        return None
    name = "jit-" + hashlib.sha256(key).hexdigest()[:48]
    claim = cache.leases.claim(name, lambda: _checked(cache, source, key, quiet=True),
                               on_wait=lambda info: log.info("farm cache: %s is being compiled by %s; waiting",
                                                             key[:80], info.holder),
                               poll_s=LEASE_POLL_S, wait_s=cache.wait_s)
    if isinstance(claim, Lease):
        claim.__enter__()  # renewed from here until released
        cache._held[key], cache._holding[slot] = claim, key
        cache.count("leases")
        return None
    if claim is None:
        log.warning("farm cache: waited %gs for %s from another process; compiling it here", cache.wait_s, key[:80])
        cache.count("waits_given_up")
        return None
    cache.count("waited_hits")
    return claim


def _waited(cache: FarmCache, source: Source, key: bytes) -> tuple[bytes, dict[str, bytes], dict[str, Any]] | None:
    """_compile_once, where the store failing meanwhile is a miss (compiled here), not torch's error."""
    try:
        return _compile_once(cache, source, key)
    except Exception as e:  # noqa: BLE001 - the lease's store failed: compiled here, as for a miss
        source.failed(e)
        return None


def _release_when_compiles_end(cache: FarmCache) -> None:
    """A lease ends with the compile it was taken in, whether torch put the entry or not (it did
    not cache the graph, or failed): others waiting on the key then compile it themselves instead
    of waiting `wait_s` on a holder that has moved on. An FX graph is put within its Dynamo
    compile; a training graph's AOTAutograd entry only once its backward is compiled (lazily, at
    the first backward), so those leases end with a backward's compile."""
    from torch._dynamo.callback import CallbackTrigger, callback_handler

    def ended(args: Any) -> None:
        backward = args.callback_trigger == CallbackTrigger.LAZY_BACKWARD
        for key in list(cache._held):
            if backward or kind_of_key(key) != AUTOGRAD_KIND:
                cache.release(key)

    callback_handler.register_end_callback(ended)
    cache._undo.append(lambda: callback_handler.remove_end_callback(ended))


def _checked(cache: FarmCache, source: Source, key: bytes,
             quiet: bool = False) -> tuple[bytes, dict[str, bytes], dict[str, Any]] | None:
    """(value, files, facts) of an entry that passed `_problem`; None for a miss or a refusal
    (`quiet`: a miss is not counted, as while waiting on a lease)."""
    if source.resting():  # it failed a moment ago: a miss, unasked (jit_sources.RETRY_S)
        if not quiet:
            cache.count("errors")
        return None
    try:
        found = source.entry(key)
    except Exception as e:  # noqa: BLE001 - a cache that cannot answer is a miss; torch compiles
        source.failed(e)
        cache.count("errors")
        return None
    source.answered()
    if found is None:
        if not quiet:
            cache.count("misses")
        return None
    raw, value, files = found
    problem = _problem(key, raw, value, cache.trust)
    if problem:
        log.warning("farm cache: refused %s: %s; compiling it here", key.decode("utf-8", "replace")[:120], problem)
        cache.count("refused")
        return None
    return value, files, json.loads(raw).get("facts") or {}


def _problem(key: bytes, raw: bytes, value: bytes, trust: Any) -> str | None:
    """Why this entry must not reach torch's unpickler, or None: its index document's signature
    (where FARM_VERIFY_KEY requires one), its key, and its value's digest."""
    from storage.remote_cache import index_path

    try:
        doc = trust.open(index_path(key), json.loads(raw))
    except Exception as e:  # noqa: BLE001 - UntrustedDocument, or not JSON at all
        return str(e)
    if doc.get("key") != key.decode("utf-8", "surrogateescape"):
        return "its index document names another key"
    digest = (doc.get("blob") or {}).get("digest")
    if hashlib.sha256(value).hexdigest() != digest:
        return "its value does not match the digest its index document names"
    return None


def _put(cache: FarmCache, source: Source, key: bytes, data: bytes) -> None:
    if not cache.writes:
        return
    if source.resting():  # not answering: the entry is not put, and others waiting on it compile
        cache.release(key)
        cache.count("puts_skipped")
        return
    files: dict[str, str] = {}
    facts: dict[str, Any] = {}
    try:
        if kind_of_key(key) == FX_KIND:
            files = dict(cache._loaded)
            if files:  # naming it picks a vector ISA (Inductor's probes), which a graph with no CPU kernel never needs
                facts = {"build_command": cache.build_command()}
                put_probes(cache, source)
            if isinstance(source, StoreSource) and (parts := cache._parts.get(fx_id(key))) is not None:
                source.note_graph(key, parts)
        source.put(key, data, files, facts)
    except Exception as e:  # noqa: BLE001 - said once (Source.failed), not a stack per graph from torch
        source.failed(e)
        cache.count("puts_skipped")
        return
    finally:
        cache.release(key)  # published (or not: then the next claimant compiles it)
    cache.count("writes")


# Inductor's ISA probes: built before its first cache lookup (the key names the vector ISA), so a
# reader installs them from an entry of their own per toolchain as Inductor first asks for them.
def _install_probes(cache: FarmCache, source: Source) -> None:
    """The toolchain's probes from the farm; where none are there yet and this process writes,
    built here under a lease (other ranks starting at once wait and take them) and published."""
    from workers.backends import kernels

    key = cache._probes_key
    found = _checked(cache, source, key)
    if found is None and cache.leases is not None and not source.resting():
        found = _waited(cache, source, key)
        if key in cache._held:  # ours to build: Inductor checks every ISA it might use
            from torch._inductor.cpu_vec_isa import valid_vec_isa_list

            valid_vec_isa_list()
            try:
                put_probes(cache, source)
            except Exception as e:  # noqa: BLE001 - within Inductor's question of the host's ISAs: not torch's error
                source.failed(e)
    if found is not None:
        files = {n: d for n, d in found[1].items() if PROBE_PATH.fullmatch(n)}
        cache.count("probes_installed", kernels.install(files))


@contextlib.contextmanager
def _timed(cache: FarmCache, step: str) -> Iterator[None]:
    began = time.perf_counter()
    try:
        yield
    finally:
        cache.setup_s[step] = round(time.perf_counter() - began, 2)


def _hold(cache: FarmCache, manager: Any) -> None:
    """Inside context `manager` for as long as this cache is installed (it leaves with the rest)."""
    manager.__enter__()
    cache._undo.append(lambda: manager.__exit__(None, None, None))


def _pin_isa(cache: FarmCache, isa: str) -> None:
    """Inductor's settings for `isa` (the vector ISA it sees is set with the host's: use_farm_cache)."""
    from torch._inductor import config as inductor_config

    from workers.backends.cpu_isa import ISAS

    if isa not in ISAS:
        raise ValueError(f"use_farm_cache: unknown isa {isa!r}; choose one of {', '.join(ISAS)}")
    for name, value in ISAS[isa].inductor_configs.items():
        section, _, attr = name.rpartition(".")
        owner = getattr(inductor_config, section) if section else inductor_config
        before = getattr(owner, attr)
        setattr(owner, attr, value)
        cache._undo.append(lambda owner=owner, attr=attr, before=before: setattr(owner, attr, before))


def _without_token(url: str) -> str:
    return re.sub(r"//[^@/]*@", "//", url)
