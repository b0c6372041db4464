"""Pool workers that a driver keeps between the jobs it runs one after another (a zoo run without
a farm service: one job per group of its entries, scheduler/pool.py's pool for each).

Without them every job started its workers again: a Ray worker process, a sandbox zygote
importing torch and Inductor, and its first lowering's warm-up, per slot and per job. With them
the next job takes the workers the last one left idle, when they are of the shape it needs
(device class, placement with the classes it holds, device, store), and starts only the rest.
A kept worker that the next job does not take is stopped as that job has started its own, so
it never holds Ray resources another worker waits for.

Isolation between jobs is the sandbox's, as for a farm service's workers: a kept worker rests
(its child is replaced by a fresh one, CompileWorker.rest), and a unit of another job renews
the child again if it had not (CompileWorker.run). A worker that died, failed to start or was
busy when its job ended is never kept. The owner stops what is left (`close`) when it is done:
scheduler.ray_pool.close_workers. Bookkeeping only: the pool starts, readies and stops actors.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from workers.backends import Placement


@dataclass(frozen=True)
class Shape:
    """What a kept worker can serve: it asked Ray for the placement's resources, its sandbox is
    for the device, and it reads and writes the store."""
    resource: str
    placement: Placement
    device: str
    store_uri: str


class WarmWorkers:
    def __init__(self, owner: str):
        self.owner = owner  # kept workers are named for it, not for the job that started them
        self._idle: list[tuple[Any, Shape]] = []
        self._names = itertools.count()
        self.reused = 0  # workers a job took instead of starting one

    def take(self, shape: Shape) -> Any | None:
        """An idle worker of that shape, or None: the caller starts one (named `new_name`). The
        first kept goes first: the pool keeps the last busy first, so a job smaller than the one
        before runs on the workers that ran its units, and one that got none is what is stopped."""
        for i, (actor, kept) in enumerate(self._idle):
            if kept == shape:
                del self._idle[i]
                self.reused += 1
                return actor
        return None

    def new_name(self, resource: str) -> str:
        return f"{self.owner}/farm-worker/{resource}/{next(self._names)}"

    def keep(self, actor: Any, shape: Shape) -> None:
        self._idle.append((actor, shape))

    def close(self) -> list[Any]:
        """The idle workers, for the caller to stop; none are kept after."""
        idle, self._idle = [actor for actor, _ in self._idle], []
        return idle

    def __len__(self) -> int:
        return len(self._idle)
