"""The life of one unit, as a plain function of (unit, store, sandbox) that runs in any process:

    lookup (identify → key → manifest: workers/lookup.py) → (hit? check it if the job asks
    for more than the manifest says, then stop) → with the lease: lower → verify → benchmark → publish

Each stage returns what it found, made or measured (`Found`, `Lowered`, `Checked`, `Hit`,
`Published`); `run_unit` alone turns the outcome, or the failure, into the unit's result.

Everything that touches the graph or the artifact (identify, lower, verify, benchmark) runs
in the sandbox child (workers/sandbox/process.py, workers/sandbox/steps.py); this process only talks to the
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
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from storage import BlobRef, CorruptBlob, Lease, LeaseInfo, Leases, Store, StoreError, StoreUnwritable, UnsafeStore
from storage.leases import holder_here
from storage.signing import UntrustedDocument
from storage.tuning import get_measurements, put_measurements
from workers import host_check
from workers.autotune.share import SharedAutotune, autotunes, entries_from, fingerprint_of
from workers.backends import Backend, LoweringError, cxx, jit_entries, resolve
from workers.backends.option_policy import options_problems
from workers.lookup import Found, UnitFailed, fill_hit, find, parse_identity
from workers.sandbox import jail
from workers.sandbox.env import as_childrens_cache
from workers.sandbox.process import Sandbox, SandboxFailed
from workers.trace import TRACE_DIR, packed_trace
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
        outer, self.current = self.current, name
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start
        self.current = outer  # not on failure: then it names the phase that broke


@dataclass
class UnitContext:
    """What every stage of one unit needs. Stages return what they found, made and measured;
    `run_unit` alone turns that into the unit's result."""
    unit: Unit
    store: Store
    sandbox: Sandbox
    tmp: Path
    log: UnitLog
    phase: Phases
    deadline: float  # monotonic: the sandbox is killed past it
    backend: Backend = field(init=False)
    found: Found | None = None  # the lookup's answer, kept so that a failure still reports the key
    identified: tuple[dict[str, str], str] | None = None  # what the sandbox said the program is

    def step(self, name: str, **kwargs: Any) -> dict[str, Any]:
        """Run a step in the sandbox; its output, and what this process printed meanwhile, go to
        the unit log; its failure fails the unit."""
        try:
            with self.log.capture():
                reply = self.sandbox.call(name, self.tmp, self.unit.limits, self.deadline,
                                          device=self.backend.device, unit=self.unit, **kwargs)
        except SandboxFailed as e:
            self.log.output(e.output, "the sandbox")
            raise UnitFailed(str(e), e.retryable) from None
        finally:
            self.deadline += self.sandbox.start_waited_s  # the child's start (torch's import) is not the unit's time
        self.log.output(reply.pop("output", ""), "the sandbox")
        return reply

    def inside(self, reported: Any) -> Path:
        """A path the sandbox reported, only if it is a plain file in the unit's temp dir."""
        path = Path(str(reported))
        if path.is_symlink() or not path.is_file() or not path.resolve().is_relative_to(self.tmp.resolve()):
            raise UnitFailed(f"the sandbox reported an artifact outside the unit's temp dir ({str(reported)[:200]})")
        return path


Metrics = dict[str, float]


@dataclass(frozen=True)
class Lowered:
    artifact: Path
    facts: dict[str, Any]  # what the backend says about the artifact (for the manifest)
    metrics: Metrics  # autotuning counts


@dataclass(frozen=True)
class Checked:
    inputs: list[str]  # what the artifact was verified on
    metrics: Metrics
    device: dict[str, Any] | None = None  # the device fingerprint its latencies were measured on

    def then(self, later: Checked) -> Checked:
        return Checked(self.inputs or later.inputs, {**self.metrics, **later.metrics}, later.device or self.device)


@dataclass(frozen=True)
class Compiled:
    """An artifact that verified, ready to publish."""
    lowered: Lowered
    checked: Checked
    built_with: str  # digest of the weight values the artifact was built and verified with


@dataclass(frozen=True)
class Hit:
    manifest: dict[str, Any]
    metrics: Metrics = field(default_factory=dict)  # on top of the manifest's: measured since it was published, or here
    device: dict[str, Any] | None = None  # where they were measured, if here
    note: str | None = None  # how the hit was accepted when the manifest alone did not settle it


