"""Whether this host can build a target, asked early and answered once per process.

On a host whose Inductor cache is fresh, the CPU backends' check compiles and loads a probe
program per vector ISA (seconds: a third of a small model's compile). It needs no program, so a
unit that must load its program starts it in a thread meanwhile, and a gang while its ranks agree.
The thread, and the compilers it starts, run at a low priority: on idle cores only, so a gang
whose sandboxes all load at once (and may then fail) is not slowed by checks it never uses.
A gang's rank 0 that compiles while the other ranks start (workers/gang/early.py) needs the
answer first: it asks `urgent`ly, at the normal priority, ahead of those ranks' start.
A host that can build a target keeps that answer; a problem is asked again next time (a GPU
that was busy may be free)."""
from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from workers.backends import resolve
from workers.unit import Target

_checker = ThreadPoolExecutor(1, thread_name_prefix="farm-host-check", initializer=os.nice, initargs=(10,))  # Linux: this thread
_urgent = ThreadPoolExecutor(1, thread_name_prefix="farm-host-check-urgent")
_asked: dict[str, Future[str | None]] = {}
_lock = threading.Lock()


def start(target: Target, urgent: bool = False) -> Future[str | None]:
    """The check's answer to come: why this host cannot build the target, or None."""
    with _lock:
        asked = _asked.get(target.label)
        if asked is None or (asked.done() and (asked.exception() is not None or asked.result() is not None)):
            asked = _asked[target.label] = (_urgent if urgent else _checker).submit(resolve(target).host_problem, target)
        return asked


def problem(target: Target) -> str | None:
    return start(target).result()
