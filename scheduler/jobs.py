"""Running a whole job: plan it, run its units with some runner, keep the results.

Runners are callables that take units and report each result once through `on_result`;
the in-process runner lives here, the Ray one beside it."""
from __future__ import annotations

import datetime as dt
import secrets
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

from farm.spec import JobSpec, job_to_yaml
from scheduler.plan import plan
from storage import Store
from storage.results import write_results
from workers.pipeline import run_unit
from workers.unit import Unit, UnitResult


class Events(Protocol):
    def planned(self, units: list[Unit]) -> None: ...
    def started(self, unit: Unit) -> None: ...
    def finished(self, unit: Unit, result: UnitResult) -> None: ...


class NoEvents:
    def planned(self, units: list[Unit]) -> None: ...
    def started(self, unit: Unit) -> None: ...
    def finished(self, unit: Unit, result: UnitResult) -> None: ...


Runner = Callable[[list[Unit], Store, Events], Iterable[tuple[Unit, UnitResult]]]


def run_in_process(units: list[Unit], store: Store, events: Events) -> Iterable[tuple[Unit, UnitResult]]:
    for unit in units:
        events.started(unit)
        result = run_unit(unit, store)
        events.finished(unit, result)
        yield unit, result


@dataclass
class JobOutcome:
    job_id: str
    store_uri: str
    results: list[UnitResult] = field(default_factory=list)
    wall_s: float = 0.0

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)


def new_job_id(name: str) -> str:
    return f"{name}-{dt.datetime.now(dt.timezone.utc):%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def execute(job: JobSpec, store: Store, runner: Runner = run_in_process, events: Events = NoEvents()) -> JobOutcome:
    start = dt.datetime.now(dt.timezone.utc)
    outcome = JobOutcome(new_job_id(job.name), store.uri)
    store.put_job_file(outcome.job_id, "job.yaml", job_to_yaml(job).encode())
    units = plan(job, store)
    events.planned(units)
    for _, result in runner(units, store, events):
        outcome.results.append(result)
    outcome.wall_s = (dt.datetime.now(dt.timezone.utc) - start).total_seconds()
    write_results(store, outcome.job_id, (r.to_row(outcome.job_id) for r in outcome.results))
    return outcome
