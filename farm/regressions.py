"""Regressions of one nightly run against the run before it (of the same suite), from the history
rows alone: new failures, compile time up by more than 20%, speedup down by more than 10%, and
numerics over tolerance."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

COMPILE_TIME_UP = 0.20
SPEEDUP_DOWN = 0.10


@dataclass(frozen=True)
class Regression:
    model: str
    target: str
    kind: str  # new failure | numerics | compile time | speedup
    detail: str
    before: float | None = None
    after: float | None = None


def previous_run(rows: list[dict[str, Any]], run_id: str) -> str | None:
    """The latest run of the same suite that started before `run_id`."""
    mine = [r for r in rows if r["run_id"] == run_id]
    if not mine:
        raise ValueError(f"run {run_id} is not in the history")
    suite, started = mine[0]["suite"], mine[0]["run_at"]
    earlier = {r["run_id"]: r["run_at"] for r in rows if r["suite"] == suite and r["run_at"] < started}
    return max(earlier, key=earlier.get) if earlier else None


def _passed(row: dict[str, Any] | None) -> bool:
    return row is not None and row["status"] in ("compiled", "hit")


def _over_tolerance(row: dict[str, Any]) -> bool:
    err, rel = row.get("max_abs_err"), row.get("max_rel_err")
    return err is not None and row.get("atol") is not None and err > row["atol"] and (rel is None or rel > row["rtol"])


def find_regressions(rows: list[dict[str, Any]], run_id: str) -> list[Regression]:
    before_id = previous_run(rows, run_id)
    if before_id is None:
        return []  # a suite's first run: nothing to regress from (its failures are in the report)
    before = {(r["model"], r["target"]): r for r in rows if r["run_id"] == before_id}
    found = []
    for now in (r for r in rows if r["run_id"] == run_id):
        model, target = now["model"], now["target"]
        then = before.get((model, target))
        if now["status"] == "failed":
            if not _passed(then) and then is not None:
                continue  # it failed last time too: not new
            kind = "numerics" if now.get("failed_phase") == "verify" else "new failure"
            what = "passed last run" if then else "a new entry"
            found.append(Regression(model, target, kind, f"{what}; now fails in {now.get('failed_phase') or '?'}: "
                                                         f"{(now.get('error') or '')[:300]}"))
            continue
        if not _passed(now):
            continue  # skipped: an optional package is missing, which the report says
        if _over_tolerance(now):
            found.append(Regression(model, target, "numerics", f"max error {now['max_abs_err']:.3g} over the tolerance "
                                                               f"(atol {now['atol']:g}, rtol {now['rtol']:g})",
                                    then.get("max_abs_err") if then else None, now["max_abs_err"]))
        if not _passed(then):
            continue
        a, b = then.get("compile_s"), now.get("compile_s")
        if a and b and b > a * (1 + COMPILE_TIME_UP):
            found.append(Regression(model, target, "compile time", f"{a:.1f} s -> {b:.1f} s (+{(b / a - 1):.0%})", a, b))
        a, b = then.get("speedup"), now.get("speedup")
        if a and b and b < a * (1 - SPEEDUP_DOWN):
            found.append(Regression(model, target, "speedup", f"{a:.2f}x -> {b:.2f}x ({(b / a - 1):.0%})", a, b))
    return found