@dataclass(frozen=True)
class Published:
    artifact: BlobRef
    log: BlobRef
    trace: BlobRef | None
    metrics: Metrics
    device: dict[str, Any] | None


Outcome = Hit | Published
Body = Callable[[UnitContext], Outcome]


def run_unit(unit: Unit, store: Store, sandbox: Sandbox | None = None, body: Body | None = None) -> UnitResult:
    """With no sandbox, one is started for this unit alone (torch's import in the child costs seconds).
    `body` replaces the stages (a gang's rank verifies in lockstep, workers/gang/rank.py)."""
    log = UnitLog(f"unit {unit.unit_id} from {unit.source}")
    result = UnitResult(graph=unit.graph, target=unit.target.label, status="failed", worker=socket.gethostname())
    phases = Phases()
    start = time.perf_counter()
    moved = store.transfer.copy()
    with contextlib.ExitStack() as held:
        sandbox = sandbox or held.enter_context(Sandbox())
        tmp = held.enter_context(sandbox.workdir("unit"))
        ctx = UnitContext(unit, store, sandbox, tmp, log, phases, time.monotonic() + unit.limits.timeout_s)
        try:
            _fill(result, (body or compile_unit)(ctx))
        except (UnitFailed, LoweringError, UntrustedDocument) as e:
            result.error = f"graph {unit.graph} ({unit.target.label}): {e}"
            result.retryable, result.failed_in = getattr(e, "retryable", False), phases.current
            log.note(f"FAILED in {phases.current}: {e}")
            if e.__cause__ is not None:
                log.exception(e.__cause__)
        except Exception as e:  # a library blew up mid-phase: still a value, with the traceback in the log
            result.error = f"graph {unit.graph} ({unit.target.label}): {phases.current} failed: {type(e).__name__}: {e}"
            # the store failing (after its own attempts) is the network's or the server's: in a moment it may not
            result.transient = isinstance(e, StoreError) and not isinstance(e, (CorruptBlob, UnsafeStore, StoreUnwritable))
            result.retryable = result.transient or phases.current in ("fetch", "upload", "lease")
            result.failed_in = phases.current
            log.note(f"FAILED in {phases.current}")
            log.exception(e)
        if result.status == "failed" and (tmp / TRACE_DIR).is_dir():  # read a failed lowering without reproducing it
            try:
                result.trace = save_trace(store, tmp, log)
            except Exception as e:  # like the log: for people, never a reason to change the outcome
                log.note(f"torch trace not saved: {e}")
    if ctx.found is not None:
        result.key, result.components = ctx.found.key, ctx.found.components
        if ctx.found.incomplete and result.status == "compiled":
            result.note = f"compiled again: {ctx.found.incomplete}"
    result.timings = {**phases.timings, "total": time.perf_counter() - start}
    if result.status == "failed":
        try:
            result.log = store.put_bytes(log.text().encode())
        except Exception as e:  # the log is for people; losing it must not change the outcome
            result.error = (result.error or "") + f" (unit log not saved: {e})"
    result.transfer = store.transfer - moved
    return result


def _fill(result: UnitResult, outcome: Outcome) -> None:
    if isinstance(outcome, Hit):
        fill_hit(result, outcome.manifest)
        result.note, result.device = outcome.note, outcome.device or result.device
    else:
        result.status, result.artifact, result.log, result.device = "compiled", outcome.artifact, outcome.log, outcome.device
        result.trace = outcome.trace
    result.metrics.update(outcome.metrics)


def unit_key(ctx: UnitContext, before_loading: Callable[[], Any] = lambda: None) -> Found:
    """The lookup (workers/lookup.py) for this unit, its program loaded in the unit's sandbox if
    the store does not know its identity (`before_loading` starts what can run meanwhile)."""
    ctx.backend = resolve(ctx.unit.target)

    def identify() -> tuple[dict[str, str], str]:
        before_loading()
        return identify_program(ctx)

    ctx.found = find(ctx.unit, ctx.store, identify)
    if ctx.found.identity_known:
        ctx.log.note("program identity from the store (computed from these archive bytes by an earlier sandbox)")
    ctx.log.note(f"key {ctx.found.key} (weights: {ctx.unit.target.weights})")
    if ctx.found.incomplete:
        ctx.log.note(f"not a hit: {ctx.found.incomplete}; compiling it again")
    return ctx.found


