"""Warm gang ranks in a farm service: rank actors that outlive their gang and serve later gangs
of the same shape, which then start no actor and import no torch.

A gang's placement group reserves its ranks' CPUs (and class resources) only while it runs, so
that the service's other jobs get them back when it ends; an actor inside a bundle would die with
it. A warm rank therefore runs beside its bundle: no resources of its own, pinned to the node Ray
placed the bundle on (as the shared pool's burst workers are). Shape, for reuse: the node, the
device, and whether the rank reads its graph (a waiting rank's nice lasts for its process,
scheduler/gang_actor.py). GPU gangs are not kept: a rank's GPU is its bundle's, and a warm actor
would hold none of it, so theirs start with each gang, inside their bundles.

Isolation between gangs is the sandbox's, as for the pool's workers: a rank's child never serves
another gang (GangRank.rest, as it goes back), and its per-gang state is set afresh (begin). A
gang that failed or was stopped has its actors killed, never kept. Idle ones stop after the
service's `idle_s` (`sweep`, from its heartbeat) and all of them with the service (`close`).
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

Shape = tuple[str, str, bool]  # node id, device, reads


@dataclass(eq=False)
class _Warm:
    actor: Any
    shape: Shape
    idle_since: float = field(default_factory=time.monotonic)


class WarmRanks:
    """The service's warm gang ranks, by shape (bookkeeping only: scheduler/ray_pool.py's
    GangRunner starts, readies and stops them)."""

    def __init__(self, idle_s: float):
        self.idle_s = idle_s
        self._idle: list[_Warm] = []
        self._out: dict[Any, Shape] = {}  # actor id → shape, of ranks lent to running gangs
        self._lock = threading.Lock()
        self._names = itertools.count()
        self.started = self.reused = 0

    @staticmethod
    def keeps(bundle: dict[str, float]) -> bool:
        return not bundle.get("GPU")

    def take(self, shape: Shape) -> Any | None:
        """An idle rank of that shape, or None: the caller starts one (named `new_name()`)."""
        with self._lock:
            warm = next((w for w in self._idle if w.shape == shape), None)
            if warm is None:
                return None
            self._idle.remove(warm)
            self.reused += 1
            return warm.actor

    def new_name(self) -> str:
        with self._lock:
            self.started += 1
            return f"farm-service/gang-rank/{next(self._names)}"

    def lend(self, actor: Any, shape: Shape) -> None:
        with self._lock:
            self._out[actor._actor_id] = shape

    def back(self, actors: list[Any], kept: bool) -> list[Any]:
        """Ranks whose gang ended: kept warm where it returned (`kept`), their children replaced
        at once; returns those the caller must stop (all of them otherwise)."""
        with self._lock:
            shapes = [self._out.pop(a._actor_id, None) for a in actors]
            if not kept:
                return actors
            self._idle.extend(_Warm(actor, shape) for actor, shape in zip(actors, shapes))
        for actor in actors:
            actor.rest.remote()
        return []

    def sweep(self) -> list[Any]:
        """Idle ranks past `idle_s`, taken out: the caller stops them."""
        now = time.monotonic()
        with self._lock:
            old = [w for w in self._idle if now - w.idle_since > self.idle_s]
            self._idle = [w for w in self._idle if w not in old]
        return [w.actor for w in old]

    def close(self) -> list[Any]:
        """Every idle rank, taken out (ranks of running gangs are stopped with their gang)."""
        with self._lock:
            idle, self._idle = self._idle, []
        return [w.actor for w in idle]

    def load(self) -> dict[str, int]:
        with self._lock:
            return {"idle": len(self._idle), "running": len(self._out), "started": self.started,
                    "reused": self.reused}
