"""The collector at scale: a SeaweedFS store filled with synthetic units (manifest, artifact, log,
trace, a shared program) and unreferenced blobs, at least 100,000 objects, published as workers
publish; then `farm du`, `farm gc --dry-run` and a real `farm gc` timed, each on the whole store.
The first pass takes what each manifest names from the publishers' journal (storage/unit_refs.py),
checked by ETag, instead of one GET per manifest; later passes from the collector's index. The
first `farm du` is timed apart; `--no-journal` deletes the journal before it (the first pass then
reads every manifest). Half the units are pinned; the collector's clock is set 40 days ahead, so
the other half are unused for 40 days and `--unused-days 30` takes them. Goal: each pass over
100,000 objects in under 60 s.

    .venv/bin/python bench/gc.py [--units 23000] [--orphans 10000] [--no-journal]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from storage import Store, store_from_uri  # noqa: E402
from storage.gc import DAY_S, Policy, collect  # noqa: E402
from storage.pins import pin  # noqa: E402
from storage.unit_refs import PREFIX as JOURNAL  # noqa: E402
from storage.usage import usage  # noqa: E402
from tests.seaweed import start_seaweed  # noqa: E402

PROGRAMS = 500


def _blob(store: Store, data: bytes) -> dict:
    return store.put_bytes(data).to_dict()


def _fill_part(uri: str, part: range, programs: list[dict]) -> list[str]:
    store = store_from_uri(uri)

    def unit(i: int) -> str:
        key = hashlib.sha256(f"unit {i}".encode()).hexdigest()
        blobs = {"program": programs[i % PROGRAMS], "artifact": _blob(store, f"artifact {i}".encode() * 50),
                 "log": _blob(store, f"log {i}".encode() * 10), "trace": _blob(store, f"trace {i}".encode() * 10)}
        # published as a worker publishes, so its journal (storage/unit_refs.py) is written too
        store.publish_manifest(key, {"key": key, "target": ("aoti-cpu:avx2", "core-aten")[i % 2], "blobs": blobs,
                                     "status": "compiled"})
        return key

    with ThreadPoolExecutor(16) as pool:
        keys = list(pool.map(unit, part))
    store.flush_journal()  # now: a pool's process may end before the journal's timer fires
    return keys


def _orphans(uri: str, part: range) -> None:
    store = store_from_uri(uri)
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: _blob(store, f"orphan {i}".encode()), part))


def fill(uri: str, units: int, orphans: int) -> list[str]:
    """Synthetic units and orphans, written from two processes (boto3 is CPU-bound per call)."""
    store = store_from_uri(uri)
    programs = [_blob(store, f"program {i}".encode() * 20) for i in range(PROGRAMS)]
    with ProcessPoolExecutor(2) as pool:
        keys = [k for part in pool.map(_fill_part, [uri] * 2, [range(p, units, 2) for p in range(2)], [programs] * 2)
                for k in part]
        list(pool.map(_orphans, [uri] * 2, [range(p, orphans, 2) for p in range(2)]))
    return keys


def timed(what: str, objects: int, fn):
    start = time.perf_counter()
    result = fn()
    took = time.perf_counter() - start
    print(f"{what:<34} {took:7.1f} s   {objects / took:8.0f} objects/s   {'under' if took < 60 else 'OVER'} 60 s")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--units", type=int, default=23000)
    ap.add_argument("--orphans", type=int, default=10000)
    ap.add_argument("--no-journal", action="store_true", help="delete the publishers' journal: the first pass reads every manifest")
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # progress as it goes, also into a file
    with tempfile.TemporaryDirectory(prefix="bench-gc-") as tmp:
        server = start_seaweed(Path(tmp) / "seaweed")
        try:
            os.environ.update(server.env())
            server.create_bucket("bench-gc")
            store = store_from_uri("s3://bench-gc/store")
            start = time.perf_counter()
            keys = fill("s3://bench-gc/store", args.units, args.orphans)
            pin(store, keys[::2], label="half")
            objects = sum(1 for _ in store.backend.list_info(""))
            print(f"filled SeaweedFS with {objects} objects ({args.units} units: manifest, artifact, log, trace; "
                  f"{PROGRAMS} shared programs; {args.orphans} unreferenced blobs) in {time.perf_counter() - start:.0f} s")
            later = time.time() + 40 * DAY_S
            store.clock = lambda: later  # everything was last used 40 days ago
            journal = list(store.backend.list(JOURNAL))
            if args.no_journal:
                store.backend.delete_many(journal)
            timed(f"farm du (first: {'every manifest' if args.no_journal else f'{len(journal)} journal objects'})",
                  objects, lambda: usage(store))
            u = timed("farm du", objects, lambda: usage(store))
            dry = timed("farm gc --dry-run", objects, lambda: collect(store, Policy(unused_days=30, dry_run=True)))
            real = timed("farm gc", objects, lambda: collect(store, Policy(unused_days=30)))
            left = sum(1 for _ in store.backend.list_info(""))
            deleted = {k: v.count for k, v in real.deleted.items()}
            print(f"du: {u.objects} objects, {u.bytes} bytes; gc would free {u.gc_frees[30]} bytes at --unused-days 30")
            print(f"gc deleted {deleted} (dry run said {({k: v.count for k, v in dry.deleted.items()})}); "
                  f"{left} objects left")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
