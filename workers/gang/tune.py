"""Autotune consensus in a gang: the candidates' outcomes, all-gathered, one decision on every
rank, and a tuning record that says what each candidate did (a failed one names its error).

Graphs without collectives split the candidates across the ranks: each compiles, verifies and
times its share on its own graph. A graph with collectives runs on every rank or on none, so
each candidate is compiled and timed by the whole gang, one after another; it is usable only if
it verified on every rank, and its latency is the slowest rank's. The decision is the one a
single unit's candidates get (workers.autotune.space.decide: a candidate must beat `default` by more
than the noise), made from the same gathered data on every rank, so every rank takes the same
winner.
"""
from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from storage import Store
from storage.tuning import put_tuning_record, record_path
from workers.autotune.share import fingerprint_of
from workers.autotune.space import Decision, Measured, decide
from workers.pipeline import run_unit
from workers.sandbox.process import Sandbox
from workers.unit import Gang, Unit, UnitResult

log = logging.getLogger(__name__)


class NoCandidate(Exception):
    """No candidate compiled and verified; the message names each candidate's error."""


@dataclass
class GangTuning:
    """What the gang's tuning measured and decided, the same on every rank."""

    gang: str
    measured: list[Measured]
    measured_by: dict[str, list[int]]  # candidate → the ranks that compiled and timed it
    decision: Decision
    compiled_here: int = 0
    space: dict[str, dict[str, Any]] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        timed = {f"autotune_ms[{m.name}]": m.median_ms for m in self.measured if m.usable}
        return {**timed, "autotune_compiled_here": float(self.compiled_here),
                "autotune_failed": float(sum(not m.usable for m in self.measured))}

    def record(self, result: UnitResult, store: Store) -> str | None:
        """Keep the tuning record for the winner's program on its device, where a single unit's
        tuning keeps its own; returns its path. Called by the rank that compiled that program."""
        if result.status not in ("compiled", "hit") or not result.components:
            return None
        device = result.device or {}
        path = record_path(result.components["program"]["graph"], fingerprint_of(device))
        put_tuning_record(store, path, {
            "graph": result.graph, "target": result.target, "gang": self.gang, "program": result.components["program"],
            "device": device, "space": self.space, "candidates": [m.to_dict() for m in self.measured],
            "measured_by_ranks": self.measured_by, "winner": self.decision.winner, "reason": self.decision.reason,
            "decided_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        })
        return path


def tune(comm, gang: Gang, unit: Unit, compile_as: Callable[[Unit], UnitResult], split: bool, store: Store,
         sandbox: Sandbox) -> tuple[Unit, GangTuning]:
    """This rank's unit as the winning candidate, and the tuning. Every rank calls it at once;
    `comm` is the gang's GangComm."""
    options_of = dict(gang.candidates)
    space = {name: dict(options) for name, options in options_of.items()}

    def as_candidate(name: str) -> Unit:
        return replace(unit, target=replace(unit.target, candidate=name, options=options_of[name]))

    names = list(space)
    compiled_here = 0
    measured: list[Measured] = []
    measured_by: dict[str, list[int]] = {}
    if split:
        mine = []
        for name in names[comm.rank::comm.world_size]:
            result = run_unit(as_candidate(name), store, sandbox)
            compiled_here += result.status == "compiled"
            mine.append(Measured.of(name, result).to_dict())
        for rank, theirs in enumerate(comm.all_gather(mine, "autotune measurements")):
            measured += [Measured(**m) for m in theirs]
            measured_by.update({m["name"]: [rank] for m in theirs})
        measured.sort(key=lambda m: names.index(m.name))
    else:
        for name in names:
            result = compile_as(as_candidate(name))
            compiled_here += result.status == "compiled"
            everyone = comm.all_gather(Measured.of(name, result).to_dict(), f"autotune measurement of {name}")
            measured.append(_slowest([Measured(**m) for m in everyone], comm.rank))
            measured_by[name] = list(range(comm.world_size))
    for m in measured:
        if not m.usable:
            log.warning("gang %s: autotune candidate %s did not compile and verify: %s", gang.label, m.name, m.error)
    decision = decide(measured)
    if decision is None:
        raise NoCandidate("no autotune candidate compiled and verified: "
                          + "; ".join(f"{m.name}: {m.error or m.status}" for m in measured))
    return as_candidate(decision.winner), GangTuning(gang.label, measured, measured_by, decision, compiled_here, space)


def _slowest(everyone: list[Measured], rank: int) -> Measured:
    """One candidate timed on every rank at once: usable only if it verified on every rank; its
    latency, spread and error are the worst rank's (they run in lockstep), its key this rank's."""
    broken = [f"rank {r}: {m.error or m.status}" for r, m in enumerate(everyone) if not m.usable]
    mine = everyone[rank]
    if broken:
        return replace(mine, status="failed", median_ms=None, error="; ".join(broken))
    slowest = max(everyone, key=lambda m: m.median_ms)
    return replace(mine, status="compiled" if any(m.status == "compiled" for m in everyone) else "hit",
                   median_ms=slowest.median_ms, spread_ms=max(m.spread_ms or 0.0 for m in everyone),
                   max_abs_err=max((m.max_abs_err for m in everyone if m.max_abs_err is not None), default=None))
