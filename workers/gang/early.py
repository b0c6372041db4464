"""Rank 0 of a gang of identical ranks compiles while the other ranks start.

Where a node has fewer free cores than the gang has ranks, starting the ranks is most of a
gang's overhead: every rank's actor imports torch for its gloo group before the group can form.
When every rank's archive has the same bytes, the graph issues no collectives, and the target
neither tunes across ranks nor is `inductor-cache` (whose ranks mark dimensions from what each
observed), nothing the compiler collectives decide can change what rank 0 compiles: identical
bytes carry the same collectives, the same dynamic ranges and the same key, so rank 0 leads
them all. Rank 0 then starts that compile as soon as it has read its graph, before the group
forms (`EarlyCompile`). The collectives still run over the real group, and the compile
publishes only once they have confirmed it: the agreed unit is the one compiled, and rank 0
leads it. A gang that fails first stops the compile, and nothing is published.
"""
from __future__ import annotations

import functools
import threading
from typing import Any

from storage import Store
from workers.lookup import UnitFailed
from workers.pipeline import compile_unit, run_unit
from workers.sandbox.process import Sandbox
from workers.unit import Gang, Unit, UnitResult


def compiles_early(gang: Gang, rank: int, own: dict[str, Any]) -> bool:
    """Whether `rank`, having read its graph (`own`, workers/gang/rank.py's read_own_graph), may
    compile before its gang agrees."""
    facts = own.get("facts")
    return (rank == 0 and gang.identical and not gang.candidates
            and gang.ranks[0].target.backend != "inductor-cache" and not own.get("error")
            and isinstance(facts, dict) and not facts.get("collectives"))


class EarlyCompile:
    """Rank 0's compile in a thread of its actor, in its sandbox, held back before it publishes
    until the gang has confirmed it (`confirm`) or failed (`cancel`)."""

    def __init__(self, unit: Unit, store: Store, sandbox: Sandbox):
        self.unit, self._sandbox = unit, sandbox
        self._decided = threading.Event()
        self.held = threading.Event()  # set once the compile waits to publish
        self._refusal: str | None = None
        self._result: UnitResult | None = None
        self._thread = threading.Thread(target=self._compile, args=(store,), name="farm-gang-early-compile", daemon=True)
        self._thread.start()

    def _compile(self, store: Store) -> None:
        self._result = run_unit(self.unit, store, self._sandbox,
                                body=functools.partial(compile_unit, before_publish=self._held))

    def _held(self) -> None:
        self.held.set()
        self._decided.wait()
        if self._refusal is not None:
            raise UnitFailed(self._refusal)

    def confirm(self, unit: Unit) -> UnitResult | None:
        """The gang agreed that rank 0 leads `unit`: the compile's result, once published (or a hit,
        or its failure). None, with the compile stopped, if the agreed unit is not the one compiled."""
        if unit != self.unit:
            self.cancel("the gang agreed on another unit than rank 0 started to compile")
            return None
        self._decided.set()
        self._thread.join()
        if self._result.status == "compiled":  # not a hit it found, nor a failure
            self._result.metrics["gang_compiled_early"] = 1.0
        return self._result

    @property
    def result(self) -> UnitResult | None:
        """The compile's result, once it has ended (confirmed or stopped)."""
        return None if self._thread.is_alive() else self._result

    def cancel(self, why: str) -> None:
        """The gang failed or agreed otherwise: the compile stops (its sandbox child is killed) and
        publishes nothing. Once confirmed, this does nothing."""
        if self._decided.is_set():
            return
        self._refusal = f"not published: {why}"
        self._decided.set()
        self._sandbox.interrupt()
        self._thread.join()