def compile_unit(ctx: UnitContext, before_publish: Callable[[], None] | None = None) -> Outcome:
    """Look the unit up; on a miss, lower, verify, benchmark and publish it under its lease.
    `before_publish` may hold the publication back, or refuse it by raising UnitFailed (a gang's
    rank 0 that compiled before its gang agreed, workers/gang/early.py)."""
    found = unit_key(ctx, before_loading=lambda: host_check.start(ctx.unit.target))
    if found.manifest is not None:
        ctx.log.note("hit: a manifest exists, nothing to compile")
        return take_hit(ctx, found.manifest, found.built_with)

    problem = host_check.problem(ctx.unit.target)
    if problem:
        raise UnitFailed(problem, retryable=True)

    claim = claim_key(ctx, found.key)
    if not isinstance(claim, Lease):
        ctx.log.note("hit: another worker compiled this key while we waited")
        return take_hit(ctx, claim, found.built_with)
    with claim:  # renewed while we compile and publish; released after, whatever happens
        identify_program(ctx, expect=found.identity)
        lowered = lower_unit(ctx)
        with ctx.phase("verify"):
            verified = check_artifact(ctx, lowered.artifact, verify_it=True, bench_it=False)
        with ctx.phase("benchmark"):
            benched = check_artifact(ctx, lowered.artifact, verify_it=False, bench_it=True)
        if before_publish is not None:
            with ctx.phase("agree"):  # the time it held the publication back
                before_publish()
        return publish(ctx, Compiled(lowered, verified.then(benched), found.built_with))


def lower_unit(ctx: UnitContext) -> Lowered:
    """Lower the loaded program in the sandbox, sharing autotune timings with the farm."""
    unit, store, log = ctx.unit, ctx.store, ctx.log
    with ctx.phase("lower"):
        # a parsed job spec refused such options already; a unit built in code (a gang's candidates,
        # a caller of run_unit) meets the same rule before anything of Inductor's sees them
        refused = options_problems(unit.target.options_dict)
        if refused:
            raise LoweringError(f"options refused: {'; '.join(refused)}")
        log.note(f"lowering with {ctx.backend.name} options={unit.target.options_dict}")
        shared = SharedAutotune(store, ctx.backend.device_fingerprint(unit.target)) if autotunes(unit.target) else None
        if shared:
            with as_childrens_cache(ctx.sandbox.jailed):
                shared.seed()
            log.note(f"autotuning: {shared.seeded} kernel timings from the farm for device {shared.fingerprint}"
                     + (f"; {shared.refused} unsigned or wrongly signed shards ignored" if shared.refused else ""))
        lowered = ctx.step("lower", workdir=str(ctx.tmp))
        artifact = ctx.inside(lowered.get("artifact"))
        measured_here = _count(lowered.get("autotune_benchmarked"))
        metrics = {"autotune_benchmarked": float(measured_here)}
        if shared:
            shared.collect(entries_from(lowered.get("autotune_entries")))
            log.note(f"autotuning: benchmarked {measured_here} kernel selections here, "
                     f"gave {shared.published} new timings to the farm")
            metrics.update(autotune_seeded=float(shared.seeded), autotune_published=float(shared.published))
        compiles = lowered.get("compiler_cache") if isinstance(lowered.get("compiler_cache"), dict) else {}
        if compiles:  # the node's compiler cache served some of its C++ (workers/sandbox/compiler_cache.py)
            hits, misses = _count(compiles.get("hits")), _count(compiles.get("misses"))
            metrics.update(compiler_cache_hits=float(hits), compiler_cache_misses=float(misses))
            log.note(f"compiler cache: {hits} of {hits + misses} C++ compiles served from the node's ccache")

    facts = lowered.get("facts") if isinstance(lowered.get("facts"), dict) else {}
    saved = (facts.get("saved_for_backward") or {}).get("bytes")  # a training step's activation memory
    if isinstance(saved, int) and not isinstance(saved, bool):
        metrics["saved_activation_bytes"] = float(saved)
    return Lowered(artifact, _plain(facts), metrics)


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


