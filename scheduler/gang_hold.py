"""How a farm service's shared pool (scheduler/shared_pool.py, which mixes this in) makes room
for a gang.

A gang needs whole placement groups: `hold(cpus, slots)` lowers the pool's size while it places
and runs, and the number of workers of the gang's device class (the slots of it the gang's
bundles take), so workers over either stop as soon as their unit ends (an idle one at once) and
Ray can reserve the gang's bundles: a gang of x86-64 ranks needs the x86-64 node's slots, whatever
CPUs other nodes have. Other jobs keep the workers that are left, and those that left start
again once the gang is done (warm for the next job, then idle as any).
"""
from __future__ import annotations

import collections
import contextlib
from typing import Iterator


class GangHolds:
    """The shared pool's rules for what it lends gangs; they use its slots, offer and lock."""

    @contextlib.contextmanager
    def hold(self, cpus: int, slots: dict[str, float] | None = None) -> Iterator[None]:
        """Lend `cpus` of the pool's CPUs, and `slots` of device classes (class → how many of its
        slots the gang's bundles take), to a gang while it runs (see the module's doc)."""
        slots = collections.Counter(slots or {})
        with self._lock:
            self._held += cpus
            self._held_slots.update(slots)
        self._wake.set()  # workers over what is left leave now, not at the pool's next timed round
        try:
            yield
        finally:
            with self._lock:
                self._held -= cpus
                self._held_slots.subtract(slots)
                self._held_slots = +self._held_slots  # (classes lent no more drop out)
            self._wake.set()  # those that left start again

    def _capacity(self) -> int:
        offered = int(self._offered.get("CPU", 1))
        return max(0, min(self.config.max_workers or offered, offered) - self._held)

    def _make_room_for_gangs(self, workers: list, capacity: int) -> None:
        """Workers over the pool's size, or over what gangs leave of their class, leave: idle ones
        at once, busy ones when their unit ends; ones leaving stay if the pool grew back first."""
        over = self._over_held_slots(workers)  # their class's slots are a gang's now
        staying = [s for s in workers if not s.leaving and s not in over]
        for slot in [s for s in workers if s.leaving and s not in over][: max(0, capacity - len(staying))]:
            slot.leaving = False  # the pool grew again (a gang ended) before its unit did
            staying.append(slot)
        leave = over + sorted(staying, key=lambda s: s.future is not None)[: max(0, len(staying) - capacity)]
        for slot in leave:
            if slot.future is None:  # idle ones leave first, at once; busy ones when their unit ends
                self._retire(slot, for_gang=True)
            else:
                slot.leaving = True

    def _owed(self) -> str | None:
        """The class of a worker that left for a gang, once the pool has room for it again (and a
        gang holds no slot of that class it would take)."""
        workers = collections.Counter(s.resource for s in self.slots if not s.burst)
        offer = self._unheld_offer()
        back = next((c for c in self._lent if workers[c] < int(offer.get(c, 0))), None)
        if back is not None:
            self._lent.remove(back)
        return back

    def _unheld_offer(self) -> dict[str, float]:
        """What the cluster offers, less the device classes' slots lent to gangs."""
        return {r: n - self._held_slots.get(r, 0) for r, n in self._offered.items()}

    def _over_held_slots(self, workers: list) -> list:
        """Workers of a class beyond the slots of it that gangs leave: busy ones stay first (they
        leave as their unit ends), so idle ones go at once."""
        offer, over = self._unheld_offer(), []
        for resource in self._held_slots:
            mine = sorted((s for s in workers if s.resource == resource), key=lambda s: s.future is None)
            over += mine[max(0, int(offer.get(resource, 0))):]
        return over
