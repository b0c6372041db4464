"""Training steps compiled once on the farm: a fresh process (empty Inductor cache) starts
training from the farm's artifact with no compile, and gets eager's gradients."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from farm.client import WarmStartError, warm_start
from scheduler.jobs import execute
from scheduler.spec import parse_job
from storage import store_from_uri
from workers.backends import LoweringError, resolve
from workers.unit import Target

pytestmark = pytest.mark.slow

TARGET = "inductor-cache:avx2+train"
PRECOMPILED = "aot-compile:avx2+train"


@pytest.fixture(scope="module")
def both(zoo_dir, tmp_path_factory):
    """The smoke MLP's training step compiled by the farm into a local store, as a bundle and as
    precompiled functions."""
    d = tmp_path_factory.mktemp("train")
    store = store_from_uri(str(d / "store"))
    job = {"graphs": [str(zoo_dir / "mlp.pt2")], "targets": [TARGET, PRECOMPILED]}
    results = {r.target: r for r in execute(parse_job(job), store).results}
    for r in results.values():
        assert r.status == "compiled", r.error
    return d, store, results


@pytest.fixture(scope="module")
def trained(both):
    d, store, results = both
    return d, store, results[TARGET]


def test_the_manifest_says_what_autograd_decided_and_the_step_was_verified_and_timed(trained):
    _, store, r = trained
    facts = store.get_manifest(r.key)["artifact"]
    assert facts["mode"] == "train" and facts["grad_mode"] == "enabled"
    assert facts["graphs"]["forward"] == facts["graphs"]["backward"] >= 1
    assert facts["saved_for_backward"]["tensors"] >= 1 and facts["saved_for_backward"]["bytes"] > 0
    assert facts["kernels"] >= 2  # the forward's and the backward's, at least
    assert facts["randomness"] == {"ops": [], "verified_with": None}
    assert r.metrics["max_abs_err"] < 1e-4 and r.metrics["eager_ms"] > 0 and r.metrics["compiled_ms"] > 0
    assert r.target == TARGET


# A training script on a fresh machine: argv program, store, target (a GPU target trains on the GPU).
TRAIN_SCRIPT = """
import json, sys, torch
from torch._dynamo.utils import counters
from torch.export.passes import move_to_device_pass
from farm.client import warm_start
from workers.backends import kernels
from workers.check.inputs import input_sets
from workers.check.train import verify_training
program, store, target, extra = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
device = "cuda" if target.split(":")[-1].startswith(("sm_", "cuda")) else "cpu"
import subprocess
spawned, popen = [], subprocess.Popen.__init__
subprocess.Popen.__init__ = lambda self, args, *a, **k: spawned.append(str(args)[:300]) or popen(self, args, *a, **k)
model = warm_start(program, store=store, target=target, mode="train")
subprocess.Popen.__init__ = popen
ep = torch.export.load(program)
eager = (move_to_device_pass(ep, device) if device == "cuda" else ep).module()
sets = [s.to(device) for s in input_sets(ep, extra)]
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with kernels.counting_builds() as built:
    report = verify_training(eager, model, sets, 1e-4, 1e-4)
    for s in sets * 2:  # the training loop a user writes
        loss = model(*s.args).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
model.load_state_dict(eager.state_dict())  # a checkpoint, by the model's own names
print(json.dumps({"inductor": dict(counters["inductor"]), "aot": dict(counters["aot_autograd"]), "builds": built,
                  "pythons_at_load": [a for a in spawned if sys.executable in a],
                  "misses": getattr(model, "farm_bundle_misses", None), "ok": report.ok, "problems": report.problems, "checked": report.checked,
                  "names": [n for n, _ in model.named_parameters()], "eager_names": [n for n, _ in eager.named_parameters()]}))
