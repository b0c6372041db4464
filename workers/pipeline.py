"""The life of one unit, as a plain function of (unit, store, sandbox) that runs in any process:

    lookup (identify → key → manifest: workers/lookup.py) → (hit? check it if the job asks
    for more than the manifest says, then stop) → lease → lower → verify → benchmark → publish

Everything that touches the graph or the artifact (identify, lower, verify, benchmark) runs
in the sandbox child (workers/sandbox.py, workers/steps.py); this process only talks to the
store, holds the lease and decides. It trusts nothing the child says beyond numbers, digests
and a path inside the unit's temp dir.

The lease makes concurrent jobs compile each key once: whoever holds it compiles, everyone
else waits for the manifest (see storage/leases.py).

Outcomes are values (`UnitResult`); only bugs escape as exceptions. Nothing is published
unless the artifact verified, and the manifest is written last, after every blob.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import secrets
import socket
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from storage import CorruptBlob, Lease, LeaseInfo, Leases, Store, StoreError, UnsafeStore
from storage.signing import UntrustedDocument
from storage.tuning import get_measurements, put_measurements
from workers import tempdirs
from workers.autotune_share import SharedAutotune, autotunes, entries_from, fingerprint_of
from workers.backends import Backend, LoweringError, resolve
from workers.lookup import Found, UnitFailed, fill_hit, find, parse_identity
from workers.sandbox import Sandbox, SandboxFailed
from workers.unit import COMPILE_PHASES, Unit, UnitResult
from workers.unitlog import UnitLog

MAX_FACTS = 64 << 10


class Phases:
    """Wall time per phase; remembers which phase was running when something broke."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self.current = "setup"

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.current = name
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start


@dataclass
class UnitContext:
    """What every stage of one unit needs."""
    unit: Unit
    store: Store
    sandbox: Sandbox
    tmp: Path
    log: UnitLog
    phase: Phases
    result: UnitResult
    deadline: float  # monotonic: the sandbox is killed past it
    backend: Backend = field(init=False)
    identified: tuple[dict[str, str], str] | None = None  # what the sandbox said the program is

    def step(self, name: str, **kwargs: Any) -> dict[str, Any]:
        """Run a step in the sandbox; its output goes to the unit log, its failure fails the unit."""
        try:
            reply = self.sandbox.call(name, self.tmp, self.unit.limits, self.deadline, device=self.backend.device,
                                      unit=self.unit, **kwargs)
        except SandboxFailed as e:
            self.log.output(e.output, "the sandbox")
            raise UnitFailed(str(e), e.retryable) from None
        self.log.output(reply.pop("output", ""), "the sandbox")
        return reply

    def inside(self, reported: Any) -> Path:
        """A path the sandbox reported, only if it is a plain file in the unit's temp dir."""
        path = Path(str(reported))
        if path.is_symlink() or not path.is_file() or not path.resolve().is_relative_to(self.tmp.resolve()):
            raise UnitFailed(f"the sandbox reported an artifact outside the unit's temp dir ({str(reported)[:200]})")
        return path


def run_unit(unit: Unit, store: Store, sandbox: Sandbox | None = None, workdir: Path | None = None,
             body: Body | None = None) -> UnitResult:
    """With no sandbox, one is started for this unit alone (torch's import in the child costs seconds).
    `body` replaces the stages up to publishing (a gang's rank verifies in lockstep, workers/gang.py)."""
    log = UnitLog(f"unit {unit.unit_id} from {unit.source}")
    result = UnitResult(graph=unit.graph, target=unit.target.label, status="failed", worker=socket.gethostname())
    phases = Phases()
    start = time.perf_counter()
    moved = store.transfer.copy()
    with contextlib.ExitStack() as held:
        tmp = Path(held.enter_context(tempfile.TemporaryDirectory(prefix=tempdirs.prefix("unit"), dir=workdir)))
        sandbox = sandbox or held.enter_context(Sandbox())
        ctx = UnitContext(unit, store, sandbox, tmp, log, phases, result, time.monotonic() + unit.limits.timeout_s)
        try:
            with log.capture():  # ends before publishing, so the published log is complete
                ready = (body or _compile)(ctx, held)
            if ready is not None:
                with phases("upload"):
                    _publish(unit, store, ready, log, result, phases.timings)
        except (UnitFailed, LoweringError, UntrustedDocument) as e:
            result.status, result.error = "failed", f"graph {unit.graph} ({unit.target.label}): {e}"
            result.retryable = getattr(e, "retryable", False)
            log.note(f"FAILED in {phases.current}: {e}")
            if e.__cause__ is not None:
                log.exception(e.__cause__)
        except Exception as e:  # a library blew up mid-phase: still a value, with the traceback in the log
            result.status = "failed"
            result.error = f"graph {unit.graph} ({unit.target.label}): {phases.current} failed: {type(e).__name__}: {e}"
            # the store failing (after its own attempts) is the network's or the server's: in a moment it may not
            result.transient = isinstance(e, StoreError) and not isinstance(e, (CorruptBlob, UnsafeStore))
            result.retryable = result.transient or phases.current in ("fetch", "upload", "lease")
            log.note(f"FAILED in {phases.current}")
            log.exception(e)
    result.timings = {**phases.timings, "total": time.perf_counter() - start}
    if result.status == "failed":
        try:
            result.log = store.put_bytes(log.text().encode())
        except Exception as e:  # the log is for people; losing it must not change the outcome
            result.error = (result.error or "") + f" (unit log not saved: {e})"
    result.transfer = store.transfer - moved
    return result


