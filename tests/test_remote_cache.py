"""PyTorch's remote caches on the farm's store: stock torch, with the environment variables alone,
fills it through `farm cache-serve` and a second fresh process hits every graph (on a local store
and on SeaweedFS, and side by side with a real redis-server); use_farm_cache hits without building
a kernel, refuses unsigned or tampered entries, compiles each key once across ranks, and outlives
an endpoint or store that goes down. (The endpoint itself: tests/test_cache_endpoint.py.)"""
from __future__ import annotations

import concurrent.futures
import getpass
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from storage import store_from_uri
from tests.cache_endpoint import READER, WRITER, serve
from tests.sockets import accepts, free_port
from workers.backends.kernels import probes_in

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def built_kernels(tmp_path_factory) -> Path:
    """An Inductor cache dir whose C++ kernels (and ISA probes) the processes that use it share."""
    return tmp_path_factory.mktemp("inductor-kernels")


def _jit_step(url: str | None = None, kernels: Path | None = None, **env: str) -> dict:
    """tests/jit_step.py in a fresh process with an empty local Inductor cache: its remote caches
    set by the environment alone (`url`), or the farm's through use_farm_cache (FARM_CACHE_*).
    Its stderr is kept as "stderr". With `kernels` (built_kernels), that cache dir, its FX graph
    and AOTAutograd caches emptied first: the process misses or hits those as a fresh one does,
    and loads the C++ kernels an earlier one built instead of running g++ again (seconds each), for
    tests about what the remote caches hold, not about kernel builds."""
    cache = kernels or Path(os.environ.get("TMPDIR", "/tmp")) / f"jit-cache-{os.getpid()}-{time.monotonic_ns()}"
    for local in ("fxgraph", "aotautograd") if kernels else ():  # torch's local caches of these kinds
        shutil.rmtree(kernels / local, ignore_errors=True)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("FARM_SIGNING", "FARM_VERIFY"))},
           "TORCHINDUCTOR_CACHE_DIR": str(cache), **env}
    if url is not None:
        env.update(TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE="1", TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE="1",
                   TORCHINDUCTOR_REDIS_URL=url)
    try:
        out = subprocess.run([sys.executable, str(ROOT / "tests" / "jit_step.py")], env=env, capture_output=True,
                             text=True, timeout=300, stdin=subprocess.DEVNULL, cwd=ROOT)
    finally:
        if kernels is None:
            shutil.rmtree(cache, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "stderr": out.stderr}


def _fill_then_hit(url_writer: str, url_reader: str, kernels: Path) -> tuple[dict, dict]:
    cold = _jit_step(url_writer, kernels)
    warm = _jit_step(url_reader, kernels)
    assert cold["inductor"].get("fxgraph_cache_miss", 0) >= 2 and cold["aot_autograd"].get("autograd_cache_saved") == 1
    # every graph (forward and backward) from the remote cache, none compiled; the same gradients
    assert warm["inductor"].get("fxgraph_cache_hit") == cold["inductor"]["fxgraph_cache_miss"], warm
    assert "fxgraph_cache_miss" not in warm["inductor"] and warm["aot_autograd"].get("autograd_cache_hit") == 1, warm
    assert warm["grads"] == cold["grads"]
    return cold, warm


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "s3", "redis-server"])
def test_stock_torch_fills_the_cache_and_a_fresh_process_hits_every_graph(backend, tokens, tmp_path, request,
                                                                          built_kernels):
    """The farm's endpoint on a local store and on SeaweedFS, and Debian's redis-server beside them:
    torch's counters must say the same of each (`_fill_then_hit`), which shows we speak what torch
    expects, not what we assumed."""
    if backend == "redis-server":
        _beside_a_real_redis(built_kernels)
        return
    uri = str(tmp_path / "store") if backend == "local" else request.getfixturevalue("s3_uri")
    server = serve(uri, tokens)
    try:
        _fill_then_hit(f"redis://ci:{WRITER}@127.0.0.1:{server.port}", f"redis://alice:{READER}@127.0.0.1:{server.port}",
                       built_kernels)
        stats = server.entries.stats()
    finally:
        server.stop()
    assert stats["fx-graph-v1"]["writes"] >= 2 and stats["fx-graph-v1"]["hits"] >= 2
    store = store_from_uri(uri)
    assert any(p.startswith("remote-cache/fx-graph-v1/") for p in store.backend.list("remote-cache/"))


def _beside_a_real_redis(kernels: Path) -> tuple[dict, dict]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("Debian's redis-server is not installed (./dev installs it where it runs as root)")
    port = free_port()
    redis = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not accepts(port):
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.1)
        return _fill_then_hit(f"redis://127.0.0.1:{port}", f"redis://127.0.0.1:{port}", kernels)
    finally:
        redis.kill()


