"""Weighted fair share between the jobs a farm service runs at once: which job a free worker
serves next. Pure rules, no Ray (tests/test_fair.py).

Each job has a priority class with a weight (PRIORITY_WEIGHTS). A free worker goes to the job,
among those with a unit it can build, that has the fewest running units per unit of weight; on a
tie, to the one that has been served least per unit of weight (its virtual time), then to the
higher class, then to the oldest. So:
- a job that runs nothing wins over every job that runs something: a 1-unit interactive job
  starts as soon as one worker frees, whatever else is queued;
- nothing starves: every running job either runs a unit or, on one worker, advances its virtual
  time by 1/weight per unit while others advance theirs, so a nightly gets at least one unit in
  every (sum of weights) units the worker runs;
- jobs of one class share equally, and `limits.workers` caps a job's running units.
A job that joins later starts at the smallest virtual time of those running, so it neither
takes the pool over to catch up nor waits behind older jobs' history.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterable, Literal

Priority = Literal["interactive", "batch", "nightly"]
# Shares a job of each class gets against the others when all want more workers than there are.
PRIORITY_WEIGHTS: dict[str, float] = {"interactive": 16.0, "batch": 4.0, "nightly": 1.0}
DEFAULT_PRIORITY: Priority = "batch"
# The niceness of a class's sandbox children (workers/sandbox/process.py, `yield_cpu`): where units
# of several classes share a node's cores, the kernel gives an interactive unit's compile most of
# the CPU (nice 10 weighs about a tenth of nice 0). Alone, a niced unit runs as fast as any.
NICENESS: dict[str, int] = {"interactive": 0, "batch": 5, "nightly": 10}


class UnknownPriority(ValueError):
    """A priority that is not one of PRIORITY_WEIGHTS."""


def weight_of(priority: str) -> float:
    try:
        return PRIORITY_WEIGHTS[priority]
    except KeyError:
        raise UnknownPriority(f"unknown priority {priority!r}: use one of {', '.join(PRIORITY_WEIGHTS)}") from None


@dataclass
class Share:
    job_id: str
    priority: str
    cap: int | None = None  # the most units it may run at once (the job's limits.workers)
    running: int = 0
    served: float = 0.0  # virtual time: units started / weight
    order: int = 0

    @property
    def weight(self) -> float:
        return weight_of(self.priority)

    @property
    def capped(self) -> bool:
        return self.cap is not None and self.running >= self.cap


@dataclass
class FairShare:
    shares: dict[str, Share] = field(default_factory=dict)
    _order: itertools.count = field(default_factory=itertools.count)

    def add(self, job_id: str, priority: str, cap: int | None = None) -> Share:
        weight_of(priority)  # refuse an unknown one before anything is queued
        start = min((s.served for s in self.shares.values()), default=0.0)
        share = Share(job_id, priority, cap, served=start, order=next(self._order))
        self.shares[job_id] = share
        return share

    def remove(self, job_id: str) -> None:
        self.shares.pop(job_id, None)

    def pick(self, wanting: Iterable[str]) -> str | None:
        """The job a free worker serves next, among those with a unit it can take; None if every
        one of them is at its cap."""
        open_ = [self.shares[j] for j in set(wanting) if j in self.shares and not self.shares[j].capped]
        best = min(open_, key=lambda s: (s.running / s.weight, s.served, -s.weight, s.order), default=None)
        return best.job_id if best else None

    def started(self, job_id: str) -> None:
        share = self.shares.get(job_id)
        if share is not None:
            share.running += 1
            share.served += 1.0 / share.weight

    def stopped(self, job_id: str) -> None:
        share = self.shares.get(job_id)
        if share is not None and share.running > 0:
            share.running -= 1
