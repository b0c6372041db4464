"""The body of a gang rank's Ray actor, `GangRank` (started by the torch-free shell
scheduler/gang_actor.py, after its nice). Rank 0 hosts the store the gang's process group forms
through; every rank imports torch for its gloo group."""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import socket
from pathlib import Path
from typing import Any

import ray

from storage import CacheConfig, store_from_uri
from workers import host_check
from workers.gang.early import EarlyCompile, compiles_early
from workers.gang.rank import GangComm, read_own_graph, run_rank
from workers.gang.rendezvous import open_store
from workers.sandbox.process import Sandbox
from workers.unit import Gang, Target, UnitLimits, UnitResult


class GangRank:
    """What a gang's rank does, in its actor (scheduler/gang_actor.py's `GangMember`). Rank 0
    hosts the store the gang's process group forms through."""

    def __init__(self, store_uri: str, target: Target, limits: UnitLimits, device: str, rank: int, reads: bool,
                 identical_ranks: bool, sandbox: Sandbox | None = None):
        self.store = store_from_uri(store_uri, CacheConfig.from_env())
        self.host, self.device, self.reads = ray.util.get_node_ip_address(), device, reads
        self.sandbox = sandbox or Sandbox(network=True)  # its children verify through the gang's collectives
        self.begin(store_uri, target, limits, rank, identical_ranks)

    def begin(self, store_uri: str, target: Target, limits: UnitLimits, rank: int, identical_ranks: bool) -> None:
        """Ready for a gang's rank: its first, or a later gang of the same shape in a farm service
        (scheduler/gang_warm.py), which finds it with torch imported and, reading, a fresh child."""
        if store_uri != self.store.uri:
            self.store = store_from_uri(store_uri, CacheConfig.from_env())
        self.rank = rank
        self.rendezvous = None  # rank 0's, of this gang (a rank that hosted the last gang's must not reuse it)
        self.held = contextlib.ExitStack()  # the rank's work dir, from `read` to the end of `run`
        self.tmp: Path | None = None
        self.own: dict[str, Any] = {}  # what its graph says (`read`)
        self.early: EarlyCompile | None = None
        if self.reads:  # it loads its archive first thing (Gang.reader_of); the others start theirs if they need it
            self.sandbox.prestart(limits, self.device)
        # Whether this host can build the target, asked by one rank (its probe builds serve the gang's
        # ranks on this host; four ranks that load and may then diverge are not slowed by four) and
        # as the rank starts: asked with its graph's load, the answer kept rank 0's compile waiting.
        # Urgently where rank 0 reads for all: it compiles early, and the others start after the answer.
        if rank == 0:
            host_check.start(target, urgent=identical_ranks)

    def host_store(self, timeout_s: float) -> tuple[str, int]:
        self.rendezvous = open_store(self.host, 0, True, timeout_s)
        return self.host, self.rendezvous.port

    def read(self, gang: Gang) -> None:
        """Read this rank's graph, before the gang's process group forms: the load overlaps the other
        ranks' start. Rank 0 of identical ranks then starts compiling (workers/gang/early.py) and
        answers once that compile has the host check's answer, so that ranks started after this
        call (scheduler: `GangRunner`) take no CPU from its load and probe."""
        self.tmp = self.held.enter_context(self.sandbox.workdir("gang"))
        self.own = read_own_graph(gang, self.rank, self.store, self.sandbox, self.tmp)
        if compiles_early(gang, self.rank, self.own):
            self.early = EarlyCompile(gang.ranks[0], self.store, self.sandbox)
            concurrent.futures.wait([host_check.start(gang.ranks[0].target)])

    def run(self, gang: Gang, address: tuple[str, int] | None) -> UnitResult:
        timeout = gang.collective_timeout_s
        try:
            store = self.rendezvous or open_store(address[0], address[1], False, timeout)
            comm = GangComm(store, self.rank, gang.world_size, timeout, gang.ranks[self.rank].limits.timeout_s)
            try:
                result = run_rank(comm, gang, self.own, self.store, self.sandbox, self.host, self.tmp, self.early)
            finally:
                comm.close()
        finally:
            if self.early is not None:  # the group never formed: it stops, publishing nothing
                self.early.cancel("the gang's process group did not form")
            self.held.close()
        result.worker = f"{socket.gethostname()}/pid-{os.getpid()}/rank-{self.rank}"
        return result

    def rest(self) -> None:
        """Between gangs (scheduler/gang_warm.py): the child that served this one never serves
        another. A reading rank's fresh one is forked now, so the next gang finds it warm; a
        waiting rank rests without one, as it starts (most gangs never need its child)."""
        if self.reads:
            self.sandbox.renew()
        else:
            self.sandbox.stop_child()

    def close(self) -> None:
        self.sandbox.close()