def check_artifact(ctx: UnitContext, artifact: Path, verify_it: bool, bench_it: bool) -> Checked:
    """Verify and/or benchmark an artifact in the sandbox; a failed verification fails the unit."""
    try:
        reply = ctx.step("check", artifact=str(artifact), verify_it=verify_it, bench_it=bench_it)
    except UnitFailed as e:  # a crash as it loads: say which compiler built it, where $CXX chose one
        note = cxx.crash_note() if "the sandbox crashed" in str(e) else ""
        raise UnitFailed(f"{e}{note}", e.retryable) from None
    metrics = reply.get("metrics") if isinstance(reply.get("metrics"), dict) else {}
    problems = [str(p)[:1000] for p in reply.get("problems") or []]
    if verify_it and problems:
        raise UnitFailed("verification failed: " + "; ".join(problems))
    device = None
    if bench_it:
        device = ctx.backend.device_fingerprint(ctx.unit.target)
        ctx.log.note(f"measured on {device}")
    return Checked([str(c)[:200] for c in reply.get("checked") or []],
                   {str(k)[:200]: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)},
                   device)


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _plain(facts: dict[str, Any]) -> dict[str, Any]:
    """Facts for the manifest (JSON already, as the sandbox sent them), within a size bound."""
    if len(json.dumps(facts)) > MAX_FACTS:
        raise UnitFailed(f"the sandbox described the artifact in more than {MAX_FACTS} bytes; not publishing it")
    return facts


def claim_key(ctx: UnitContext, key: str) -> Lease | dict[str, Any]:
    """The lease on key (we compile), or the manifest another worker published while we waited."""
    unit, log, phase = ctx.unit, ctx.log, ctx.phase
    leases = Leases(ctx.store.backend, holder_here(), unit.lease_ttl_s)
    holders: list[str] = []

    def waiting(info: LeaseInfo) -> None:
        holders.append(info.holder)
        log.note(f"waiting: {info.holder} holds the lease on this key (generation {info.generation}); "
                 f"it is taken over if it shows no life for {unit.lease_ttl_s:g}s")

    start = time.perf_counter()
    with phase("lease"):
        claim = leases.claim(key, lambda: ctx.store.complete_manifest(key)[0], on_wait=waiting)
    if holders:  # time spent because another worker held the key, not the claim's own round trips
        phase.timings["lease_wait"] = time.perf_counter() - start
    if isinstance(claim, Lease) and holders:
        log.note(f"took over the lease from {holders[-1]} (generation {claim.info.generation})")
    return claim


def take_hit(ctx: UnitContext, manifest: dict[str, Any], built_with: str, verified_here: bool = False) -> Hit:
    """A manifest exists. With `weights: shapes` and another checkpoint's weights, show that the
    artifact runs with ours and matches our program run eagerly before calling it a hit; the same
    when it was verified at looser tolerances than this job's (unless its recorded error is
    within them, or the caller verified it: `verified_here`). An autotune candidate takes
    latencies measured since publishing, and measures the stored artifact again on retune or at
    a hot size it was never timed at on this device."""
    unit, store, log, key = ctx.unit, ctx.store, ctx.log, ctx.found.key
    looser, within = unit.verify.gap(manifest)
    recheck = looser is not None and not within and not verified_here
    note = None
    if looser is not None and not recheck:
        note = looser + ("; verified again here at this job's tolerances" if verified_here else
                         f"; its recorded max error {manifest['metrics']['max_abs_err']:.3g} is within them")
        log.note(f"hit: {note}")
    stored_with = manifest.get("weights", {}).get("built_with")
    swap = unit.target.weights == "shapes" and stored_with != built_with and not verified_here
    if unit.target.candidate is None and not swap and not recheck:  # a plain hit: the manifest says it all
        return Hit(manifest, note=note)
    device = fingerprint_of(ctx.backend.device_fingerprint(unit.target))
    since = get_measurements(store, key, device) if unit.target.candidate is not None and not unit.remeasure else {}
    known = {**manifest.get("metrics", {}), **since}
    unmeasured = [f"{w}={n}" for w, n in unit.hot_sizes if f"compiled_ms@{w}={n}" not in known]
    remeasure = unit.remeasure or bool(unmeasured)  # never at a hot size on this device: measure now
    if not swap and not remeasure and not recheck:
        return Hit(manifest, since, note=note)
    identify_program(ctx, expect=ctx.found.identity)
    artifact = store.fetch(manifest["blobs"]["artifact"]["digest"], ctx.tmp / "artifact")
    metrics, measured_on = dict(since), None
    if swap or recheck:  # one check, at this job's tolerances, with this checkpoint's weights
        log.note(f"the artifact was built with weights {stored_with}; checking it with this checkpoint's ({built_with})"
                 if swap else f"{looser}: verifying the stored artifact again")
        with ctx.phase("verify"):
            try:
                metrics.update(check_artifact(ctx, artifact, verify_it=True, bench_it=False).metrics)
            except UnitFailed as e:
                if recheck:
                    raise UnitFailed(f"{looser}, and it fails them: {e}. The key is the same at any tolerance: loosen "
                                     f"verify.atol/rtol, or change the target's options to build another artifact") from None
                raise UnitFailed(f"the cached artifact for key {key} does not reproduce this checkpoint: {e}. "
                                 f"Report it: the key should have told them apart") from None
        if swap:
            metrics.update(weights_swapped=1.0)
        if recheck:
            note = f"{looser}; verified again here at this job's tolerances"
    if remeasure:  # retuning, or sizes never measured: the artifact stands, its latency is measured here
        with ctx.phase("benchmark"):
            benched = check_artifact(ctx, artifact, verify_it=False, bench_it=True)
        metrics.update(benched.metrics)
        measured_on = benched.device
        put_measurements(store, key, device, {k: v for k, v in {**known, **benched.metrics}.items() if "_ms" in k})
    return Hit(manifest, metrics, measured_on, note)


