"""The actor a gang's rank runs in: a shell that imports no torch, so that a rank with nothing of
its own to read lowers its CPU priority before it pays for torch's import, and the rank that
reads starts its sandbox (whose zygote imports torch in turn) before it imports its own: the two
imports overlap, and rank 0's compile starts a second sooner on 2 cores.

Where a node has fewer free cores than the gang has ranks (a gang of 4 on 2 cores), starting
the ranks is most of a gang's overhead: every rank imports torch for its gloo group, while the
gang waits on one of them, the rank that reads the graph (`Gang.reader_of`) and compiles it. A
rank whose archive has the same bytes as a lower rank's only joins the collectives and takes
that rank's artifact. It is started once rank 0 has read its graph (scheduler/ray_pool.py's
`GangRunner`; rank 0 of identical ranks is by then compiling, workers/gang/early.py), and runs
at a low priority from its first line, so rank 0's start, load and compile get the cores first.

That priority is its session's: rank 0 compiles in a sandbox child, a session of its own, and
Linux's autogroup scheduling shares the CPU between sessions by each session's niceness alone
(workers/sandbox/policing.py), while a Ray actor is in the session of the node's Ray processes.
So a waiting rank starts a session of its own first, at that niceness (bench/gang.py on 2 cores,
3 gangs each way: 21.5 s against 22.2 s at nice 19 in the Ray session; rank 0's lowering 17.4 s
against 17.9 s, and 16.1 s alone).
"""
from __future__ import annotations

import os
from typing import Any

# Linux: this thread and what it starts (a sandbox child, gloo's threads); below the host check's 10
WAITING_NICE = 19


def _wait_in_a_session_of_its_own() -> None:
    """This process at WAITING_NICE, in a session of its own at that niceness (see the module's
    doc); where it cannot start one, at its niceness within the Ray processes' session."""
    from workers.sandbox.policing import renice

    try:
        os.setpgid(0, os.getpgid(os.getppid()))  # a process group leader cannot start a session
        try:
            os.setsid()  # its own process group again (Ray stops the actor by its pid), and its own session
        except OSError:
            os.setpgid(0, 0)
            raise
    except OSError:
        os.nice(WAITING_NICE)
        return
    renice(os.getpid(), WAITING_NICE)


class GangMember:
    """One rank of a gang, started in the gang's placement group bundle for that rank, living as
    long as the gang; or, in a farm service, beside the bundle and kept warm for later gangs of
    the same shape (scheduler/gang_warm.py). Its work: scheduler/gang_rank.py's `GangRank`. A
    waiting rank's nice lasts for the process: a warm one only ever serves as a waiting rank."""

    def __init__(self, store_uri: str, target: Any, limits: Any, device: str, rank: int, reads: bool,
                 identical_ranks: bool):
        sandbox = None
        if reads:  # its sandbox's zygote imports torch while this process imports its own
            from workers.sandbox.process import Sandbox

            sandbox = Sandbox(network=True)  # its children verify through the gang's collectives
            sandbox.prestart(limits, device)
        else:
            _wait_in_a_session_of_its_own()
        from scheduler.gang_rank import GangRank  # torch, the store, the pipeline: after the nice

        self.rank = GangRank(store_uri, target, limits, device, rank, reads, identical_ranks, sandbox)

    def begin(self, store_uri: str, target: Any, limits: Any, rank: int, identical_ranks: bool) -> None:
        self.rank.begin(store_uri, target, limits, rank, identical_ranks)

    def rest(self) -> None:
        self.rank.rest()

    def host_store(self, timeout_s: float) -> tuple[str, int]:
        return self.rank.host_store(timeout_s)

    def read(self, gang: Any) -> None:
        self.rank.read(gang)

    def run(self, gang: Any, address: tuple[str, int] | None) -> Any:
        return self.rank.run(gang, address)

    def close(self) -> None:
        self.rank.close()
