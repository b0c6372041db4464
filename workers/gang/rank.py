"""One rank of a gang: a multi-rank model's ranks compiled together, agreeing through compiler
collectives (real torch.distributed calls among the gang's actors, `GangComm`).

Every rank runs `run_rank` at the same time, in its own gang actor, and makes the same calls in
the same order, so each collective meets all ranks:

1. *facts*: each rank loads its program in its sandbox, before the gang's process group forms
   (`read_own_graph`: the load overlaps with the other ranks' start; ranks whose archives have the same
   bytes as a lower rank's leave it to that rank, `Gang.reader_of`, and start their sandbox
   only if they compile or verify: on 2 cores, three needless torch imports were a third of a
   gang's time); the ranks all-gather what their graphs say: errors, the functional
   collectives in order, dynamic dimensions with their ranges, the example sizes, the sizes a
   torch.compile lowering observes. Every rank then runs the same
   comparisons (workers/gang/collectives.py) on the same data, so all reach the same verdict: a
   rank that cannot take part, collectives that diverge, or ranges that conflict fail the gang
   before anything compiles, with the report naming ranks.
2. *agreement*: ranks whose dynamic dimensions or example sizes differ from the agreed ones
   re-export their program with them; `inductor-cache` ranks mark the same dimensions dynamic.
3. *fingerprints*: the ranks all-gather their program identities; ranks with identical programs
   compile once (the lowest such rank, the *leader*), the others take its published artifact.
   Where every rank's archive has the same bytes, rank 0 starts that compile before the group
   forms, and publishes only once these collectives have confirmed it (workers/gang/early.py).
4. Graphs without collectives compile and verify on their leaders as any unit does. Graphs with
   collectives are verified in lockstep: every rank runs its artifact in its sandbox, whose
   children form their own process group, against its program run eagerly over the same group;
   the verdicts are all-gathered and nothing is published unless every rank's artifact verified.

Waiting for the ranks to start and while leaders compile uses the gang's store with the unit's timeout; every collective
has the gang's collective timeout, so a rank that dies or hangs fails the gang, never hangs it.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from storage import Lease, Store, StoreError
from storage.identities import put_identity
from workers import host_check
from workers.backends import LoweringError
from workers.errors import summary
from workers.gang.collectives import CollectiveOp, first_divergence, reconcile_dims
from workers.gang.early import EarlyCompile
from workers.gang.tune import GangTuning, NoCandidate, tune
from workers.keys import identity_variant
from workers.lookup import Found, UnitFailed, find, identify_in, lookup_unit, parse_identity
from workers.pipeline import (
    Checked,
    Compiled,
    Lowered,
    Outcome,
    UnitContext,
    check_artifact,
    claim_key,
    identify_program,
    lower_unit,
    publish,
    run_unit,
    take_hit,
    unit_key,
)
from workers.sandbox.process import Sandbox, SandboxFailed
from workers.unit import Gang, Unit, UnitResult

log = logging.getLogger(__name__)


class GangFailed(Exception):
    """The gang cannot go on; every rank reports the same message."""


class GangComm:
    """The gang actors' process group (gloo: what they exchange is small and lives on the CPU,
    whatever device the ranks compile for) and the store it was formed through."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout_s: float, start_s: float):
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        # Every rank first waits for the others to arrive, with the unit's timeout (start_s): the ranks
        # after rank 0 start at nice 19 while it compiles, and on a busy node their start (torch's
        # import) took longer than the collective timeout, which the group's forming would have had
        self.post(f"arrived/{rank}", True)
        self.await_posts([f"arrived/{r}" for r in range(world_size)], start_s, "the gang's other ranks to start")
        dist.init_process_group("gloo", store=dist.PrefixStore("compiler", store), rank=rank, world_size=world_size,
                                timeout=dt.timedelta(seconds=timeout_s))

    def all_gather(self, value: Any, what: str) -> list[Any]:
        """Every rank's JSON-able value, in rank order: bytes in a tensor, never a pickle."""
        data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
        try:
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
            dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64))
            longest = max(int(s) for s in sizes)
            padded = torch.zeros(longest, dtype=torch.uint8)
            padded[:data.numel()] = data
            gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
            dist.all_gather(gathered, padded)
        except RuntimeError as e:  # gloo: a peer closed its connection, or the timeout passed
            raise GangFailed(f"the compiler collective '{what}' failed on rank {self.rank}: a rank died or did not "
                             f"answer within {self.timeout_s:g}s ({summary(e)})") from e
        return [json.loads(g[:int(n)].numpy().tobytes()) for g, n in zip(gathered, sizes)]

    def post(self, key: str, value: Any) -> None:
        self.store.set(key, json.dumps(value))

    def await_posts(self, keys: list[str], timeout_s: float, what: str) -> list[Any]:
        """Values other ranks post when a long phase (a compile, their start) ends: waited for with
        the unit's timeout, not the collective one."""
        try:
            self.store.wait(keys, dt.timedelta(seconds=timeout_s))
        except RuntimeError as e:  # DistStoreError: the timeout passed, or the store's host died
            raise GangFailed(f"rank {self.rank} waited {timeout_s:g}s for {what}, which never came "
                             f"({summary(e)})") from e
        return [json.loads(self.store.get(k)) for k in keys]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _failed(unit: Unit, gang: Gang, message: str) -> UnitResult:
    return UnitResult(unit.graph, unit.target.label, "failed", error=f"gang {gang.label}: {message}")