def publish(ctx: UnitContext, ready: Compiled) -> Published:
    """Blobs first, the manifest last: nothing points at what is not there yet. Called with the lease held."""
    store, log = ctx.store, ctx.log
    if ctx.sandbox.isolation is not None:
        log.note(f"sandbox: {jail.describe(ctx.sandbox.isolation)}")
    with ctx.phase("upload"):
        artifact = store.put_file(ready.lowered.artifact)
        log.note(f"artifact {artifact.digest} ({artifact.size} bytes); publishing")
        if getattr(ctx.backend, "feeds_remote_caches", False):  # torch's own entries, for its remote caches
            fed, problem = jit_entries.published(store, ctx.tmp / jit_entries.OUTBOX, f"farm unit {ctx.unit.unit_id}")
            log.note(problem or f"remote caches: {fed} FX graph and AOTAutograd entries of torch's own published")
        trace = save_trace(store, ctx.tmp, log)
        log_ref = store.put_bytes(log.text().encode())  # linked from the manifest
        metrics = {**ready.lowered.metrics, **ready.checked.metrics}
        blobs = {"artifact": artifact, "log": log_ref, "trace": trace}
        if not store.publish_manifest(ctx.found.key, _manifest(ctx, ready, blobs, metrics)):
            log.note("another worker published this key first; its manifest stands")
    return Published(artifact, log_ref, trace, metrics, ready.checked.device)


def save_trace(store: Store, workdir: Path, log: UnitLog) -> BlobRef | None:
    """The unit's torch trace (workers/trace.py) into the store, if the lowering wrote one."""
    data, line = packed_trace(workdir)
    log.note(line)
    return store.put_bytes(data) if data is not None else None


def _manifest(ctx: UnitContext, ready: Compiled, blobs: dict[str, BlobRef | None], metrics: Metrics) -> dict[str, Any]:
    unit, found, timings = ctx.unit, ctx.found, ctx.phase.timings
    return {
        "key": found.key,
        "key_version": found.components["key_version"],
        "components": found.components,
        "status": "compiled",
        "graph": unit.graph,
        "source": unit.source,
        "target": unit.target.label,
        "blobs": {"program": unit.program.to_dict(), **{role: ref.to_dict() for role, ref in blobs.items() if ref}},
        "artifact": ready.lowered.facts,
        "weights": {"mode": unit.target.weights, "built_with": ready.built_with},
        "verify": {"atol": unit.verify.atol, "rtol": unit.verify.rtol, "inputs": ready.checked.inputs},
        # a gang's agreement this rank's program was re-exported with (workers/gang/rank.py)
        "agreed_shapes": {"dims": [list(d) for d in unit.agreed_dims], "sizes": dict(unit.agreed_sizes)} if unit.agreed else None,
        "metrics": dict(metrics),
        "device": ready.checked.device,  # where the metrics were measured
        # what the lowering's sandbox child ran under (workers/sandbox/jail.py)
        "isolation": ctx.sandbox.isolation.to_dict() if ctx.sandbox.isolation else None,
        "timings": dict(timings),
        "compile_s": sum(timings.get(p, 0.0) for p in COMPILE_PHASES),
        "worker": socket.gethostname(),
        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
