"""Per-unit figures of every job in a local store, for the GPU run (bench/gpu_zoo.sh): compile
time, numerics against eager on the same device, eager and compiled latency, and each autotune
decision.

    python bench/gpu_report.py STORE_DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from storage import store_from_uri  # noqa: E402
from storage.results import read_results  # noqa: E402


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(root: Path) -> None:
    if not (root / "jobs").is_dir():  # every job failed before it wrote anything: their logs say why
        print(f"no job wrote results into {root}; see the compile and autotune logs beside this report")
        return
    store = store_from_uri(str(root))
    print(f"{'job':<34} {'graph':<14} {'target':<44} {'status':<8} {'lower s':>8} {'compile s':>9} "
          f"{'max abs err':>11} {'eager ms':>9} {'compiled ms':>11} {'speedup':>7}")
    for job in sorted(p.name for p in (root / "jobs").iterdir()):
        for r in read_results(store, job) or []:
            print(f"{job:<34} {r['graph']:<14} {r['target']:<44} {r['status']:<8} {_fmt(r['lower_s'], '8.1f')} "
                  f"{_fmt(r['compile_s'], '9.1f')} {_fmt(r['max_abs_err'], '11.2e')} {_fmt(r['eager_ms'], '9.4f')} "
                  f"{_fmt(r['compiled_ms'], '11.4f')} {_fmt(r['speedup'], '7.2f')}")
            if r["error"]:
                print(f"    error: {r['error'][:600]}")
    for manifest in sorted((root / "units").glob("*.json")):
        doc = json.loads(manifest.read_text())
        if doc.get("device"):
            print(f"measured on {doc['device']}; artifact {doc.get('artifact')}")
            break
    for tuning in sorted((root / "tuning").glob("*/*.json")) if (root / "tuning").exists() else []:
        record = json.loads(tuning.read_text())
        if "candidates" not in record:
            continue  # shared Inductor autotune timings, not a decision
        print(f"autotune {record.get('graph')}: winner {record.get('winner')} ({record.get('reason')})")
        for c in record["candidates"]:
            print(f"    {c['name']:<34} {c['status']:<9} {_fmt(c.get('median_ms'), '.4f')} ms "
                  f"± {_fmt(c.get('spread_ms'), '.4f')}  max abs err {_fmt(c.get('max_abs_err'), '.2e')}"
                  + (f"  error: {c['error'][:300]}" if c.get("error") else ""))
    shared = list((root / "tuning" / "inductor").rglob("*.json")) if (root / "tuning").exists() else []
    print(f"shared Inductor autotune shards: {len(shared)}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