def read_own_graph(gang: Gang, rank: int, store: Store, sandbox: Sandbox, workdir: Path) -> dict[str, Any]:
    """What this rank's graph says (`facts`) or why it cannot say (`error`), for the first
    collective. A rank reads it before the gang's process group forms: the reader's load then
    overlaps with the other ranks' start (their torch import), which it used to wait for."""
    unit = gang.ranks[rank]
    if unit.program is None:
        return {"error": unit.ingest_error or f"{unit.source} could not be read", "facts": None}
    if gang.reader_of(rank) != rank:
        return {"error": None, "facts": None}  # the rank that reads the same bytes speaks for it
    try:
        program = store.fetch(unit.program.digest, workdir / "program.pt2")
        reply = sandbox.call("identify", workdir, unit.limits, time.monotonic() + unit.limits.timeout_s,
                             device=gang.device, unit=unit, program=str(program), facts=True)
        identity, built_with = parse_identity(reply)  # kept, so naming the program later needs no second load
        put_identity(store, unit.program.digest, identity_variant(unit.target.weights, unit.specialize, unit.agreed),
                     {"identity": identity, "built_with": built_with})
        return {"error": None, "facts": reply.get("facts")}
    except (SandboxFailed, UnitFailed, OSError) as e:
        return {"error": str(e), "facts": None}


def run_rank(comm: GangComm, gang: Gang, own: dict[str, Any], store: Store, sandbox: Sandbox, host: str,
             workdir: Path, early: EarlyCompile | None = None) -> UnitResult:
    """This rank's part of compiling the gang, once it has read its graph (`read_own_graph`);
    every rank of the gang calls it at once. `early`: rank 0's compile, started before the
    group formed (workers/gang/early.py), which this confirms or stops."""
    rank = comm.rank
    unit = gang.ranks[rank]
    try:
        unit, has_collectives = _agree(comm, gang, unit, own, sandbox)
        leaders = _leaders(comm.all_gather(_fingerprint(unit, store, sandbox, workdir), "fingerprints"))

        def compile_as(unit: Unit) -> UnitResult:
            if has_collectives:
                return _Lockstep(comm, gang, leaders, host).run(unit, store, sandbox)
            return _each_alone(comm, gang, unit, leaders, store, sandbox, early)

        tuning = None
        if gang.candidates:
            unit, tuning = tune(comm, gang, unit, compile_as, split=not has_collectives, store=store, sandbox=sandbox)
        result = compile_as(unit)
        if tuning:
            result.target, result.candidate = unit.target.base_label, unit.target.candidate
            result.metrics.update(tuning.metrics())
            if leaders[rank] == rank:
                _keep_record(tuning, result, store)
    except (GangFailed, NoCandidate) as e:
        return _failed(unit, gang, str(e))
    finally:
        if early is not None:  # once confirmed, nothing; else it stops and publishes nothing
            early.cancel("the gang did not agree")
    result.metrics.update(gang_rank=float(rank), gang_world_size=float(gang.world_size),
                          gang_leader=float(leaders[rank]), gang_graphs=float(len(set(leaders))))
    if result.status == "failed" and result.error and not result.error.startswith("gang "):
        result.error = f"gang {gang.label}: {result.error}"
    return result