"""


def train_in_fresh_process(program: Path, store: Path, target: str, tmp_path: Path, extra_sizes: int = 2,
                           threads: int = 1, prelude: str = "", env: dict[str, str] | None = None) -> dict:
    """TRAIN_SCRIPT's report, run where Inductor's and Triton's caches are empty (a machine that never compiled it),
    on `threads` threads (by default another count than the farm's worker: a rank's share of a bigger host),
    after the script's own lines `prelude`, with `env` added to this process's environment."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "fresh"), "TRITON_CACHE_DIR": str(tmp_path / "triton"),
           "OMP_NUM_THREADS": str(threads), **(env or {})}
    proc = subprocess.run([sys.executable, "-c", prelude + TRAIN_SCRIPT, str(program), str(store), target, str(extra_sizes)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_fresh_process_trains_from_the_bundle_without_compiling(trained, zoo_dir, tmp_path):
    d, store, r = trained
    # on a CI runner: `CI` turns an AOTAutograd setting on by default, and the farm's sandbox, which
    # passes no `CI`, compiled with it off; the bundle's settings are held instead
    # …on a machine whose /tmp lacks Inductor's precompiled header too (made only for a kernel that is built)
    (tmp_path / "tmp").mkdir()
    got = train_in_fresh_process(zoo_dir / "mlp.pt2", d / "store", "inductor-cache:avx2", tmp_path,
                                 env={"CI": "true", "TMPDIR": str(tmp_path / "tmp")})
    shipped = sorted(m.name for m in tarfile.open(store.fetch(r.artifact.digest, tmp_path / "bundle.tar")).getmembers())
    # no kernel compiled: the bundle's binaries were used
    assert got["builds"] == [], {"misses": got["misses"], "shipped": shipped, "inductor": got["inductor"], "aot": got["aot"]}
    assert got["pythons_at_load"] == []  # nor a fresh Python to load Inductor's ISA probe: the CPU's flags say it runs avx2
    assert got["misses"] == []
    assert got["inductor"].get("fxgraph_cache_miss", 0) == 0 and got["inductor"].get("fxgraph_cache_hit", 0) >= 2
    assert got["aot"].get("autograd_cache_miss", 0) == 0 and got["aot"].get("autograd_cache_hit", 0) >= 1
    assert got["ok"], got["problems"]
    assert len(got["checked"]) >= 2  # the example size and another inside the dynamic range
    assert got["names"] == got["eager_names"]  # no _orig_mod. prefix: checkpoints and optimizers just work


# A training script that never exports: plain torch.compile of the module, its caches on the farm.
JIT_TRAIN_SCRIPT = """
import json, sys, torch
from torch._dynamo.utils import counters
from farm.client import use_farm_cache
from workers.backends import kernels
from workers.check.inputs import input_sets
farm = use_farm_cache(store=sys.argv[2], write=False, isa=sys.argv[3])
ep = torch.export.load(sys.argv[1])
model, eager = ep.module(), ep.module()
step = torch.compile(model)
with kernels.counting_builds() as built:
    for s in input_sets(ep):
        step(*s.args).sum().backward()
        eager(*s.args).sum().backward()
same = all(torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-4) for a, b in zip(model.parameters(), eager.parameters()))
print(json.dumps({"inductor": dict(counters["inductor"]), "aot": dict(counters["aot_autograd"]), "builds": built,
                  "farm": farm.stats(), "grads_equal": same}))  # within the farm's own verification tolerance
"""


def test_a_jit_training_script_hits_what_the_farms_training_unit_fed_and_builds_nothing(trained, zoo_dir, tmp_path):
    d, store, r = trained
    isa = store.get_manifest(r.key)["artifact"]["isa"]
    fresh = tmp_path / "tmp"  # a machine that never compiled: not even Inductor's precompiled header
    fresh.mkdir()
    # Inductor's settings as torch leaves them, but for the ISA use_farm_cache pins; `CI` as the README says
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR_")}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "fresh"), TMPDIR=str(fresh), TORCHINDUCTOR_ERROR_ON_CUSTOM_OP_ALIASING="0")
    proc = subprocess.run([sys.executable, "-c", JIT_TRAIN_SCRIPT, str(zoo_dir / "mlp.pt2"), str(d / "store"), isa],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["inductor"].get("fxgraph_cache_miss", 0) == 0 and got["inductor"].get("fxgraph_cache_hit", 0) >= 2, \
        [line for line in proc.stderr.splitlines() if "farm cache" in line]
    assert got["aot"].get("autograd_cache_miss", 0) == 0 and got["aot"].get("autograd_cache_hit", 0) >= 1
    assert got["builds"] == [] and got["farm"]["kernels_installed"] > 0 and got["grads_equal"]


def test_a_process_that_misses_the_bundle_says_which_setting_differs(trained, zoo_dir, tmp_path):
    d, _, _ = trained
    # settings the pin leaves alone, chosen in the training script: part of every graph's key
    got = train_in_fresh_process(zoo_dir / "mlp.pt2", d / "store", "inductor-cache:avx2", tmp_path,
                                 prelude="import torch._inductor.config, torch._functorch.config\n"
                                         "torch._inductor.config.size_asserts = False\n"
                                         "torch._functorch.config.donated_buffer = False\n")
    assert got["builds"] and got["aot"].get("autograd_cache_miss", 0) >= 1  # it compiled
    assert len(got["misses"]) == got["aot"]["autograd_cache_miss"], got["misses"]
    for why in got["misses"]:
        assert why.endswith("differs from the closest key the bundle was built with in: "
                            "autograd_config[donated_buffer], inductor_config[size_asserts]"), why
    assert got["ok"], got["problems"]


def test_a_fresh_process_trains_from_the_precompiled_function_without_compiling(both, zoo_dir, tmp_path):
    d, store, results = both
    facts = store.get_manifest(results[PRECOMPILED].key)["artifact"]
    assert facts["shapes"] == "static" and facts["sizes"] == ["example"] and facts["kernels"] >= 2
    assert facts["saved_for_backward"]["bytes"] > 0 and facts["torch_threads"] >= 1
    # Dynamo's guards hold a precompiled function to the thread count it was compiled under
    got = train_in_fresh_process(zoo_dir / "mlp.pt2", d / "store", "aot-compile:avx2", tmp_path, extra_sizes=0,
                                 threads=facts["torch_threads"])
    assert got["builds"] == [] and got["ok"], got["problems"]
    assert got["pythons_at_load"] == []  # warm_start started no Python (Inductor's ISA probe) either
    assert got["inductor"].get("fxgraph_cache_miss", 0) == 0 and got["aot"].get("autograd_cache_miss", 0) == 0
    assert got["names"] == got["eager_names"]


def test_a_precompiled_function_refuses_a_size_it_was_not_built_for(both, zoo_dir, tmp_path):
    d, store, results = both
    artifact = store.fetch(results[PRECOMPILED].artifact.digest, tmp_path / "precompiled.tar")
    target = Target("aot-compile", isa="avx2", mode="train")
    model = resolve(target).load(artifact, target, torch.export.load(str(zoo_dir / "mlp.pt2")))
    model(torch.randn(8, 32)).sum().backward()  # the example's size
    with pytest.raises(ValueError, match="static shapes, built for example"):
        model(torch.randn(3, 32))
    built_on, ours = store.get_manifest(results[PRECOMPILED].key)["artifact"]["torch_threads"], torch.get_num_threads()
    torch.set_num_threads(built_on + 1)  # a process with another thread count: a clear refusal, not a size mismatch
    try:
        with pytest.raises(ValueError, match=rf"get_num_threads\(\) == {built_on}.*set_num_threads\({built_on}\)"):
            model(torch.randn(8, 32))
    finally:
        torch.set_num_threads(ours)


def test_a_bundle_without_its_backward_is_refused(zoo_dir, monkeypatch, tmp_path):
    import workers.check.train as train

    monkeypatch.setattr(train, "step", lambda module: module)  # forward only: the backward is never compiled
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))  # a cache hit would bring the backward
    ep = torch.export.load(str(zoo_dir / "mlp.pt2"))
    target = Target("inductor-cache", isa="avx2", mode="train")
    with pytest.raises(LoweringError, match="without its backward"):
        resolve(target).lower(ep, target, tmp_path)


def _with_facts(artifact: Path, out: Path, change) -> Path:
    """The artifact with its facts.json changed (as if built on another machine)."""
    with tarfile.open(artifact) as src, tarfile.open(out, "w") as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read()
            if m.name == "facts.json":
                facts = json.loads(data)
                change(facts)
                data = json.dumps(facts).encode()
                m.size = len(data)
            dst.addfile(m, io.BytesIO(data))
    return out


def test_a_consumer_with_another_build_command_is_refused_before_it_compiles(trained, zoo_dir, tmp_path):
    _, store, r = trained
    artifact = store.fetch(r.artifact.digest, tmp_path / "bundle.tar")

    def other_compiler(facts):
        facts["build_command"][0] = "clang++-17"

    other = _with_facts(artifact, tmp_path / "other.tar", other_compiler)
    target = Target("inductor-cache", isa="avx2", mode="train")
    ep = torch.export.load(str(zoo_dir / "mlp.pt2"))
    with pytest.raises(LoweringError, match="another command") as e:
        resolve(target).load(other, target, ep)
    assert "clang++-17" in str(e.value) and "compile every kernel again" in str(e.value)
    assert "same compiler" in str(e.value)

    def other_cpu(facts):  # built where Inductor found avx512_bf16, which pinned builds leave out
        facts["build_command"].append("-mavx512bf16")

    with pytest.raises(LoweringError, match="another command") as e:
        resolve(target).load(_with_facts(artifact, tmp_path / "other-cpu.tar", other_cpu), target, ep)
    assert "-mavx512bf16" in str(e.value) and "other features in this CPU" in str(e.value)


def test_warm_start_reports_a_miss_and_what_to_run(trained, zoo_dir):
    d, _, _ = trained
    with pytest.raises(WarmStartError) as e:
        warm_start(zoo_dir / "cnn.pt2", store=str(d / "store"))  # never compiled for training
    message = str(e.value)
    assert "no inductor-cache+train artifact" in message and "farm compile" in message and "cnn.pt2" in message
    with pytest.raises(WarmStartError, match="has no train mode"):
        warm_start(zoo_dir / "mlp.pt2", store=str(d / "store"), target="aoti-cpu")



def test_warm_start_of_a_program_with_its_own_output_type_says_to_import_it_or_name_it(tmp_path):
    exported = tmp_path / "custom.pt2"
    subprocess.run([sys.executable, "-c", "import sys, torch; from tests.custom_output import Net; "
                    f"torch.export.save(torch.export.export(Net(), (torch.randn(2, 4),)), {str(exported)!r})"],
                   check=True, cwd=Path(__file__).resolve().parents[1])
    assert "tests.custom_output" not in sys.modules  # this process never registered the output type
    (tmp_path / "store").mkdir()  # a store, without the artifact
    with pytest.raises(Exception, match=r"to modules=\[\.\.\.\] of warm_start, or import it") as e:
        warm_start(exported, store=str(tmp_path / "store"))
    assert "job" not in str(e.value)  # a warm_start caller has no job
    with pytest.raises(WarmStartError, match="no inductor-cache\\+train artifact"):  # read: only the miss is left
        warm_start(exported, store=str(tmp_path / "store"), modules=["tests.custom_output"])
    with pytest.raises(WarmStartError, match="no store at .*typo: no such directory; name the store"):
        warm_start(exported, store=str(tmp_path / "typo"), modules=["tests.custom_output"])
    assert not (tmp_path / "typo").exists()  # a mistyped store is said, not made

class _Dropout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.fc(x))


