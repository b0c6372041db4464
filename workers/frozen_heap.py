"""Heavy imports (torch's, Dynamo's, Inductor's) with the cyclic GC paused while they run and
their heap frozen after, for the processes of ours that import torch to serve work: a sandbox's
zygote (workers/sandbox/zygote.py) and a Ray task's worker (scheduler/ray_tasks.py, run_tasks)."""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def heap_frozen_after() -> Iterator[None]:
    """The cyclic GC paused in the block, then what it made frozen (gc.freeze: the permanent
    generation, which no collection walks). torch's, Dynamo's and Inductor's imports make a heap
    of about 460,000 tracked objects, and the GC walked it again and again as it grew: about 1,100
    collections, 7 of them full, 0.8 of the 3.6 CPU-s those imports took here. Frozen, it is not
    walked again by this process's collections nor by its forked children's, which then leave
    its pages shared with the parent (what the gc module's docs advise for a process that
    forks). The imports' own garbage (about 20,000 objects in cycles, a few MB) stays: a full
    collection to free it cost 0.4 CPU-s."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()