def _keep_record(tuning: GangTuning, result: UnitResult, store: Store) -> None:
    try:
        tuning.record(result, store)
    except (StoreError, OSError) as e:  # the record is for people and later jobs; losing it changes no outcome
        log.warning("gang %s: tuning record not kept: %s", tuning.gang, e)


def _agree(comm: GangComm, gang: Gang, unit: Unit, own: dict[str, Any], sandbox: Sandbox) -> tuple[Unit, bool]:
    """Collectives 1 and 2: what the ranks' graphs say, compared identically on every rank. Returns this
    rank's unit as agreed, and whether any rank's graph issues collectives."""
    gathered = comm.all_gather(own, "facts")
    everyone = [gathered[gang.reader_of(r)] for r in range(gang.world_size)]
    broken = [f"rank {r}: {e['error']}" for r, e in enumerate(everyone) if e["error"] or not isinstance(e["facts"], dict)]
    if broken:
        raise GangFailed("ranks that cannot take part, so the gang does not compile: " + "; ".join(broken))
    facts_of = [e["facts"] for e in everyone]
    collectives = [[CollectiveOp.from_dict(op) for op in f["collectives"]] for f in facts_of]
    divergence = first_divergence(collectives)
    if divergence:
        raise GangFailed(f"{divergence}; at run time they would hang in that collective, so nothing was compiled")
    ranges = [{w: (r[0], r[1]) for w, r in f["ranges"].items()} for f in facts_of]
    agreed, conflicts = reconcile_dims(ranges, [f["examples"] for f in facts_of])
    if conflicts:
        raise GangFailed("the ranks' dynamic shapes conflict: " + "; ".join(conflicts))
    mine = facts_of[comm.rank]
    # One example size per agreed dimension (rank 0's, inside the agreed range) makes every rank
    # check its artifact at the same sizes, which collectives over the ranks' tensors need.
    sizes = {w: min(max(facts_of[0]["examples"][w], lo), hi if hi is not None else 1 << 62)
             for w, (lo, hi) in agreed.items() if w in facts_of[0]["examples"]}
    if ranges[comm.rank] != agreed or any(mine["examples"].get(w) != n for w, n in sizes.items()):
        unit = replace(unit, agreed_dims=tuple((w, lo, hi) for w, (lo, hi) in sorted(agreed.items())),
                       agreed_sizes=tuple(sorted(sizes.items())))
    if unit.target.backend == "inductor-cache":
        observed: dict[str, set[int]] = {}
        for f in facts_of:
            for w, seen in f["observed"].items():
                observed.setdefault(w, set()).update(seen)
        marks = tuple(sorted(w for w, seen in observed.items() if len(seen) > 1))
        unit = replace(unit, target=replace(unit.target, mark_dynamic=marks))
    has_collectives = any(f["collectives"] for f in facts_of)
    shares_tuning = bool(gang.candidates[comm.rank::comm.world_size])
    if has_collectives or shares_tuning:  # a rank that read nothing compiles or verifies: start its sandbox now
        sandbox.prestart(unit.limits, gang.device)
    return unit, has_collectives


def _fingerprint(unit: Unit, store: Store, sandbox: Sandbox, workdir: Path) -> dict[str, Any]:
    """The rank's key after the agreement (identical programs for one target share it), or why
    it has none; computing it compiles nothing (the identity the reader kept names the program)."""
    try:
        return {"key": find(unit, store, identify_in(sandbox, unit, store, workdir)).key, "error": None}
    except (UnitFailed, SandboxFailed, LoweringError, StoreError, OSError) as e:
        return {"key": None, "error": f"graph {unit.graph} ({unit.target.label}): {e}"}


def _leaders(fingerprints: list[dict[str, Any]]) -> list[int]:
    broken = [f"rank {r}: {f['error']}" for r, f in enumerate(fingerprints) if f["error"] or not f["key"]]
    if broken:
        raise GangFailed("ranks whose programs could not be named, so the gang does not compile: " + "; ".join(broken))
    keys = [f["key"] for f in fingerprints]
    return [keys.index(k) for k in keys]


def _outcome(result: UnitResult) -> dict[str, Any]:
    return {"status": result.status, "error": result.error}