def test_random_ops_are_verified_with_comparable_randomness_or_refused(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "dropout.pt2"
    torch.export.save(torch.export.export(_Dropout().train(), (torch.randn(4, 8),)), str(path))
    store = store_from_uri(str(tmp_path / "store"))
    job = parse_job({"graphs": [str(path)], "targets": [TARGET, {"backend": "inductor-cache", "isa": "avx2", "mode": "train",
                                                                  "options": {"fallback_random": True}}]})
    refused, seeded = execute(job, store).results
    assert refused.status == "failed" and "fallback_random" in refused.error and "dropout" in refused.error, refused.error
    assert refused.failed_in == "lower"  # refused before anything was compiled
    assert seeded.status == "compiled", seeded.error
    randomness = store.get_manifest(seeded.key)["artifact"]["randomness"]
    assert randomness["verified_with"] == "fallback_random" and randomness["ops"]


class _Broadcasting(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        return funcol.broadcast(self.fc(x), 0, dist.group.WORLD)


def test_a_training_step_through_a_collective_autograd_cannot_differentiate_is_refused_naming_it(tmp_path):
    from tests.gang_models import fake_group

    with fake_group(0, 2):
        ep = torch.export.export(_Broadcasting(), (torch.randn(4, 8),))
    torch.export.save(ep, str(tmp_path / "tp.pt2"))
    job = parse_job({"graphs": [str(tmp_path / "tp.pt2")], "targets": [TARGET]})
    (r,) = execute(job, store_from_uri(str(tmp_path / "store"))).results
    assert r.status == "failed" and r.failed_in == "lower", r.error
    assert "_c10d_functional.broadcast" in r.error and "cannot differentiate" in r.error