@pytest.mark.slow
def test_use_farm_cache_hits_build_no_kernel_and_refuses_unsigned_or_tampered_entries(tokens, tmp_path, monkeypatch,
                                                                                       built_kernels):
    from storage.signing import keygen

    signing, verify = keygen(tmp_path / "keys")
    store = str(tmp_path / "store")
    monkeypatch.setenv("FARM_SIGNING_KEY", str(signing))  # the endpoint signs what its writers put
    server = serve(store, tokens)
    monkeypatch.delenv("FARM_SIGNING_KEY")
    url = f"redis://{{}}@127.0.0.1:{server.port}"
    try:  # CI with a write token, then a training job with a read token and the farm's public key
        cold = _jit_step(FARM_CACHE_URL=url.format(f"ci:{WRITER}"), FARM_CACHE_WRITE="1")
        fresh = tmp_path / "fresh-machine-tmp"  # no precompiled header of Inductor's there yet
        fresh.mkdir()
        warm = _jit_step(FARM_CACHE_URL=url.format(f"alice:{READER}"), FARM_CACHE_WRITE="0", FARM_VERIFY_KEY=str(verify),
                         TMPDIR=str(fresh))
    finally:
        server.stop()
    assert cold["kernels_built"] > 0 and cold["farm"]["writes"] == 3 and cold["farm"].get("hits", 0) == 0
    # no g++ at all: kernels and probes shipped, and no precompiled header built for kernels it never builds
    assert warm["kernels_built"] == 0 and warm["grads"] == cold["grads"], warm
    assert list((fresh / f"torchinductor_{getpass.getuser()}" / "precompiled_headers").glob("*.gch")) == []
    assert warm["inductor"].get("fxgraph_cache_hit") == 2 and warm["aot_autograd"].get("autograd_cache_hit") == 1
    assert warm["farm"]["hits"] == 3 and warm["farm"]["kernels_installed"] > 0 and warm["farm"]["probes_installed"] > 0

    entries = store_from_uri(store).backend
    fx, autograd = (sorted(p for p in entries.list(f"remote-cache/{kind}/") if p.endswith(".json"))
                    for kind in ("fx-graph-v1", "autograd-experimental"))
    tampered = json.loads(entries.read(fx[0]))
    tampered["writer"] = "someone else"  # any edit breaks the signature
    entries.write(fx[0], json.dumps(tampered).encode())
    unsigned = json.loads(entries.read(autograd[0]))
    del unsigned["signature"]
    entries.write(autograd[0], json.dumps(unsigned).encode())
    # refused, so compiled here: its kernels may come from the local cache (what is asked is what it refused)
    checked = _jit_step(kernels=built_kernels, FARM_CACHE_STORE=store, FARM_CACHE_WRITE="0", FARM_VERIFY_KEY=str(verify))
    assert checked["farm"]["refused"] == 2 and checked["grads"] == cold["grads"]  # compiled here instead
    assert checked["aot_autograd"].get("autograd_cache_miss") == 1 and checked["inductor"].get("fxgraph_cache_miss", 0) >= 1
    refusals = [line for line in checked["stderr"].splitlines() if "farm cache: refused" in line]
    assert any(tampered["key"][:60] in line and "signature" in line for line in refusals), refusals
    assert any(unsigned["key"][:60] in line and "unsigned" in line for line in refusals), refusals


@pytest.mark.slow
def test_four_ranks_that_start_cold_at_once_compile_each_key_once(tmp_path):
    store = str(tmp_path / "store")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        ranks = list(pool.map(lambda _: _jit_step(FARM_CACHE_STORE=store), range(4)))
    # one lease per key, each taken once: the ISA probes, the two FX graphs and the AOTAutograd entry
    assert sum(r["farm"].get("leases", 0) for r in ranks) == 4, [r["farm"] for r in ranks]
    assert sum(r["inductor"].get("fxgraph_cache_miss", 0) for r in ranks) == 2  # forward and backward, once
    assert sum(r["aot_autograd"].get("autograd_cache_miss", 0) for r in ranks) == 1
    waited = [r for r in ranks if not r["inductor"].get("fxgraph_cache_miss")]
    assert len(waited) == 3 and all(r["farm"]["waited_hits"] >= 1 and r["kernels_built"] == 0 for r in waited), \
        [r["farm"] for r in waited]
    assert len({r["grads"] for r in ranks}) == 1
    # a rank with another setting (one OpenMP thread: Inductor keys its CPU graphs by the thread count)
    import torch

    theirs = torch.get_num_threads()  # what the ranks above ran with (this machine's default)
    ours = 1 if theirs != 1 else 2
    other = _jit_step(FARM_CACHE_STORE=store, OMP_NUM_THREADS=str(ours))
    assert other["inductor"]["fxgraph_cache_miss"] == 2 and other["farm"]["misses_explained"] == 2
    said = [line for line in other["stderr"].splitlines() if "is not in the farm" in line]
    assert len(said) == 2 and all(f"differ in cpp_runtime_thread_count: '{ours}' here, '{theirs}' there" in line
                                  for line in said), said