def _each_alone(comm: GangComm, gang: Gang, unit: Unit, leaders: list[int], store: Store, sandbox: Sandbox,
                early: EarlyCompile | None) -> UnitResult:
    """Graphs without collectives: each leader compiles and verifies on its own, as any unit
    (rank 0 may have started before the gang agreed); the ranks that share its program wait for
    it and take its artifact."""
    rank, leader, tag = comm.rank, leaders[comm.rank], f"{gang.name}/{unit.target.label}/compiled"
    if leader == rank:
        confirmed = early.confirm(unit) if early is not None and leader == 0 else None
        result = confirmed or run_unit(unit, store, sandbox)
        comm.post(f"{tag}/{rank}", _outcome(result))
        return result
    [said] = comm.await_posts([f"{tag}/{leader}"], unit.limits.timeout_s, f"rank {leader} to compile its graph")
    hit = lookup_unit(unit, store, sandbox)
    if hit is None and said["status"] != "failed":  # published, but to be verified at this job's tolerances
        hit = run_unit(unit, store, sandbox)
        hit = hit if hit.status != "failed" else _failed(unit, gang, hit.error or "")
    if hit is None:
        return _failed(unit, gang, f"rank {leader}, which compiles this rank's graph for the gang, did not publish it: "
                                   f"{said['error']}")
    return hit


