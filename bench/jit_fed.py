"""What a training-free JIT user gains from the farm feeding PyTorch's remote caches (issue 37).

For each smoke-zoo model: an `inductor-cache` unit compiles it on the farm (a fresh local store),
which publishes the FX graph and AOTAutograd entries of its compile. Then fresh processes, each
with an empty local Inductor cache, run `torch.compile(ep.module())` under `torch.no_grad` over
the program's input sets with `use_farm_cache(store=…, write=False, isa=<the unit's ISA>)`:

  fx+aot    as the farm published it
  fx only   the AOTAutograd entries removed from the store (what the farm fed before it fed them)
  cold      no farm cache: everything compiled here

and prints each case's compile-and-first-calls seconds (median of 3; torch's import and
use_farm_cache's set-up not counted) and its cache counters, with fx+aot over fx only and over cold.

    .venv/bin/python bench/jit_fed.py [--models gpt encoder_block]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

READER = """
import json, sys, time, torch
from torch._dynamo.utils import counters
from workers.check.inputs import input_sets
from workers.sandbox.program import load_program
if sys.argv[1] != "-":
    from farm.client import use_farm_cache
    use_farm_cache(store=sys.argv[1], write=False, isa=sys.argv[3])
ep = load_program(sys.argv[2], sys.argv[2])
model = ep.module()
start = time.perf_counter()
compiled = torch.compile(model)
with torch.no_grad():
    for s in input_sets(ep):
        compiled(*s.args)
print(json.dumps({"seconds": time.perf_counter() - start, "fx_hit": counters["inductor"]["fxgraph_cache_hit"],
                  "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
                  "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
                  "aot_miss": counters["aot_autograd"]["autograd_cache_miss"]}))
"""


def _reader(store: str, program: Path, isa: str, cache: Path) -> dict:
    # no `CI`, as in the farm's sandboxes: functorch's error_on_custom_op_aliasing defaults to on
    # with it, and AOTAutograd's keys hash that setting (README, "The farm feeds it")
    env = {k: v for k, v in os.environ.items() if k != "CI" and not k.startswith("TORCHINDUCTOR_")}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(cache))
    done = subprocess.run([sys.executable, "-c", READER, store, str(program), isa], env=env, cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"a reader failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "encoder_block"])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    from farm.zoo import export_zoo
    from scheduler.jobs import execute
    from scheduler.spec import parse_job
    from storage import store_from_uri

    tmp = Path(tempfile.mkdtemp(prefix="farm-bench-jit-fed-"))
    programs = {p.stem: p for p in export_zoo(tmp / "zoo")}
    print(f"{os.cpu_count()} cores; each case a fresh process with an empty local Inductor cache, median of {args.runs}")
    for name in args.models:
        store_dir = tmp / f"store-{name}"
        store = store_from_uri(str(store_dir))
        (unit,) = execute(parse_job({"graphs": [str(programs[name])], "targets": ["inductor-cache"]}), store).results
        if unit.status != "compiled":
            raise SystemExit(f"{name}: the farm's unit failed: {unit.error}")
        isa = store.get_manifest(unit.key)["artifact"]["isa"]
        results = {}
        for case in ("fx+aot", "fx only", "cold"):
            if case == "fx only":
                shutil.rmtree(store_dir / "remote-cache" / "autograd-experimental")
            runs = sorted((_reader("-" if case == "cold" else str(store_dir), programs[name], isa,
                                   tmp / f"inductor-{name}-{case.replace(' ', '-')}-{i}") for i in range(args.runs)),
                          key=lambda r: r["seconds"])
            results[case] = runs[(len(runs) - 1) // 2]  # the median run (the lower one of an even count)
        for case, r in results.items():
            print(f"{name:14} {case:8} {r['seconds']:6.2f} s  FX hits {r['fx_hit']} misses {r['fx_miss']}, "
                  f"AOTAutograd hits {r['aot_hit']} misses {r['aot_miss']}")
        fed = results["fx+aot"]["seconds"]
        print(f"{name:14} fx+aot / fx only {fed / results['fx only']['seconds']:.2f}, "
              f"fx+aot / cold {fed / results['cold']['seconds']:.2f}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
