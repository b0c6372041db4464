"""Whether this host can build a target, asked early and answered once per host and toolchain.

On a host whose Inductor cache is fresh, the CPU backends' check imports Inductor and compiles
and loads a probe program per vector ISA (seconds: a third of a small model's compile). A CPU
target's answer depends only on the host's CPU and the toolchain, so a "yes" is kept on disk,
in Inductor's cache dir beside the probes it came from, keyed by those: a host's second worker
reads it (waiting on a file lock while the first computes it) and never imports Inductor for
it. Other devices (a GPU may be busy now and free later) and problems are asked every time.

It needs no program, so a unit that must load its program starts it in a thread meanwhile, and
a gang while its ranks agree. The thread, and the compilers it starts, run at a low priority:
on idle cores only, so a gang whose sandboxes all load at once (and may then fail) is not slowed
by checks it never uses. A gang's rank 0 that compiles while the other ranks start
(workers/gang/early.py) needs the answer first: it asks `urgent`ly, at the normal priority,
ahead of those ranks' start."""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from filelock import FileLock

from workers.backends import resolve
from workers.backends.inductor_host import RECORDS, cpu_identity
from workers.sandbox.env import inductor_cache_dir
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
    digest = hashlib.sha256(json.dumps(asked, sort_keys=True, default=str).encode()).hexdigest()[:32]
    path = Path(inductor_cache_dir()) / RECORDS / f"{digest}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock", timeout=600):
        try:
            if json.loads(path.read_text()) == {**asked, "problem": None}:
                return None
        except (OSError, ValueError):
            pass  # not asked yet on this host and toolchain, or a torn file: ask
        found = backend.host_problem(target)
        if found is None:
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps({**asked, "problem": None}, default=str))
            os.replace(partial, path)
        return found
