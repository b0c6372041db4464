"""`farm trace KEY`: a unit's torch trace (workers/trace.py) from the store, rendered by tlparse.

A compiled unit's trace is linked from its manifest. A failed unit has no manifest: its trace
is linked from its results row, so the jobs that ran the key are searched, newest first.
tlparse (a PyPI package, a Rust binary) turns the log into a static HTML report that opens
offline: index.html, with the graphs Inductor saw and the code it wrote.
"""
from __future__ import annotations

import gzip
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from storage import Store, UnknownKey
from storage.results import read_results

MAX_JOBS_SEARCHED = 500
MAX_TRACE_BYTES = 1 << 30  # unpacked: the store is hostile input too
RENDER_TIMEOUT_S = 600


class TraceError(ValueError):
    """No trace for what was asked, or tlparse could not render it; the message says what to do."""


@dataclass(frozen=True)
class FoundTrace:
    key: str
    graph: str
    target: str
    status: str
    digest: str


def _by_age(job_id: str) -> str:
    """Job ids end in -YYYYmmdd-HHMMSS-xxxx (scheduler.jobs.new_job_id)."""
    return "-".join(job_id.split("-")[-3:-1])


def find_trace(store: Store, text: str, job_id: str | None = None) -> FoundTrace:
    """The trace of a unit key (or unique prefix): its manifest's, else the newest results row's."""
    text = text.strip().rstrip("…").lower()
    if job_id is None:
        try:
            key = store.resolve_key(text)
            manifest = store.get_manifest(key)
        except UnknownKey:
            manifest = None
        if manifest and manifest["blobs"].get("trace"):
            return FoundTrace(key, manifest["graph"], manifest["target"], "compiled", manifest["blobs"]["trace"]["digest"])
    jobs = [job_id] if job_id else sorted(store.job_ids(), key=_by_age, reverse=True)[:MAX_JOBS_SEARCHED]
    keys = set()
    for j in jobs:
        for row in read_results(store, j) or []:
            if row.get("key") and row["key"].startswith(text):
                keys.add(row["key"])
                if row.get("trace_digest"):
                    return FoundTrace(row["key"], row["graph"], row["target"], row["status"], row["trace_digest"])
    if len(keys) > 1:
        raise TraceError(f"{len(keys)} keys start with {text!r}; give more characters")
    where = f"job {job_id}" if job_id else f"the {len(jobs)} newest jobs in {store.uri}"
    raise TraceError(f"no trace for key {text!r} in {where}: units that were answered before lowering (or built "
                     f"before traces were kept) have none; `farm results JOB` lists keys and their trace_digest")


def fetch_trace(store: Store, found: FoundTrace, dest_dir: Path) -> Path:
    """The raw trace log (digest-checked, then unpacked within a size bound)."""
    packed = store.fetch(found.digest, dest_dir / "trace.log.gz")
    raw = dest_dir / f"{found.key[:16]}.log"
    with gzip.open(packed, "rb") as src, raw.open("wb") as out:
        copied = 0
        while chunk := src.read(1 << 20):
            copied += len(chunk)
            if copied > MAX_TRACE_BYTES:
                raise TraceError(f"the trace of {found.key} unpacks to more than {MAX_TRACE_BYTES} bytes; refusing it")
            out.write(chunk)
    packed.unlink()
    return raw


def tlparse_binary() -> str:
    found = shutil.which("tlparse") or shutil.which("tlparse", path=str(Path(sys.executable).parent))
    if found is None:
        raise TraceError("tlparse is not installed: `pip install tlparse` (it is one of the farm's dependencies)")
    return found


def render(raw: Path, out_dir: Path) -> Path:
    """tlparse's HTML report of a trace log; returns its index.html."""
    with tempfile.TemporaryDirectory(prefix="farm-tlparse-") as tmp:
        proc = subprocess.run([tlparse_binary(), str(raw), "-o", str(Path(tmp) / "report"), "--overwrite", "--no-browser"],
                              capture_output=True, text=True, timeout=RENDER_TIMEOUT_S, cwd=tmp)
        if proc.returncode != 0 or not (Path(tmp) / "report" / "index.html").is_file():
            raise TraceError(f"tlparse could not render {raw}: {(proc.stderr or proc.stdout).strip()[-1000:]}")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        shutil.move(str(Path(tmp) / "report"), out_dir)
    return out_dir / "index.html"