@dataclass
class Compiled:
    artifact: Path
    components: dict[str, Any]
    facts: dict[str, Any]
    checked: list[str]
    built_with: str  # digest of the weight values the artifact was built and verified with


Body = Callable[[UnitContext, contextlib.ExitStack], "Compiled | None"]


def unit_key(ctx: UnitContext) -> Found:
    """The lookup (workers/lookup.py) for this unit, its program loaded in the unit's sandbox if
    the store does not know its identity; the key lands in the result."""
    ctx.backend = resolve(ctx.unit.target)
    found = find(ctx.unit, ctx.store, lambda: identify_program(ctx))
    if found.identity_known:
        ctx.log.note("program identity from the store (computed from these archive bytes by an earlier sandbox)")
    ctx.result.components, ctx.result.key = found.components, found.key
    ctx.log.note(f"key {found.key} (weights: {ctx.unit.target.weights})")
    return found


def _compile(ctx: UnitContext, held: contextlib.ExitStack) -> Compiled | None:
    unit, store, result, phase, log = ctx.unit, ctx.store, ctx.result, ctx.phase, ctx.log
    found = unit_key(ctx)
    identity, built_with = found.identity, found.built_with
    if found.manifest is not None:
        log.note("hit: a manifest exists, nothing to compile")
        take_hit(ctx, found.manifest, built_with)
        return None

    problem = ctx.backend.host_problem(unit.target)
    if problem:
        raise UnitFailed(problem, retryable=True)

    claim = claim_key(unit, store, result.key, log, phase)
    if not isinstance(claim, Lease):
        log.note("hit: another worker compiled this key while we waited")
        take_hit(ctx, claim, built_with)
        return None
    held.enter_context(claim)  # renewed while we compile and publish, released after

    identify_program(ctx, expect=identity)
    artifact, facts = lower_unit(ctx)
    with phase("verify"):
        checked = check_artifact(ctx, artifact, verify_it=True, bench_it=False)
    with phase("benchmark"):
        check_artifact(ctx, artifact, verify_it=False, bench_it=True)
    return Compiled(artifact, result.components, facts, checked, built_with)


def lower_unit(ctx: UnitContext) -> tuple[Path, dict[str, Any]]:
    """Lower the loaded program in the sandbox (sharing autotune timings with the farm); the
    artifact and what the backend says about it."""
    unit, store, result, phase, log = ctx.unit, ctx.store, ctx.result, ctx.phase, ctx.log
    with phase("lower"):
        log.note(f"lowering with {ctx.backend.name} options={unit.target.options_dict}")
        shared = SharedAutotune(store, ctx.backend.device_fingerprint(unit.target)) if autotunes(unit.target) else None
        if shared:
            shared.seed()
            log.note(f"autotuning: {shared.seeded} kernel timings from the farm for device {shared.fingerprint}"
                     + (f"; {shared.refused} unsigned or wrongly signed shards ignored" if shared.refused else ""))
        lowered = ctx.step("lower", workdir=str(ctx.tmp))
        artifact = ctx.inside(lowered.get("artifact"))
        measured_here = _count(lowered.get("autotune_benchmarked"))
        result.metrics["autotune_benchmarked"] = float(measured_here)
        if shared:
            shared.collect(entries_from(lowered.get("autotune_entries")))
            log.note(f"autotuning: benchmarked {measured_here} kernel selections here, "
                     f"gave {shared.published} new timings to the farm")
            result.metrics.update(autotune_seeded=float(shared.seeded), autotune_published=float(shared.published))

    facts = lowered.get("facts") if isinstance(lowered.get("facts"), dict) else {}
    return artifact, _plain(facts)


