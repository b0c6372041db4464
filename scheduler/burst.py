"""Burst workers of a farm service's shared pool (scheduler/shared_pool.py, which mixes this in).

A person's unit must not wait for a nightly's to end: beside a CPU class's workers the pool keeps
`burst_workers` more, warm, that serve only interactive units, and only while every worker of the
class is busy and one of them with a lower class's unit. They take no CPU of Ray's (placed on a
node that offers the class), and the kernel gives them the CPU: lower classes' sandbox children
run niced (scheduler/fair.py, NICENESS). So an interactive unit starts at once, on a warm worker,
and compiles at nearly its speed alone; the nightly loses only the CPU it uses. A burst worker
stops with the last worker of its class; one that cannot be started is not tried again for
BURST_RETRY_S (its class then waits as it would without).

A class's burst workers start the first time it is busy that way (a nightly or batch job filling
its workers), not with its first worker: each is a worker process and a sandbox that imports
torch (seconds of CPU, and its memory, held while idle), which a service that serves people's
jobs alone never uses. A nightly fills the pool from its first units, so they are warm long before
a person's job comes; one that comes in the seconds after waits for a burst worker's start, not
for the nightly.
"""
from __future__ import annotations

import logging
import time

log = logging.getLogger("scheduler.shared_pool")
BURST_CLASS = "interactive"  # the class burst workers serve
BURST_RETRY_S = 60.0  # after a burst worker failed to start, its class gets none for this long


class BurstWorkers:
    """The shared pool's rules for its burst workers; they use its slots, queues and dispatch."""

    def _burst(self, now: float) -> None:
        """Burst workers (see the module's doc): started once a CPU class is busy with a lower
        class's unit, then kept warm beside its workers for as long as it has any, serving
        interactive units only while the class is busy with a lower one."""
        for resource, (placement, _, _) in self._placements.items():
            workers = [s for s in self.slots if s.resource == resource and not s.burst]
            bursts = [s for s in self.slots if s.resource == resource and s.burst]
            busy = self._busy_below(resource)
            for slot in [s for s in bursts if s.free]:
                p = self._take(slot, BURST_CLASS) if busy else None
                if p is not None:
                    self._dispatch(slot, p, now)
                elif not workers:
                    self._retire(slot)
                elif not slot.rested:
                    self.cluster.rest(slot.actor)
                    slot.rested = True
            if busy and placement.gpus == 0 and len(bursts) < self.config.burst_workers and \
                    now >= self._burst_after.get(resource, 0.0):
                slot = self.slot_class(resource, self._next_index, burst=True)
                self._next_index += 1
                try:
                    self._start(slot, resource)
                except Exception as e:  # noqa: BLE001 - no node for it now: the class waits as it would without
                    log.warning("farm shared pool: no burst worker for %s (%s)", resource, e)
                    self._burst_after[resource] = now + BURST_RETRY_S
                    continue
                self.slots.append(slot)

    def _busy_below(self, resource: str) -> bool:
        """Every worker of the class runs a unit, and one of them a unit of a class below interactive."""
        workers = [s for s in self.slots if s.resource == resource and not s.burst]
        return bool(workers) and all(s.future is not None for s in workers) and \
            any(self._priority(s.job) != BURST_CLASS for s in workers)

    def _burst_failed(self, slot, error: BaseException) -> None:
        """A burst worker died starting: its class waits as it would without one, and gets no other
        try for BURST_RETRY_S."""
        log.warning("farm shared pool: burst worker for %s did not start (%s)", slot.resource, error)
        self._burst_after[slot.resource] = time.monotonic() + BURST_RETRY_S
        self._retire(slot)