def test_use_farm_cache_refuses_a_token_the_endpoint_refused_at_once_and_outlives_an_endpoint_that_is_down(
        tokens, tmp_path, monkeypatch, caplog):
    """A wrong token, or a reader's given to write, is the caller's to fix: said as use_farm_cache
    starts, without the token (a server from before FARM.WHOAMI cannot say a reader's role: that is
    logged, and the writer writes as asked). A server that does not answer is an outage: said once, lookups are misses (torch compiles), and
    it is asked again (every RETRY_S, here at once) until it answers."""
    from torch._inductor.remote_cache import RemoteFxGraphCache

    from farm import jit_sources
    from farm.client import use_farm_cache
    from storage.remote_cache import remote_key

    server = serve(str(tmp_path / "store"), tokens)
    port = server.port
    try:
        for url, write, said in ((f"redis://alice:{WRITER}@127.0.0.1:{port}", None, "refused user 'alice'.*tokens file"),
                                 (f"redis://127.0.0.1:{port}", None, "asks for a user.*redis://NAME:TOKEN@HOST:PORT"),
                                 (f"redis://alice:{READER}@127.0.0.1:{port}", True, "lets user 'alice' only read"),
                                 (f"http://alice:{WRITER}@127.0.0.1:{port}", True, "not a `farm cache-serve` address")):
            with pytest.raises(ValueError, match=said) as refused:
                use_farm_cache(url=url, write=write)
            assert WRITER not in str(refused.value) and READER not in str(refused.value)
        assert use_farm_cache(url=f"redis://ci:{WRITER}@127.0.0.1:{port}", write=True).close() is None
    finally:
        server.stop()
    older = serve(str(tmp_path / "store"), tokens)  # a server from before FARM.WHOAMI: the role cannot be asked
    answer = older._answer

    async def before_whoami(args, session):
        return await answer([b"FARM.WHOAMI-UNKNOWN", *args[1:]] if args[0].upper() == b"FARM.WHOAMI" else args, session)

    monkeypatch.setattr(older, "_answer", before_whoami)
    caplog.set_level(logging.WARNING, logger="farm.jit_cache")
    try:
        use_farm_cache(url=f"redis://alice:{READER}@127.0.0.1:{older.port}", write=True).close()  # writes, as asked
        assert "older than this client and cannot say whether user 'alice' may write" in caplog.text
        assert READER not in caplog.text
    finally:
        older.stop()
        caplog.clear()
    monkeypatch.setattr(jit_sources, "RETRY_S", 0.0)
    caplog.set_level(logging.WARNING, logger="farm.jit_cache")
    cache = use_farm_cache(url=f"redis://alice:{READER}@127.0.0.1:{port}")  # nothing answers there now
    try:
        backend = RemoteFxGraphCache.backend_override_cls()
        keys = [remote_key("fx-graph-v1", f"k{i}") for i in range(3)]
        assert [backend.get(k) for k in keys] == [None] * 3 and cache.stats() == {"errors": 3}
        outage = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
        assert len(outage) == 1 and f"127.0.0.1:{port} failed (ConnectionError" in outage[0], outage
        assert READER not in caplog.text
        server = serve(str(tmp_path / "store"), tokens, port=port)  # back: a miss is a miss again
        try:
            assert backend.get(keys[0]) is None and cache.stats() == {"errors": 3, "misses": 1}
            assert "answers again" in caplog.text
        finally:
            server.stop()
    finally:
        cache.close()


class _GoesDown:
    """A local store's backend that fails every call while `down` (an S3 endpoint gone away)."""

    def __init__(self, inner):
        self.inner, self.down = inner, False

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            if self.down:
                from storage.backend import StoreError

                raise StoreError(f"{name}: the store does not answer")
            return attr(*args, **kwargs)
        return call


