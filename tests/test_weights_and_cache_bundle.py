"""Two artifacts a user may ask for besides a per-checkpoint package: one compile shared by
every checkpoint of an architecture, and a torch.compile cache bundle for serving."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from farm.client import load_compiled
from farm.zoo import ZOO
from scheduler.jobs import execute
from scheduler.spec import parse_job
from storage import store_from_uri
from workers.sandbox import compiler_cache
from workers.sandbox.program import load_program, program_identity

pytestmark = pytest.mark.slow


def _checkpoint(seed: int, path) -> torch.export.ExportedProgram:
    """The smoke CNN trained differently: other weights and other BatchNorm statistics. Its
    BatchNorm has 8 channels, small enough that Inductor would inline them as literals."""
    spec = ZOO["cnn"]
    torch.manual_seed(seed)
    model = spec.build().eval()
    with torch.no_grad():
        for b in model.buffers():
            if b.is_floating_point():
                b.uniform_(0.5, 1.5)
    args, kwargs = spec.example()
    ep = torch.export.export(model, args, kwargs, dynamic_shapes=spec.dynamic())
    torch.export.save(ep, str(path))
    return ep


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    a, b = _checkpoint(1, d / "cnn_a.pt2"), _checkpoint(2, d / "cnn_b.pt2")
    store = store_from_uri(str(d / "store"))
    job = parse_job({"graphs": [str(d / "cnn_a.pt2"), str(d / "cnn_b.pt2")], "targets": ["aoti-cpu"], "weights": "shapes"})
    return d, a, b, store, execute(job, store)


def test_two_checkpoints_share_one_compile(two_checkpoints):
    _, _, _, store, outcome = two_checkpoints
    first, second = outcome.results
    assert (first.status, second.status) == ("compiled", "hit"), (first.error, second.error)
    assert first.key == second.key
    manifest = store.get_manifest(first.key)
    assert manifest["weights"]["mode"] == "shapes"
    assert manifest["components"]["program"]["weights_mode"] == "shapes"
    # the hit was checked with its own weights before being called one
    assert second.metrics["weights_swapped"] == 1.0 and second.metrics["max_abs_err"] < 1e-4
    assert outcome.stats.hit_rate == 0.5 and outcome.stats.saved_s > 0


def test_the_shared_artifact_runs_with_the_other_checkpoint(two_checkpoints, tmp_path):
    d, a, b, store, outcome = two_checkpoints
    path = store.fetch(outcome.results[0].artifact.digest, tmp_path / "cnn.pt2")
    x = torch.randn(5, 3, 16, 16)  # a batch size neither was exported with
    assert (a.module()(x) - b.module()(x)).abs().max() > 1e-2  # really different checkpoints
    compiled_b = load_compiled(path, weights_from=d / "cnn_b.pt2")
    torch.testing.assert_close(compiled_b(x), b.module()(x), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(load_compiled(path)(x), a.module()(x), atol=1e-4, rtol=1e-4)  # as built


@pytest.mark.skipif(compiler_cache.masquerade_dir() is None, reason="no ccache here (./dev installs Debian's ccache as root)")
def test_the_same_code_under_another_key_is_built_from_the_node_compiler_cache(two_checkpoints, tmp_path):
    """Another store (so another job's miss) lowering the same architecture: Inductor generates
    the same code, and the node's ccache serves what g++ built for the first store, which the
    unit's metrics and log say; the artifact still passes verification against its program."""
    d, _, b, _, _ = two_checkpoints
    store = store_from_uri(str(tmp_path / "store"))
    job = parse_job({"graphs": [str(d / "cnn_b.pt2")], "targets": ["aoti-cpu"], "weights": "shapes"})
    (result,) = execute(job, store).results
    assert result.status == "compiled", result.error
    assert result.metrics["compiler_cache_hits"] >= 1, result.metrics  # the wrapper, at least
    assert result.metrics["max_abs_err"] < 1e-4
    log = store.get_bytes(store.get_manifest(result.key)["blobs"]["log"]["digest"]).decode()
    assert "C++ compiles served from the node's ccache" in log


def test_values_mode_keeps_one_artifact_per_checkpoint(two_checkpoints):
    d = two_checkpoints[0]
    a, b = (program_identity(load_program(d / f"cnn_{n}.pt2", n)) for n in "ab")
    assert a["graph"] == b["graph"] and a["program"] != b["program"]
    shapes_a, shapes_b = (program_identity(load_program(d / f"cnn_{n}.pt2", n), weights_by_value=False) for n in "ab")
    assert shapes_a["program"] == shapes_b["program"] != a["program"]


_SERVE = """
import json, sys, torch
from torch._dynamo.utils import counters
from workers.check.inputs import input_sets
from workers.sandbox.program import load_program
bundle, program, config = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
farm = None
if bundle.startswith("farm:"):  # farm:ISA:STORE (ISA - for none), no bundle: the farm's store as torch's remote caches, read only
    from farm.client import use_farm_cache
    _, isa, store = bundle.split(":", 2)
    farm = use_farm_cache(store=store, write=False, isa=None if isa == "-" else isa)
elif bundle != "-":
    torch.compiler.load_cache_artifacts(open(bundle, "rb").read())
ep = load_program(program, program)
model = ep.module()
compiled = torch.compile(model)
worst = 0.0
with torch._inductor.config.patch(config), torch.no_grad():
    for s in input_sets(ep):
        worst = max(worst, (compiled(*s.args) - model(*s.args)).abs().max().item())
print(json.dumps({"inductor": dict(counters["inductor"]), "aot": dict(counters["aot_autograd"]), "worst": worst,
                  "farm": farm and farm.stats()}))
"""


def test_inductor_cache_bundle_gives_a_fresh_process_cache_hits(zoo_dir, tmp_path):
    store = store_from_uri(str(tmp_path / "store"))
    program = zoo_dir / "mlp.pt2"  # compiled by other tests too: the worker's Inductor cache may hold its graphs
    job = parse_job({"graphs": [str(program)], "targets": ["inductor-cache"]})
    (r,) = execute(job, store).results
    assert r.status == "compiled", r.error
    manifest = store.get_manifest(r.key)
    assert manifest["artifact"]["format"] == "torch-compile-cache-artifacts"
    bundle = store.fetch(r.artifact.digest, tmp_path / "bundle.bin")

    def serve(bundle_arg: str, cache: str, config: dict | None = None) -> subprocess.Popen:
        # a machine that never compiled it, with another core count than the farm's worker; and,
        # like the sandbox, no `CI`: AOTAutograd's keys hash a setting whose default it sets
        # (error_on_custom_op_aliasing), so a process that has it misses every AOTAutograd entry
        env = {**{k: v for k, v in os.environ.items() if k != "CI"},
               "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / cache), "OMP_NUM_THREADS": "1"}
        config = manifest["artifact"]["serving_config"] if config is None else config
        return subprocess.Popen([sys.executable, "-c", _SERVE, bundle_arg, str(program), json.dumps(config)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    said = {}

    def counts(proc: subprocess.Popen) -> dict:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        said[proc.pid] = err
        return {**json.loads(out.strip().splitlines()[-1]), "pid": proc.pid}

    # fresh processes at once: one loads the bundle; one finds the unit's graphs in the farm's store
    # as torch's remote caches (a JIT user: no bundle); and the control, with Inductor's default
    # settings, not the bundle's, compiles everything (the farm has its graphs under other keys)
    store_uri = tmp_path / "store"
    warm, cold, jit = (counts(p) for p in [serve(str(bundle), "fresh-1"), serve(f"farm:-:{store_uri}", "fresh-2", {}),
                                           serve(f"farm:{manifest['artifact']['isa']}:{store_uri}", "fresh-3")])
    assert warm["inductor"].get("fxgraph_cache_hit", 0) >= 2  # the static graph and the dynamic one
    assert warm["inductor"].get("fxgraph_cache_miss", 0) == 0 and warm["worst"] < 1e-4
    assert cold["inductor"].get("fxgraph_cache_miss", 0) >= 2 and cold["inductor"].get("fxgraph_cache_hit", 0) == 0
    # …and says why, from what the unit's sandbox recorded of its keys
    assert cold["farm"]["misses_explained"] >= 1, cold
    why = [line for line in said[cold["pid"]].splitlines() if "their keys differ in" in line]
    assert why and "cpp.march" in why[0], said[cold["pid"]][-2000:]
    assert jit["inductor"].get("fxgraph_cache_hit", 0) >= 2 and jit["inductor"].get("fxgraph_cache_miss", 0) == 0, jit
    assert jit["aot"].get("autograd_cache_hit", 0) >= 2 and jit["aot"].get("autograd_cache_miss", 0) == 0, jit
    assert jit["farm"]["hits"] >= 4 and jit["farm"]["kernels_installed"] >= 1 and jit["worst"] < 1e-4, jit
    fed = [line for line in store.get_bytes(r.log.digest).decode().splitlines() if "remote caches:" in line]
    assert fed and "FX graph and AOTAutograd entries of torch's own published" in fed[0], fed