def identify_program(ctx: UnitContext, expect: dict[str, str] | None = None) -> tuple[dict[str, str], str]:
    """Fetch the program and load it in the sandbox, which names its content. Steps that need
    the program (lower, check) call it first; it loads the program once per unit."""
    if ctx.identified is None:
        with ctx.phase("fetch"):
            program_path = ctx.store.fetch(ctx.unit.program.digest, ctx.tmp / "program.pt2")
        with ctx.phase("load"):
            ctx.identified = parse_identity(ctx.step("identify", program=str(program_path)))
    if expect is not None and ctx.identified[0] != expect:
        raise UnitFailed(f"the program's identity recorded in the store for archive {ctx.unit.program.digest} is not "
                         f"what loading it gives now; remove programs/{ctx.unit.program.digest}/ from the store")
    return ctx.identified


def check_artifact(ctx: UnitContext, artifact: Path, verify_it: bool, bench_it: bool) -> list[str]:
    """Verify and/or benchmark an artifact in the sandbox; numbers land in the result."""
    reply = ctx.step("check", artifact=str(artifact), verify_it=verify_it, bench_it=bench_it)
    metrics = reply.get("metrics") if isinstance(reply.get("metrics"), dict) else {}
    ctx.result.metrics.update({str(k)[:200]: float(v) for k, v in metrics.items()
                               if isinstance(v, (int, float)) and not isinstance(v, bool)})
    problems = [str(p)[:1000] for p in reply.get("problems") or []]
    if verify_it and problems:
        raise UnitFailed("verification failed: " + "; ".join(problems))
    if bench_it:
        ctx.result.device = ctx.backend.device_fingerprint(ctx.unit.target)
        ctx.log.note(f"measured on {ctx.result.device}")
    return [str(c)[:200] for c in reply.get("checked") or []]


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _plain(facts: dict[str, Any]) -> dict[str, Any]:
    """Facts for the manifest (JSON already, as the sandbox sent them), within a size bound."""
    if len(json.dumps(facts)) > MAX_FACTS:
        raise UnitFailed(f"the sandbox described the artifact in more than {MAX_FACTS} bytes; not publishing it")
    return facts


def claim_key(unit: Unit, store: Store, key: str, log: UnitLog, phase: Phases) -> Lease | dict[str, Any]:
    """The lease on key (we compile), or the manifest another worker published while we waited."""
    leases = Leases(store.backend, f"{socket.gethostname()}/pid-{os.getpid()}/{secrets.token_hex(3)}", unit.lease_ttl_s)
    holders: list[str] = []

    def waiting(info: LeaseInfo) -> None:
        holders.append(info.holder)
        log.note(f"waiting: {info.holder} holds the lease on this key (generation {info.generation}); "
                 f"it is taken over if it shows no life for {unit.lease_ttl_s:g}s")

    start = time.perf_counter()
    with phase("lease"):
        claim = leases.claim(key, lambda: store.get_manifest(key), on_wait=waiting)
    if holders:  # time spent because another worker held the key, not the claim's own round trips
        phase.timings["lease_wait"] = time.perf_counter() - start
    if isinstance(claim, Lease) and holders:
        log.note(f"took over the lease from {holders[-1]} (generation {claim.info.generation})")
    return claim