def test_a_writer_whose_store_goes_down_compiles_without_it_and_says_so_once(tmp_path, monkeypatch, caplog):
    """store= with leases (a writer): lookups, waits and puts while the store fails are misses and
    skipped puts, not torch's errors; one warning for the outage, and one as it answers again."""
    from torch._inductor.remote_cache import RemoteFxGraphCache

    from farm import jit_sources
    from farm.client import use_farm_cache
    from storage import Store
    from storage.remote_cache import remote_key

    monkeypatch.setattr(jit_sources, "RETRY_S", 0.5)
    caplog.set_level(logging.WARNING, logger="farm.jit_cache")
    backend = _GoesDown(store_from_uri(str(tmp_path / "store")).backend)
    cache = use_farm_cache(store=Store(backend), write=True)
    try:
        remote = RemoteFxGraphCache.backend_override_cls()
        key = remote_key("fx-graph-v1", "k0")
        backend.down = True
        assert remote.get(key) is None and remote.get(key) is None  # the second not even asked
        remote.put(key, b"entry")  # skipped: torch compiled it, and goes on
        assert cache.stats() == {"errors": 2, "puts_skipped": 1} and not cache._held  # no lease on a store that is down
        assert len([r for r in caplog.records if "does not answer" in r.getMessage()]) == 1, caplog.text
        backend.down = False
        time.sleep(0.6)  # RETRY_S later: asked again
        assert remote.get(key) is None and cache.stats() == {"errors": 2, "puts_skipped": 1, "misses": 1, "leases": 1}
        remote.put(key, b"entry")
        assert "answers again" in caplog.text and cache.stats()["writes"] == 1 and not cache._held
    finally:
        cache.close()


# Which vector ISA Inductor would use in a process with use_farm_cache (no `isa=`): argv store;
# and whether use_farm_cache worked out the ISAs before Inductor asked.
PICKED_ISA = """
import json, sys
from torch._inductor import cpu_vec_isa
from farm.client import use_farm_cache
farm = use_farm_cache(store=sys.argv[1], write=False)
early = "vec_isas" in farm.setup_s
print(json.dumps([str(cpu_vec_isa.pick_vec_isa()), early, "vec_isas" in farm.setup_s]))
"""


def test_use_farm_cache_takes_inductors_isas_from_the_hosts_record_without_checking_them_again(tmp_path):
    """Inductor checks each vector ISA by loading a probe in a fresh Python, in every process (about
    a second): use_farm_cache asks once per host (its record in the node's dir, here a fresh one:
    FARM_NODE_CACHE) instead, and only once Inductor asks: a process whose steps all run on a GPU
    never does, and never builds or loads a probe."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "FARM_NODE_CACHE": str(tmp_path / "node")}

    def picked() -> str:
        out = subprocess.run([sys.executable, "-c", PICKED_ISA, str(tmp_path / "store")], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        assert out.returncode == 0, out.stderr[-3000:]
        isa, early, asked = json.loads(out.stdout.strip().splitlines()[-1])
        assert not early and asked, "use_farm_cache worked out the vector ISAs before Inductor asked"
        return isa

    first = picked()  # Inductor's own answer, now the host's record
    if first == "INVALID_VEC_ISA":
        pytest.skip("Inductor finds no vector ISA on this host")
    (record,) = (tmp_path / "node").rglob("farm-host-checks/inductor-host-*.json")
    assert first in json.loads(record.read_text())["vec_isas"]
    record.write_text(json.dumps({**json.loads(record.read_text()), "vec_isas": []}))  # a host that runs none
    assert picked() == "INVALID_VEC_ISA"  # the record's answer, not a check of Inductor's own


# A graph with no CPU kernel of Inductor's own (one extern matmul: what a GPU step's graphs hold for
# the CPU) through use_farm_cache: argv store, write; prints the product, its steps and counts.
NO_CPU_KERNEL = """
import json, sys, torch
from farm.client import use_farm_cache
farm = use_farm_cache(store=sys.argv[1], write=sys.argv[2] == "1")
torch.manual_seed(0)
out = torch.compile(lambda a, b: a @ b)(torch.randn(8, 8), torch.randn(8, 8))
print(json.dumps([out.sum().item(), farm.setup_s, farm.stats()]))
"""


def test_a_process_whose_graphs_hold_no_cpu_kernel_writes_and_reads_them_without_isa_probes(tmp_path):
    """Inductor's ISA probes (a g++ build of the vector headers each: 55 s of a writer's 80 s on a
    lent H100, where the same step without the farm built none) are the farm's business only
    where a graph has CPU kernels: the writer of one without any neither builds nor publishes
    them, and a reader hits it without any."""
    def run(write: str) -> tuple[float, dict, dict, list[str]]:
        inductor = tmp_path / f"inductor-{write}"
        out = subprocess.run([sys.executable, "-c", NO_CPU_KERNEL, str(tmp_path / "store"), write], cwd=ROOT,
                             env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor)},
                             capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        assert out.returncode == 0, out.stderr[-3000:]
        value, steps, stats = json.loads(out.stdout.strip().splitlines()[-1])
        return value, steps, stats, sorted(probes_in(inductor))

    written, steps, stats, built = run("1")
    assert stats.get("writes", 0) >= 1 and "vec_isas" not in steps and built == []
    read, steps, stats, built = run("0")
    assert read == written and stats.get("hits", 0) >= 1 and not stats.get("misses")
    assert "vec_isas" not in steps and built == []
