"""The process's kept sandbox: one zygote (torch imported once) that serves this process's jobs
one after another, whether they run in process (scheduler/jobs.py, run_in_process), place their
units for Ray workers (scheduler/pool.py) or check their hot sizes (scheduler/plan.py). A
notebook, a test process or a farm service's scheduler that runs job after job then pays torch's
import once, not once per job and step.

Isolation between jobs is the zygote's (workers/sandbox/zygote.py): every job gets a child of its
own, forked fresh, and no child serves two jobs (`renew` as a job lets go of it). Two jobs at once
(threads) do not share it: the one that finds it taken gets a sandbox of its own for that job.
"""
from __future__ import annotations

import atexit
import contextlib
import threading
from typing import Iterator

from workers.sandbox.process import Sandbox

KEPT = Sandbox()  # started by its first job, kept warm for the next
_LOCK = threading.Lock()
atexit.register(KEPT.close)


@contextlib.contextmanager
def warm_sandbox() -> Iterator[Sandbox]:
    """The kept sandbox for one job (or a fresh one while another job holds it); its child
    serves only this job. A child started under another environment than a fresh one would
    get now (another TORCHINDUCTOR_CACHE_DIR, CXX, ...) is replaced first."""
    kept = _LOCK.acquire(blocking=False)
    if kept:
        KEPT.restart_if_environment_changed()
    try:
        with contextlib.nullcontext(KEPT) if kept else Sandbox() as sandbox:
            yield sandbox
    finally:
        if kept:
            KEPT.renew()  # warm children serve one job: the next gets a fresh one, forked now
            _LOCK.release()
