"""The life of one unit, as a plain function of (unit, store) that runs in any process:

    fetch → load → key → (hit? stop) → lease → lower → verify → benchmark → upload → publish

The lease makes concurrent jobs compile each key once: whoever holds it compiles, everyone
else waits for the manifest (see storage/leases.py).

Outcomes are values (`UnitResult`); only bugs escape as exceptions. Nothing is published
unless the artifact verified, and the manifest is written last, after every blob.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import os
import secrets
import socket
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.export import ExportedProgram

from storage import BlobRef, Lease, LeaseInfo, Leases, Store
from storage.tuning import get_measurements, put_measurements
from workers.backends import Backend, LoweringError, resolve
from workers.autotune_share import SharedAutotune, autotunes, benchmarked, fingerprint_of
from workers.benchmark import measure
from workers.inputs import dynamic_dims, input_sets, inputs_at
from workers.keys import key_components, key_of
from workers.program import ProgramError, load_program, program_identity, weights_digest
from workers.specialize import specialize
from workers.unit import COMPILE_PHASES, Unit, UnitResult
from workers.unitlog import UnitLog
from workers.verify import verify


class UnitFailed(Exception):
    def __init__(self, message: str, retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable


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


@contextmanager
def own_inductor_config() -> Iterator[None]:
    """Restore every Inductor setting after a lowering. A worker runs many units in one process,
    and `aoti_compile_and_package` leaves `aot_inductor.metadata` filled in; that setting is part
    of Inductor's FX graph cache key, so a later torch.compile in the same process would key
    its cache entries differently from a fresh serving process."""
    from torch._inductor import config

    saved = config.save_config()  # a pickled deep copy: survives settings mutated in place
    try:
        yield
    finally:
        config.load_config(saved)


class _Miss(Exception):
    """Raised in a hits-only lookup when the key has no manifest."""


def lookup_unit(unit: Unit, store: Store) -> UnitResult | None:
    """The unit's result if its key is already in the store (a hit), else None; compiles nothing.

    A scheduler whose own process computes keys exactly as its workers would (same toolchain)
    can answer hits without starting any worker."""
    result = run_unit(unit, store, hits_only=True)
    return result if result.status == "hit" else None


def run_unit(unit: Unit, store: Store, workdir: Path | None = None, hits_only: bool = False) -> UnitResult:
    log = UnitLog(f"unit {unit.unit_id} from {unit.source}")
    result = UnitResult(graph=unit.graph, target=unit.target.label, status="failed", worker=socket.gethostname())
    phases = Phases()
    start = time.perf_counter()
    moved = store.transfer.copy()
    with tempfile.TemporaryDirectory(prefix="farm-unit-", dir=workdir) as tmp, contextlib.ExitStack() as held:
        try:
            with log.capture():  # ends before publishing, so the published log is complete
                ready = _compile(unit, store, Path(tmp), log, phases, result, held, hits_only)
            if ready is not None:
                with phases("upload"):
                    _publish(unit, store, ready, log, result, phases.timings)
        except _Miss:
            result.status = "skipped"  # a hits-only lookup that found no manifest
            return result
        except (UnitFailed, ProgramError, LoweringError) as e:
            result.status, result.error = "failed", f"graph {unit.graph} ({unit.target.label}): {e}"
            result.retryable = getattr(e, "retryable", False)
            log.note(f"FAILED in {phases.current}: {e}")
            if e.__cause__ is not None:
                log.exception(e.__cause__)
        except Exception as e:  # a library blew up mid-phase: still a value, with the traceback in the log
            result.status = "failed"
            result.error = f"graph {unit.graph} ({unit.target.label}): {phases.current} failed: {type(e).__name__}: {e}"
            result.retryable = phases.current in ("fetch", "upload", "lease")  # I/O may succeed on retry
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


@dataclass
class Loaded:
    ep: ExportedProgram
    backend: Backend
    built_with: str


def _compile(unit: Unit, store: Store, tmp: Path, log: UnitLog, phase: Phases, result: UnitResult,
             held: contextlib.ExitStack, hits_only: bool = False) -> Compiled | None:
    if unit.program is None:
        raise UnitFailed(unit.ingest_error or f"{unit.source} could not be read")
    backend = resolve(unit.target)

    with phase("fetch"):
        program_path = store.fetch(unit.program.digest, tmp / "program.pt2")
    with phase("load"):
        ep = load_program(program_path, f"{unit.source}", unit.modules)
        if unit.specialize:
            ep = _specialized(ep, *unit.specialize)
        identity = program_identity(ep, weights_by_value=unit.target.weights == "values")
        built_with = identity["weights"] if unit.target.weights == "values" else weights_digest(ep, values=True)
        result.components = key_components(identity, backend.target_components(unit.target), unit.target.options_dict)
        result.key = key_of(result.components)
    log.note(f"key {result.key} (weights: {unit.target.weights})")
    loaded = Loaded(ep, backend, built_with)

    manifest = store.get_manifest(result.key)
    if manifest is not None:
        log.note("hit: a manifest exists, nothing to compile")
        _hit(unit, store, manifest, loaded, tmp, log, phase, result)
        return None
    if hits_only:
        raise _Miss

    problem = backend.host_problem(unit.target)
    if problem:
        raise UnitFailed(problem, retryable=True)

    claim = _claim(unit, store, result.key, log, phase)
    if not isinstance(claim, Lease):
        log.note("hit: another worker compiled this key while we waited")
        _hit(unit, store, claim, loaded, tmp, log, phase, result)
        return None
    held.enter_context(claim)  # renewed while we compile and publish, released after

    with phase("lower"):
        log.note(f"lowering with {backend.name} options={unit.target.options_dict}")
        shared = SharedAutotune(store, backend.device_fingerprint(unit.target)) if autotunes(unit.target) else None
        if shared:
            shared.seed()
            log.note(f"autotuning: {shared.seeded} kernel timings from the farm for device {shared.fingerprint}")
        before = benchmarked()
        try:
            with own_inductor_config():
                artifact = backend.lower(ep, unit.target, tmp)
        except LoweringError:
            raise
        except Exception as e:
            raise UnitFailed(f"lowering failed: {type(e).__name__}: {_first_line(e)} (see the unit log)") from e
        measured_here = benchmarked() - before
        result.metrics["autotune_benchmarked"] = float(measured_here)
        if shared:
            shared.collect()
            log.note(f"autotuning: benchmarked {measured_here} kernel selections here, "
                     f"gave {shared.published} new timings to the farm")
            result.metrics.update(autotune_seeded=float(shared.seeded), autotune_published=float(shared.published))

    with phase("verify"):
        compiled = backend.load(artifact, unit.target, ep)
        report, sets = _verify(unit, ep, compiled, log, result)
        if not report.ok:
            raise UnitFailed("verification failed: " + "; ".join(report.problems))

    with phase("benchmark"):
        _benchmark(unit, ep, compiled, sets[0], backend, log, result)

    return Compiled(artifact, result.components, backend.describe(artifact, unit.target), report.checked, built_with)


def _benchmark(unit: Unit, ep: ExportedProgram, compiled: Any, inputs: Any, backend: Backend, log: UnitLog,
               result: UnitResult) -> None:
    eager = measure(ep.module(), inputs, unit.bench.warmup, unit.bench.repeat)
    fast = measure(compiled, inputs, unit.bench.warmup, unit.bench.repeat)
    result.metrics.update(eager_ms=eager.median_ms, compiled_ms=fast.median_ms, compiled_spread_ms=fast.spread_ms,
                          speedup=eager.median_ms / fast.median_ms)
    result.device = backend.device_fingerprint(unit.target)
    log.note(f"eager {eager.median_ms:.3f} ms, compiled {fast.median_ms:.3f} ms ± {fast.spread_ms:.3f} (median and "
             f"interquartile range of {unit.bench.repeat} runs) on {result.device}")
    dims = dynamic_dims(ep)
    for where, size in unit.hot_sizes:  # where a specialization would compete with this artifact
        if where in dims:
            at = inputs_at(ep, {dims[where][0]: size}, f"{where}={size}", torch.Generator().manual_seed(0))
            hot = measure(compiled, at, unit.bench.warmup, unit.bench.repeat)
            result.metrics.update({f"compiled_ms@{where}={size}": hot.median_ms, f"compiled_spread_ms@{where}={size}": hot.spread_ms})
            log.note(f"at {where}={size}: compiled {hot.median_ms:.3f} ms ± {hot.spread_ms:.3f}")


def _specialized(ep: ExportedProgram, where: str, size: int) -> ExportedProgram:
    try:
        return specialize(ep, where, size)
    except ValueError as e:
        raise UnitFailed(f"cannot specialize {where}={size}: {e}") from e
    except Exception as e:
        raise UnitFailed(f"re-exporting at {where}={size} failed: {type(e).__name__}: {_first_line(e)}") from e


def _verify(unit: Unit, ep: ExportedProgram, compiled: Any, log: UnitLog, result: UnitResult):
    try:
        sets = input_sets(ep, unit.verify.extra_sizes)
    except ValueError as e:
        raise UnitFailed(str(e)) from e
    report = verify(ep.module(), compiled, sets, unit.verify.atol, unit.verify.rtol)
    log.note(f"verified on {', '.join(report.checked)}: max abs {report.max_abs_err:.3g}, max rel {report.max_rel_err:.3g}")
    result.metrics.update(max_abs_err=report.max_abs_err, max_rel_err=report.max_rel_err)
    return report, sets


def _claim(unit: Unit, store: Store, key: str, log: UnitLog, phase: Phases) -> Lease | dict[str, Any]:
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


def _hit(unit: Unit, store: Store, manifest: dict[str, Any], loaded: Loaded, tmp: Path, log: UnitLog, phase: Phases,
         result: UnitResult) -> None:
    """A manifest exists. With `weights: shapes` and another checkpoint's weights, show that the
    artifact runs with ours and matches our program run eagerly before calling it a hit. An
    autotune candidate takes latencies measured since publishing, and measures the stored
    artifact again on retune or at a hot size it was never timed at on this device."""
    result.status = "hit"
    result.artifact = BlobRef.from_dict(manifest["blobs"]["artifact"])
    result.log = BlobRef.from_dict(manifest["blobs"]["log"]) if manifest["blobs"].get("log") else None
    result.metrics.update(manifest.get("metrics", {}))
    timings = manifest.get("timings", {})
    result.saved_s = manifest.get("compile_s", sum(timings.get(p, 0.0) for p in COMPILE_PHASES))
    result.device = manifest.get("device")
    built_with = manifest.get("weights", {}).get("built_with")
    swap = unit.target.weights == "shapes" and built_with != loaded.built_with
    if unit.target.candidate is None and not swap:  # a plain hit: the manifest says it all
        return
    device = fingerprint_of(loaded.backend.device_fingerprint(unit.target))
    if unit.target.candidate is not None and not unit.remeasure:  # measured again after it was published?
        result.metrics.update(get_measurements(store, result.key, device))
    unmeasured = [f"{w}={n}" for w, n in unit.hot_sizes if f"compiled_ms@{w}={n}" not in result.metrics]
    remeasure = unit.remeasure or bool(unmeasured)  # never at a hot size on this device: measure now
    if not swap and not remeasure:
        return
    artifact = store.fetch(result.artifact.digest, tmp / "artifact")
    compiled = loaded.backend.load(artifact, unit.target, loaded.ep)
    if swap:
        log.note(f"the artifact was built with weights {built_with}; checking it with this checkpoint's ({loaded.built_with})")
        with phase("verify"):
            report, _ = _verify(unit, loaded.ep, compiled, log, result)
        if not report.ok:
            raise UnitFailed(f"the cached artifact for key {result.key} does not reproduce this checkpoint: "
                             + "; ".join(report.problems) + ". Report it: the key should have told them apart")
        result.metrics.update(weights_swapped=1.0)
    if remeasure:  # retuning, or sizes never measured: the artifact stands, its latency is measured here
        with phase("benchmark"):
            _benchmark(unit, loaded.ep, compiled, input_sets(loaded.ep, 0)[0], loaded.backend, log, result)
        put_measurements(store, result.key, device, {k: v for k, v in result.metrics.items() if "_ms" in k})


def _publish(unit: Unit, store: Store, ready: Compiled, log: UnitLog, result: UnitResult, timings: dict[str, float]) -> None:
    result.artifact = store.put_file(ready.artifact)
    log.note(f"artifact {result.artifact.digest} ({result.artifact.size} bytes); publishing")
    result.log = store.put_bytes(log.text().encode())  # linked from the manifest
    manifest = _manifest(unit, result, ready, timings)
    if not store.publish_manifest(result.key, manifest):
        log.note("another worker published this key first; its manifest stands")
    result.status = "compiled"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""


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
        "metrics": dict(result.metrics),
        "device": result.device,  # where the metrics were measured
        "timings": dict(timings),
        "compile_s": sum(timings.get(p, 0.0) for p in COMPILE_PHASES),
        "worker": result.worker,
        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