def take_hit(ctx: UnitContext, manifest: dict[str, Any], built_with: str, verified_here: bool = False) -> None:
    """A manifest exists. With `weights: shapes` and another checkpoint's weights, show that the
    artifact runs with ours and matches our program run eagerly before calling it a hit; the same
    when it was verified at looser tolerances than this job's (unless its recorded error is
    within them, or the caller verified it: `verified_here`). An autotune candidate takes
    latencies measured since publishing, and measures the stored artifact again on retune or at
    a hot size it was never timed at on this device."""
    unit, store, result, log = ctx.unit, ctx.store, ctx.result, ctx.log
    looser, within = unit.verify.gap(manifest)
    recheck = looser is not None and not within and not verified_here
    if looser is not None and not recheck:
        result.note = looser + ("; verified again here at this job's tolerances" if verified_here else
                                f"; its recorded max error {manifest['metrics']['max_abs_err']:.3g} is within them")
        log.note(f"hit: {result.note}")
    fill_hit(result, manifest)
    stored_with = manifest.get("weights", {}).get("built_with")
    swap = unit.target.weights == "shapes" and stored_with != built_with and not verified_here
    if unit.target.candidate is None and not swap and not recheck:  # a plain hit: the manifest says it all
        return
    device = fingerprint_of(ctx.backend.device_fingerprint(unit.target))
    if unit.target.candidate is not None and not unit.remeasure:  # measured again after it was published?
        result.metrics.update(get_measurements(store, result.key, device))
    unmeasured = [f"{w}={n}" for w, n in unit.hot_sizes if f"compiled_ms@{w}={n}" not in result.metrics]
    remeasure = unit.remeasure or bool(unmeasured)  # never at a hot size on this device: measure now
    if not swap and not remeasure and not recheck:
        return
    identify_program(ctx, expect={k: v for k, v in result.components["program"].items()})
    artifact = store.fetch(result.artifact.digest, ctx.tmp / "artifact")
    if swap or recheck:  # one check, at this job's tolerances, with this checkpoint's weights
        log.note(f"the artifact was built with weights {stored_with}; checking it with this checkpoint's ({built_with})"
                 if swap else f"{looser}: verifying the stored artifact again")
        with ctx.phase("verify"):
            try:
                check_artifact(ctx, artifact, verify_it=True, bench_it=False)
            except UnitFailed as e:
                if recheck:
                    raise UnitFailed(f"{looser}, and it fails them: {e}. The key is the same at any tolerance: loosen "
                                     f"verify.atol/rtol, or change the target's options to build another artifact") from None
                raise UnitFailed(f"the cached artifact for key {result.key} does not reproduce this checkpoint: {e}. "
                                 f"Report it: the key should have told them apart") from None
        if swap:
            result.metrics.update(weights_swapped=1.0)
        if recheck:
            result.note = f"{looser}; verified again here at this job's tolerances"
    if remeasure:  # retuning, or sizes never measured: the artifact stands, its latency is measured here
        with ctx.phase("benchmark"):
            check_artifact(ctx, artifact, verify_it=False, bench_it=True)
        put_measurements(store, result.key, device, {k: v for k, v in result.metrics.items() if "_ms" in k})


def _publish(unit: Unit, store: Store, ready: Compiled, log: UnitLog, result: UnitResult, timings: dict[str, float]) -> None:
    result.artifact = store.put_file(ready.artifact)
    log.note(f"artifact {result.artifact.digest} ({result.artifact.size} bytes); publishing")
    result.log = store.put_bytes(log.text().encode())  # linked from the manifest
    manifest = _manifest(unit, result, ready, timings)
    if not store.publish_manifest(result.key, manifest):
        log.note("another worker published this key first; its manifest stands")
    result.status = "compiled"


def _manifest(unit: Unit, result: UnitResult, ready: Compiled, timings: dict[str, float]) -> dict[str, Any]:
    return {
        "key": result.key,
        "key_version": ready.components["key_version"],
        "components": ready.components,
        "status": "compiled",
        "graph": unit.graph,
        "source": unit.source,
        "target": unit.target.label,
        "blobs": {
            "artifact": result.artifact.to_dict(),
            "program": unit.program.to_dict(),
            "log": result.log.to_dict() if result.log else None,
        },
        "artifact": ready.facts,
        "weights": {"mode": unit.target.weights, "built_with": ready.built_with},
        "verify": {"atol": unit.verify.atol, "rtol": unit.verify.rtol, "inputs": ready.checked},
        # a gang's agreement this rank's program was re-exported with (workers/gang.py)
        "agreed_shapes": {"dims": [list(d) for d in unit.agreed_dims], "sizes": dict(unit.agreed_sizes)} if unit.agreed else None,
        "metrics": dict(result.metrics),
        "device": result.device,  # where the metrics were measured
        "timings": dict(timings),
        "compile_s": sum(timings.get(p, 0.0) for p in COMPILE_PHASES),
        "worker": result.worker,
        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
