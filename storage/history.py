"""The nightly history: one row per (model, target) per run of a zoo suite, as Parquet in the
store, partitioned by date (hive style, so pyarrow, pandas and DuckDB read the folder as one
table with a `date` column taken from the folder names):

    history/date=YYYY-MM-DD/<run_id>.parquet

A run's file is written once (a conditional write) and never changed. The columns are
HISTORY_SCHEMA below; README.md 'Nightly zoo' shows how to read them back."""
from __future__ import annotations

import datetime as dt
import io
import re
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from storage.backend import StoreError
from storage.store import Store

HISTORY_PREFIX = "history/"
_PATH = re.compile(r"history/date=(\d{4}-\d{2}-\d{2})/([\w.-]+)\.parquet")


def _field(name: str, kind: pa.DataType, doc: str) -> pa.Field:
    return pa.field(name, kind, metadata={"doc": doc})


HISTORY_SCHEMA = pa.schema([
    _field("run_id", pa.string(), "one run of `farm zoo run` (the jobs it submitted start with it)"),
    _field("run_at", pa.timestamp("s", tz="UTC"), "when the run started"),
    _field("suite", pa.string(), "the suite that ran (smoke, hf, nightly, or a team's own)"),
    _field("model", pa.string(), "the zoo entry"),
    _field("family", pa.string(), "what kind of model (mlp, cnn, encoder, decoder, vision, moe, …)"),
    _field("target", pa.string(), "what it was compiled for, e.g. aoti-cpu:avx2 (inductor-cache:avx2+train: a training step)"),
    _field("mode", pa.string(), "inference, or train: forward and backward of a training step"),
    _field("status", pa.string(), "compiled | hit | failed | skipped (an optional package is missing)"),
    _field("failed_phase", pa.string(), "export, or the phase of the compile that failed; null unless failed"),
    _field("error", pa.string(), "why it failed or was skipped"),
    _field("hit", pa.bool_(), "the artifact was already in the store: nothing was compiled"),
    _field("export_s", pa.float64(), "torch.export time on a worker"),
    _field("compile_s", pa.float64(), "lower + verify + benchmark; for a hit, what the artifact's compile took"),
    _field("max_abs_err", pa.float64(), "largest absolute difference from the program run eagerly"),
    _field("max_rel_err", pa.float64(), "largest relative difference"),
    _field("atol", pa.float64(), "the entry's absolute tolerance"),
    _field("rtol", pa.float64(), "the entry's relative tolerance"),
    _field("eager_ms", pa.float64(), "median latency of the exported program run eagerly (train: a whole step)"),
    _field("compiled_ms", pa.float64(), "median latency of the compiled artifact (train: a whole step)"),
    _field("speedup", pa.float64(), "eager_ms / compiled_ms (train: the step speedup, forward and backward)"),
    _field("saved_activation_bytes", pa.int64(),
           "train: what the compiled forward keeps for the backward at the example size, parameters left out"),
    _field("artifact_bytes", pa.int64(), "size of the compiled artifact"),
    _field("key", pa.string(), "the unit's key (farm explain KEY_A KEY_B diffs two)"),
    _field("job_id", pa.string(), "the farm job that compiled it (farm results JOB)"),
    _field("torch", pa.string(), "toolchain: torch version"),
    _field("torch_git", pa.string(), "toolchain: torch git hash"),
    _field("python", pa.string(), "toolchain: Python version"),
    _field("cxx", pa.string(), "toolchain: the C++ compiler, where the target uses one"),
    _field("transformers", pa.string(), "toolchain: transformers version, for entries that need it"),
])


def history_path(date: str, run_id: str) -> str:
    path = f"{HISTORY_PREFIX}date={date}/{run_id}.parquet"
    if not _PATH.fullmatch(path) or not _real_date(date):
        raise ValueError(f"history: the date {date!r} must be a real YYYY-MM-DD and the run id {run_id!r} a plain name")
    return path


def _real_date(date: str) -> bool:
    try:
        dt.date.fromisoformat(date)
        return True
    except ValueError:
        return False


def append_run(store: Store, date: str, run_id: str, rows: Iterable[dict[str, Any]]) -> str:
    """Write one run's rows; a run already written is never overwritten."""
    rows = list(rows)
    unknown = {k for r in rows for k in r} - set(HISTORY_SCHEMA.names)
    if unknown:
        raise ValueError(f"history rows have columns not in the schema: {sorted(unknown)}")
    table = pa.Table.from_pylist([{n: r.get(n) for n in HISTORY_SCHEMA.names} for r in rows], schema=HISTORY_SCHEMA)
    buf = io.BytesIO()
    pq.write_table(table, buf)
    path = history_path(date, run_id)
    if not store.backend.write(path, buf.getvalue(), if_absent=True):
        raise StoreError(f"{store.uri}/{path} exists: run {run_id} was already recorded")
    return path


def read_history(store: Store) -> pa.Table:
    """Every run's rows, with the `date` column from the partition, oldest run first."""
    tables = []
    for path in sorted(store.backend.list(HISTORY_PREFIX)):
        match = _PATH.fullmatch(path)
        data = store.backend.read(path) if match else None
        if data is None:
            continue
        table = pq.read_table(io.BytesIO(data), use_threads=False)  # no Arrow thread pool: storage/results.py
        tables.append(table.append_column("date", pa.array([match.group(1)] * len(table), pa.string())))
    if not tables:
        return HISTORY_SCHEMA.empty_table().append_column("date", pa.array([], pa.string()))
    return pa.concat_tables(tables, promote_options="default").sort_by([("run_at", "ascending")])
