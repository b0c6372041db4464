"""Whether this host can build a target, asked early and answered once per host and toolchain.

On a host whose Inductor cache is fresh, the CPU backends' check imports Inductor and compiles
and loads a probe program per vector ISA (seconds: a third of a small model's compile). A CPU
target's answer depends only on the host's CPU and the toolchain, so a "yes" is kept on disk,
in the node's dir (whatever Inductor cache dir a worker uses), keyed by those: a host's second worker
reads it (waiting on a file lock while the first computes it) and never imports Inductor for
it. Other devices (a GPU may be busy now and free later) and problems are asked every time.

It needs no program, so a unit that must load its program starts it in a thread meanwhile, and
a gang while its ranks agree. The thread, and the compilers it starts, run at a low priority:
on idle cores only, so a gang whose sandboxes all load at once (and may then fail) is not slowed
by checks it never uses. A gang's rank 0 that compiles while the other ranks start
(workers/gang/early.py) needs the answer first: it asks `urgent`ly, at the normal priority,
ahead of those ranks' start."""
from __future__ import annotations

import importlib.metadata
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from workers.backends import resolve
from workers.backends.inductor_host import cpu_identity, kept_on_host
from workers.sandbox.env import shared_cache_dir
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
            asked = _asked[target.label] = (_urgent if urgent else _checker).submit(_answer, target)
        return asked


def problem(target: Target) -> str | None:
    return start(target).result()


def _answer(target: Target) -> str | None:
    backend = resolve(target)
    if backend.device != "cpu":
        return backend.host_problem(target)
    asked = {"target": target.label, "host": cpu_identity(), "toolchain": backend.toolchain(target),
             "torch": importlib.metadata.version("torch"), "python": sys.executable}
    answer = kept_on_host(shared_cache_dir(), "", asked, lambda: {"problem": backend.host_problem(target)},
                          keep=lambda record: record.get("problem") is None)  # a problem is asked again
    return answer["problem"]
