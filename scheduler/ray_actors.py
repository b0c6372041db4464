"""The body of a pool slot's Ray actor, `CompileWorker`: what runs inside it (scheduler/ray_pool.py
places it). It imports no torch: torch is its sandbox child's (workers/sandbox/), so a worker
costs one torch import, not two. A gang rank's body is scheduler/gang_rank.py."""
from __future__ import annotations

import os
import socket
import threading

import ray

from storage import CacheConfig, store_from_uri
from workers.backends.cpu_isa import cpu_fingerprint
from workers.pipeline import run_unit
from workers.sandbox import tempdirs
from workers.sandbox.process import Sandbox
from workers.unit import Unit, UnitLimits, UnitResult


class CompileWorker:
    """One per slot; runs units one at a time for as long as the job lasts."""

    def __init__(self, store_uri: str, limits: UnitLimits, device: str, lowers: bool = False,
                 imports: tuple[str, ...] = ()):
        tempdirs.sweep_orphans()  # what a killed predecessor on this host left behind
        self.store = store_from_uri(store_uri, CacheConfig.from_env())  # a local disk tier per node
        self.where = f"{socket.gethostname()}/node-{ray.get_runtime_context().get_node_id()[:8]}/pid-{os.getpid()}"
        # warm across units; replaced after a unit that failed in it; `imports`: its placement's warm_imports
        self.sandbox = Sandbox(lowers=lowers, imports=imports)
        self.sandbox.prestart(limits, device)  # its zygote imports torch while the pool starts
        # what the host's CPU runs (asked of Inductor once per host, seconds of probe builds): learnt
        # while the child starts, and before the first unit's clock starts
        self.host_facts = threading.Thread(target=cpu_fingerprint if device == "cpu" else lambda: None, daemon=True)
        self.host_facts.start()
        self.served: str | None = None  # the job whose unit the sandbox child last ran (a farm service's worker)
        self._child = threading.Lock()  # a threaded actor: `rest` and `run` take the child in turn

    def pid(self) -> int:
        return os.getpid()

    def warm(self) -> int:
        """Returns once its sandbox child is up (torch imported) and the host's CPU is known: the
        pool counts the worker as started from then, so a unit waits in the queue, where whichever
        worker is free first takes it, and not inside a worker still importing torch. A child that
        failed to start is left to the first unit, which fails saying why."""
        self.host_facts.join()
        with self._child:
            self.sandbox.wait_started()
        return os.getpid()

    def run(self, unit: Unit, job: str | None = None, niceness: int = 0) -> UnitResult:
        self.host_facts.join()
        with self._child:
            if job is not None and self.served not in (None, job):
                self.sandbox.renew()  # no child serves two jobs (the pool normally renewed it while idle)
            self.served = job
            self.sandbox.yield_cpu(niceness)
            result = run_unit(unit, self.store, self.sandbox)
        result.worker = self.where
        return result

    def rest(self) -> None:
        """Idle in a farm service: the child that served a job is replaced by a fresh one, forked
        now by the sandbox's zygote, so the next unit, of whichever job, finds it warm and clean."""
        with self._child:
            if self.served is not None:
                self.sandbox.renew()
                self.served = None

    def close(self) -> None:
        self.sandbox.close()
