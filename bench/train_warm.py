"""A training job's first steps: compiled cold on the rank, against started from the farm, in one run.

For each smoke-zoo model, the farm first compiles its training step into a fresh local store, as
a bundle (`inductor-cache:avx2` in `mode: train`) and as precompiled functions (`aot-compile:avx2`).
Then, per target, two fresh processes run the same first N steps (forward + backward + SGD
step): for the bundle at the example size, at a second size that makes automatic dynamic shapes
compile the dynamic graph, and at the example size again; for the precompiled functions, whose
shapes are static, three times at the example size:

- cold: what a rank does without the farm, `ep.module().compile()` (Inductor's defaults);
- warm: `farm.client.warm_start(program, store)`, then the same steps.

Each has its own empty TORCHINDUCTOR_CACHE_DIR (a machine that never compiled the model); the
precompiled header in /tmp is whatever this host has, which can only help the cold side. Each
process times from after `import torch` to the end of its N-th step, and counts the kernel
binaries built (new .so files in its Inductor cache dir) and Inductor's and AOTAutograd's
cache misses.

    .venv/bin/python bench/train_warm.py [--models mlp cnn] [--targets inductor-cache:cuda]

On a GPU host, `--targets inductor-cache:cuda` (or `:sm_90`) runs both sides on the GPU, each with
its own empty TRITON_CACHE_DIR too; builds then count Inductor's CPU binaries only, and the
Triton kernels the warm side compiled are its Inductor misses.

Prints warm_first_steps / cold_first_steps per model and over all; the goal is at most 0.2
with 0 kernel compiles in the warm processes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TARGETS = ["inductor-cache:avx2", "aot-compile:avx2"]


def child(side: str, program: str, store: str, target: str) -> None:
    import torch

    t0 = time.perf_counter()
    from torch._dynamo.utils import counters

    from workers.backends import kernels
    from workers.backends.cuda_target import is_cuda_isa
    from workers.check.inputs import input_sets

    device = "cuda" if is_cuda_isa(target.partition(":")[2]) else "cpu"
    phases = {}  # where a process's time goes (on a GPU host the steps are not all of it)
    with kernels.counting_builds() as built:
        ep = torch.export.load(program)
        phases["imports, load"] = time.perf_counter() - t0
        if side == "warm":
            from farm.client import warm_start

            model = warm_start(ep, store=store, target=target, mode="train")
        else:
            from torch.export.passes import move_to_device_pass

            model = (move_to_device_pass(ep, device) if device != "cpu" else ep).module()
            model.compile()
        example, other = (s.to(device) for s in input_sets(ep, 1)[:2])
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        phases["setup"] = time.perf_counter() - t0 - phases["imports, load"]
        static = target.startswith("aot-compile")
        for i, s in enumerate((example, example, example) if static else (example, other, example)):
            began = time.perf_counter()
            out = model(*s.args, **s.kwargs)
            out.float().sum().backward()
            opt.step()
            opt.zero_grad()
            if device == "cuda":
                torch.cuda.synchronize()
            phases[f"step {i + 1}"] = time.perf_counter() - began
        seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "builds": len(built), "steps": 3, "phases": phases,
                      "fx_misses": counters["inductor"].get("fxgraph_cache_miss", 0),
                      "aot_misses": counters["aot_autograd"].get("autograd_cache_miss", 0)}))


def _run_child(side: str, program: Path, store: Path, cache: Path, target: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # a GPU host's wheels too
    proc = subprocess.run([sys.executable, __file__, "--child", side, str(program), str(store), target], env=env,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"the {side} process for {program.stem} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", help="smoke-zoo entries (default: all)")
    ap.add_argument("--targets", nargs="*", default=DEFAULT_TARGETS,
                    help="inductor-cache or aot-compile [:isa or :sm_XX / :cuda], without +train")
    ap.add_argument("--child", nargs=4, metavar=("SIDE", "PROGRAM", "STORE", "TARGET"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    sys.path.insert(0, str(ROOT))
    from bench.scratch import scratch_dir

    root = scratch_dir("farm-train-warm-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "farm-worker")  # the farm's own, apart from both sides
    os.environ["TRITON_CACHE_DIR"] = str(root / "farm-worker" / "triton")

    from farm.zoo import export_zoo
    from scheduler.jobs import execute
    from scheduler.spec import parse_job
    from storage import store_from_uri

    programs = export_zoo(root / "zoo", args.models or None)
    store = root / "store"
    job = parse_job({"name": "train-warm", "graphs": [str(p) for p in programs],
                     "targets": [f"{t}+train" for t in args.targets]})
    t0 = time.perf_counter()
    outcome = execute(job, store_from_uri(str(store)))
    print(f"farm compile of {len(outcome.results)} training steps ({len(programs)} models × {', '.join(args.targets)}): "
          f"{time.perf_counter() - t0:.1f} s")
    failed = [(r.graph, r.error) for r in outcome.results if r.status not in ("compiled", "hit")]
    if failed:
        raise SystemExit(f"the farm could not compile: {failed}")

    for target in args.targets:
        _compare(target, programs, store, root)


def _compare(target: str, programs: list[Path], store: Path, root: Path) -> None:
    print(f"\n{target}+train\n{'model':<15}{'cold s':>9}{'cold builds':>13}{'warm s':>9}{'warm builds':>13}"
          f"{'warm misses (fx/aot)':>22}{'warm/cold':>11}")
    ratios, cold_total, warm_total, warm_builds = [], 0.0, 0.0, 0
    for program in programs:
        name = f"{program.stem}-{target.replace(':', '-')}"
        cold = _run_child("cold", program, store, root / f"cold-{name}", target)
        warm = _run_child("warm", program, store, root / f"warm-{name}", target)
        ratio = warm["seconds"] / cold["seconds"]
        ratios.append(ratio)
        cold_total, warm_total, warm_builds = cold_total + cold["seconds"], warm_total + warm["seconds"], warm_builds + warm["builds"]
        print(f"{program.stem:<15}{cold['seconds']:>9.2f}{cold['builds']:>13}{warm['seconds']:>9.2f}{warm['builds']:>13}"
              f"{str(warm['fx_misses']) + '/' + str(warm['aot_misses']):>22}{ratio:>11.3f}")
        for side, timed in (("cold", cold), ("warm", warm)):
            print(f"  {side}: " + ", ".join(f"{k} {v:.2f}" for k, v in timed["phases"].items()))
    steps = "3 times at the example size" if target.startswith("aot-compile") else "example size, another size, example size"
    print(f"compared: the first 3 training steps (forward, backward, SGD step; {steps}) in fresh processes with "
          f"empty Inductor caches: plain `ep.module().compile()` (cold) against `warm_start` from the farm's "
          f"{target}+train artifact (warm), timed from after `import torch`")
    print(f"{target}: warm_first_steps / cold_first_steps: {warm_total / cold_total:.3f} over all models, median per "
          f"model {statistics.median(ratios):.3f} (goal <= 0.2); kernel compiles in the warm processes: {warm_builds} "
          f"(goal 0)")


if __name__ == "__main__":
    main()
