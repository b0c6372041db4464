"""The per-job results table: one row per unit, written as Parquet to jobs/<id>/results.parquet."""
from __future__ import annotations

import io
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from storage.store import Store

RESULTS_SCHEMA = pa.schema(
    [
        ("job_id", pa.string()),
        ("graph", pa.string()),
        ("target", pa.string()),
        ("key", pa.string()),
        ("status", pa.string()),  # compiled | hit | failed | skipped
        ("error", pa.string()),
        ("retryable", pa.bool_()),
        ("fetch_s", pa.float64()),
        ("load_s", pa.float64()),
        ("lower_s", pa.float64()),
        ("verify_s", pa.float64()),
        ("benchmark_s", pa.float64()),
        ("upload_s", pa.float64()),
        ("total_s", pa.float64()),
        ("artifact_digest", pa.string()),
        ("artifact_bytes", pa.int64()),
        ("log_digest", pa.string()),
        ("trace_digest", pa.string()),  # the lowering's torch trace, gzipped: `farm trace KEY` renders it
        ("max_abs_err", pa.float64()),
        ("max_rel_err", pa.float64()),
        ("eager_ms", pa.float64()),
        ("compiled_ms", pa.float64()),
        ("speedup", pa.float64()),
        ("worker", pa.string()),
        ("retries", pa.int64()),
        ("candidate", pa.string()),  # autotune: this row's candidate, or the winner on the tuned row
        ("compiled_spread_ms", pa.float64()),  # interquartile range of the compiled runs
        ("weights_mode", pa.string()),  # values | shapes: what of the weights the key hashed
        ("compile_s", pa.float64()),  # lower + verify + benchmark, for units that compiled
        ("saved_s", pa.float64()),  # for hits: the compile time recorded in the manifest
        ("lease_wait_s", pa.float64()),  # waiting for another worker compiling the same key
        ("bytes_uploaded", pa.int64()),
        ("bytes_downloaded", pa.int64()),
        ("bytes_cached", pa.int64()),  # served by the worker's local disk tier
        ("note", pa.string()),  # how a hit was accepted when its manifest alone did not settle it
    ]
)
RESULTS_FILE = "results.parquet"


def results_to_parquet(rows: Iterable[dict[str, Any]]) -> bytes:
    rows = list(rows)
    names = RESULTS_SCHEMA.names
    unknown = {k for r in rows for k in r} - set(names)
    if unknown:
        raise ValueError(f"results rows have columns not in the schema: {sorted(unknown)}")
    table = pa.Table.from_pylist([{n: r.get(n) for n in names} for r in rows], schema=RESULTS_SCHEMA)
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def write_results(store: Store, job_id: str, rows: Iterable[dict[str, Any]]) -> str:
    return store.put_job_file(job_id, RESULTS_FILE, results_to_parquet(rows))


def read_results_table(store: Store, job_id: str) -> pa.Table | None:
    data = store.get_job_file(job_id, RESULTS_FILE)
    # ParquetFile, not read_table: that one imports pyarrow.dataset (0.2 s, in every CLI call that prints results).
    # No threads: Arrow's thread pool, once a read starts it, can abort the process as it exits ("terminate
    # called without an active exception", SIGABRT; apache/arrow#34314). `farm submit --address` did so in 5
    # runs of 60 after a job that went well, and in none of 60 reading without it. The tables are small.
    return None if data is None else pq.ParquetFile(io.BytesIO(data)).read(use_threads=False)


def read_results(store: Store, job_id: str) -> list[dict[str, Any]] | None:
    table = read_results_table(store, job_id)
    return None if table is None else table.to_pylist()
