"""The regression rules of the nightly gate and the history's write-once files, on rows made here."""
from __future__ import annotations

import datetime as dt

import pytest

from farm.regressions import find_regressions, previous_run
from storage import StoreError, store_from_uri
from storage.history import append_run, read_history

NIGHT1, NIGHT2 = dt.datetime(2026, 11, 21, 2, tzinfo=dt.timezone.utc), dt.datetime(2026, 11, 22, 2, tzinfo=dt.timezone.utc)


def row(run: str, at: dt.datetime, model: str, status: str = "compiled", suite: str = "s", **kw) -> dict:
    base = {"run_id": run, "run_at": at, "suite": suite, "model": model, "target": "aoti-cpu", "status": status,
            "hit": status == "hit", "compile_s": 10.0, "speedup": 2.0, "max_abs_err": 1e-6, "max_rel_err": 1e-6,
            "atol": 1e-4, "rtol": 1e-4, "failed_phase": None, "error": None}
    return {**base, **kw}


def test_each_rule_fires_once_and_only_against_the_previous_run_of_the_suite():
    rows = [row("r1", NIGHT1, m) for m in ("steady", "slower", "faster", "slow-runtime", "breaks", "still-broken", "numerics")]
    rows[5] = row("r1", NIGHT1, "still-broken", "failed", failed_phase="lower", error="x")
    rows.append(row("other", NIGHT1 + dt.timedelta(hours=1), "steady", "failed", suite="another suite"))
    rows += [row("r2", NIGHT2, "steady", "hit"),
             row("r2", NIGHT2, "slower", compile_s=12.5),  # +25%
             row("r2", NIGHT2, "faster", compile_s=11.9, speedup=1.85),  # +19%, -7.5%: within the limits
             row("r2", NIGHT2, "slow-runtime", speedup=1.7),  # -15%
             row("r2", NIGHT2, "breaks", "failed", failed_phase="export", error="boom"),
             row("r2", NIGHT2, "still-broken", "failed", failed_phase="lower", error="x"),
             row("r2", NIGHT2, "numerics", "failed", failed_phase="verify", error="max abs error 0.3"),
             row("r2", NIGHT2, "new-and-broken", "failed", failed_phase="load", error="bad")]
    assert previous_run(rows, "r2") == "r1" and previous_run(rows, "r1") is None
    found = {(r.model, r.kind) for r in find_regressions(rows, "r2")}
    assert found == {("slower", "compile time"), ("slow-runtime", "speedup"), ("breaks", "new failure"),
                     ("numerics", "numerics"), ("new-and-broken", "new failure")}
    assert find_regressions(rows, "r1") == []  # a first run has nothing to regress from


def test_a_passing_unit_over_its_tolerance_is_a_numerics_regression():
    rows = [row("r1", NIGHT1, "m"), row("r2", NIGHT2, "m", max_abs_err=0.01, max_rel_err=0.02)]
    (r,) = find_regressions(rows, "r2")
    assert r.kind == "numerics" and "over the tolerance" in r.detail


def test_history_files_are_partitioned_by_date_and_written_once(tmp_path):
    store = store_from_uri(str(tmp_path))
    append_run(store, "2026-11-21", "r1", [row("r1", NIGHT1, "m")])
    append_run(store, "2026-11-22", "r2", [row("r2", NIGHT2, "m", "failed", error="boom")])
    with pytest.raises(StoreError, match="already recorded"):
        append_run(store, "2026-11-22", "r2", [row("r2", NIGHT2, "m")])
    with pytest.raises(ValueError, match="the date '2026-02-30'"):
        append_run(store, "2026-02-30", "r3", [])
    with pytest.raises(ValueError, match="not in the schema"):
        append_run(store, "2026-11-23", "r3", [{**row("r3", NIGHT2, "m"), "password": "x"}])
    table = read_history(store)
    assert table.column("date").to_pylist() == ["2026-11-21", "2026-11-22"]
    assert table.column("status").to_pylist() == ["compiled", "failed"]
    assert (tmp_path / "history" / "date=2026-11-22" / "r2.parquet").is_file()