class _Lockstep:
    """Graphs with collectives: leaders lower; then every rank runs its artifact (fresh, a
    leader's, or from the store) in the sandboxes' process group, verified against its program
    run eagerly over the same group; leaders publish only what verified on every rank."""

    def __init__(self, comm: GangComm, gang: Gang, leaders: list[int], host: str):
        self.comm, self.gang, self.leaders, self.host = comm, gang, leaders, host

    def run(self, unit: Unit, store: Store, sandbox: Sandbox) -> UnitResult:
        self.tag = f"{self.gang.name}/{unit.target.label}/lockstep"
        result = run_unit(unit, store, sandbox, body=self.body)
        if self.leaders[self.comm.rank] == self.comm.rank:
            self.comm.post(f"{self.tag}/published/{self.comm.rank}", _outcome(result))
        return result

    def body(self, ctx: UnitContext) -> Outcome:
        """A leader that finds no manifest claims the key; it holds the lease (one `with`) from
        lowering until it has published what every rank verified."""
        rank, unit = self.comm.rank, ctx.unit
        found, claim, error = None, None, None
        try:
            found = unit_key(ctx)
            claim = found.manifest
            if claim is None and self.leaders[rank] == rank:
                problem = host_check.problem(unit.target)
                if problem:
                    raise UnitFailed(problem, retryable=True)
                claim = claim_key(ctx, found.key)  # or the manifest another job published while we waited
        except (UnitFailed, LoweringError, OSError) as e:
            error = str(e)
        with claim if isinstance(claim, Lease) else contextlib.nullcontext():
            return self._together(ctx, found, claim, error)

    def _together(self, ctx: UnitContext, found: Found | None, claim: Lease | dict[str, Any] | None,
                  error: str | None) -> Outcome:
        rank, unit, store = self.comm.rank, ctx.unit, ctx.store
        leader = self.leaders[rank]
        lowered, manifest = None, claim if isinstance(claim, dict) else None
        mine = {"digest": None, "hit": False, "error": error}
        try:
            if isinstance(claim, Lease):
                lowered = self._lower(ctx, found.identity)
                mine["digest"] = store.put_file(lowered.artifact).digest  # a blob, not a publication: for the ranks sharing it
            elif manifest is not None:  # a hit, unless it must be verified again (at this job's tolerances): together
                mine.update(hit=unit.verify.covers(manifest), digest=manifest["blobs"]["artifact"]["digest"])
        except (UnitFailed, LoweringError, OSError) as e:
            mine["error"] = str(e)
        self.comm.post(f"{self.tag}/lowered/{rank}", mine)
        everyone = self.comm.await_posts([f"{self.tag}/lowered/{r}" for r in range(self.gang.world_size)],
                                         unit.limits.timeout_s, "every rank's artifact")
        broken = [f"rank {r}: {e['error']}" for r, e in enumerate(everyone) if e["error"]]
        if broken:
            raise UnitFailed("ranks without an artifact, so the gang cannot verify: " + "; ".join(broken))
        if all(e["hit"] for e in everyone):
            return take_hit(ctx, manifest, found.built_with)
        artifact = lowered.artifact if lowered else store.fetch(everyone[leader]["digest"], ctx.tmp / "artifact")
        identify_program(ctx, expect=found.identity)
        checked = self._verify_together(ctx, artifact)
        if lowered is not None:
            return publish(ctx, Compiled(lowered, checked, found.built_with))
        if manifest is None:  # the leader publishes once every rank verified
            [said] = self.comm.await_posts([f"{self.tag}/published/{leader}"], unit.limits.timeout_s,
                                           f"rank {leader} to publish")
            manifest = store.complete_manifest(found.key)[0]
            if manifest is None:
                raise UnitFailed(f"rank {leader}, which compiles this rank's graph for the gang, did not publish it: "
                                 f"{said['error']}")
        return take_hit(ctx, manifest, found.built_with, verified_here=True)

    def _lower(self, ctx: UnitContext, identity: dict[str, str]) -> Lowered:
        identify_program(ctx, expect=identity)
        ctx.step("gang_stand_in", rank=self.comm.rank, world_size=self.gang.world_size)
        try:
            return lower_unit(ctx)
        finally:  # the stand-in group's name stays registered in that child: verify in a fresh one
            ctx.sandbox.retire(ctx.unit.limits, self.gang.device)
            ctx.identified = None

    def _verify_together(self, ctx: UnitContext, artifact: Path) -> Checked:
        """Verify, then benchmark, every rank's artifact at once in the sandboxes' process group.

        A running AOTInductor model holds the GIL while it waits on a collective, and gloo's
        worker thread, dropping a finished work under its queue lock, may need the GIL for a
        tensor Python has seen: then neither moves and no gloo timeout ends it (torch 2.13).
        The eager reference's collectives therefore go over a group of their own
        (GangSteps.eager_reference); and each step here still has the collective timeout as
        its limit, and a gang whose step got stuck on any rank tries once more with fresh
        sandboxes before it fails."""
        for attempt in range(1, ATTEMPTS + 1):
            try:
                return self._check_together(ctx, artifact)
            except _Stuck as e:
                ctx.log.note(f"attempt {attempt} of {ATTEMPTS}: {e}")
                if attempt == ATTEMPTS:
                    raise UnitFailed(f"{e}; tried {ATTEMPTS} times with fresh sandboxes (raise collective_timeout_s "
                                     f"if the rank graphs take longer to run)") from None
        raise AssertionError("unreachable")

    def _check_together(self, ctx: UnitContext, artifact: Path) -> Checked:
        comm, timeout = self.comm, self.gang.collective_timeout_s
        unit_deadline = ctx.deadline
        try:
            port = ctx.step("gang_host", host=self.host, timeout_s=timeout)["port"] if comm.rank == 0 else None
            host, port = comm.all_gather([self.host, port], "sandbox group address")[0]
            ctx.step("gang_join", host=host, port=port, rank=comm.rank, world_size=self.gang.world_size,
                     timeout_s=timeout, on=self.gang.device)
            identify_program(ctx)  # the fresh child has not loaded the program yet
            checked = Checked([], {})
            for what in ("verify", "benchmark"):
                problem = None
                ctx.deadline = min(unit_deadline, time.monotonic() + timeout)
                with ctx.phase(what):
                    try:
                        checked = checked.then(check_artifact(ctx, artifact, verify_it=what == "verify",
                                                              bench_it=what == "benchmark"))
                    except UnitFailed as e:
                        problem = str(e)
                ctx.deadline = unit_deadline
                verdicts = comm.all_gather(problem, f"{what} verdicts")
                failed = [f"rank {r}: {p}" for r, p in enumerate(verdicts) if p]
                if any(p and p.startswith("check: timeout") for p in verdicts):
                    raise _Stuck(f"{what} in the gang got stuck: " + "; ".join(failed))
                if failed:
                    raise UnitFailed(f"{what} in the gang failed, nothing published: " + "; ".join(failed))
            return checked
        finally:
            ctx.deadline = unit_deadline
            # A child that ran in a gang's group never serves again: torch keeps the group's name
            # registered, and artifacts run in the next group of that name hung in its collectives.
            ctx.sandbox.retire(ctx.unit.limits, self.gang.device)
            ctx.identified = None


class _Stuck(Exception):
    """A lockstep step passed the collective timeout on some rank."""


ATTEMPTS = 2
