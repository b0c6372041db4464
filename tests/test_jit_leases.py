"""`use_farm_cache`'s leases (ranks compile once) never outlive the compile they were taken in:
an autotune miss (put only if its kernel was benchmarked, which a lent H100 showed is often
never) takes none, a lease whose compile ended without a put is released as Dynamo's compile
ends, and a thread never waits on a key another thread of its own process compiles."""
from __future__ import annotations

import hashlib
import threading

from torch._dynamo.callback import CallbackTrigger, callback_handler
from torch._inductor import remote_cache

from farm.jit_cache import use_farm_cache
from storage import store_from_uri


def _lease_name(key: str) -> str:
    return "jit-" + hashlib.sha256(key.encode()).hexdigest()[:48]


def test_leases_end_with_the_compile_and_autotune_misses_take_none(tmp_path):
    store = store_from_uri(str(tmp_path / "store"))
    callbacks = list(callback_handler.end_callbacks)
    cache = use_farm_cache(store=store, wait_s=60)
    try:
        graphs = remote_cache.RemoteFxGraphCache.backend_override_cls()
        autograd = remote_cache.RemoteAOTAutogradCache.backend_override_cls()
        autotune = remote_cache.RemoteAutotuneCache.backend_override_cls()
        graph_key, training_key = "pt2:fx-graph-v1::fgraph:c1", "pt2:autograd-experimental::atraining:c1"
        tune_key = "pt2:autotune-v1::akernel:c1"
        leases_before = cache.stats().get("leases", 0)  # the ISA probes' lease, if this process built them

        assert autotune._get(tune_key) is None
        assert cache.stats().get("leases", 0) == leases_before and cache.leases.current(_lease_name(tune_key)) is None

        with callback_handler.install_callbacks(CallbackTrigger.DYNAMO, "0/0"):
            assert autograd._get(training_key) is None and graphs._get(graph_key) is None  # misses: compiled here, leased
            held = cache.leases.current(_lease_name(graph_key))
            assert held is not None and held.holder == cache.leases.holder
            # another thread of this process that misses the same key compiles it too: no waiting on ourselves
            other = threading.Thread(target=lambda: graphs._get(graph_key))
            other.start()
            other.join(timeout=30)  # waiting on the lease would take wait_s (60 s)
            assert not other.is_alive()
            assert cache.stats()["compiled_twice_here"] == 1
        # the compile ended without a put (torch did not cache the graph): the key is free for the next rank
        assert cache.leases.current(_lease_name(graph_key)) is None
        # a training graph's AOTAutograd entry is put once its backward compiled: held until then
        assert cache.leases.current(_lease_name(training_key)) is not None
        with callback_handler.install_callbacks(CallbackTrigger.LAZY_BACKWARD, "0/0"):
            pass
        assert cache.leases.current(_lease_name(training_key)) is None
        assert cache.stats()["leases"] == leases_before + 2
    finally:
        cache.close()
    assert callback_handler.end_callbacks == callbacks  # close() undid it all
