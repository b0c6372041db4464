"""Is a unit already in the store? The pure lookup, apart from the compile path:

    program identity (from the store, or by loading the program in a sandbox) → key → manifest

No log capture, no lease, no verification, no benchmarking. The scheduler asks it before it
starts any worker, a gang rank to name its program, and the compile path starts with it.
A hit that needs a check first (another checkpoint's weights, looser tolerances than the job's,
latencies never measured at a hot size) is not answered here: the compile path checks it.
"""
from __future__ import annotations

import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from storage import BlobRef, Store, StoreError
from storage.identities import get_identity, put_identity
from storage.signing import UntrustedDocument
from storage.tuning import get_measurements
from workers.autotune.share import fingerprint_of
from workers.backends import LoweringError, resolve
from workers.keys import identity_variant, key_components, key_of
from workers.sandbox.process import Sandbox, SandboxFailed
from workers.unit import COMPILE_PHASES, Unit, UnitResult

DIGEST = re.compile(r"[0-9a-f]{64}")


class UnitFailed(Exception):
    def __init__(self, message: str, retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True)
class Found:
    """What the store says about a unit."""

    key: str
    components: dict[str, Any]
    identity: dict[str, str]
    built_with: str  # digest of the weight values the program carries
    identity_known: bool  # named from the store (no sandbox loaded the program for it)
    manifest: dict[str, Any] | None  # only a complete one: every blob it names is in the store
    incomplete: str | None = None  # why a manifest that exists is not served (a blob of it is gone)


Identify = Callable[[], tuple[dict[str, str], str]]


def find(unit: Unit, store: Store, identify: Identify) -> Found:
    """Name the program (from the store, else with `identify`, whose answer the store keeps for
    the next asker) and read the manifest of the unit's key."""
    if unit.program is None:
        raise UnitFailed(unit.ingest_error or f"{unit.source} could not be read")
    backend = resolve(unit.target)
    variant = identity_variant(unit.target.weights, unit.specialize, unit.agreed)
    known = get_identity(store, unit.program.digest, variant)
    if known is not None:  # this archive was loaded by a sandbox before: no sandbox needed now
        identity, built_with = parse_identity(known)
    else:
        identity, built_with = identify()
        put_identity(store, unit.program.digest, variant, {"identity": identity, "built_with": built_with})
    components = key_components(identity, backend.target_components(unit.target), unit.target.options_dict,
                                backend.toolchain(unit.target))
    key = key_of(components)
    manifest, incomplete = store.complete_manifest(key)
    if manifest is not None:
        store.note_use(key, manifest)  # a lookup that finds it is a use (as REAPI's FindMissingBlobs)
    return Found(key, components, identity, built_with, known is not None, manifest, incomplete)


def parse_identity(reply: dict[str, Any]) -> tuple[dict[str, str], str]:
    """The identity in a sandbox's answer or a stored identity document, if it is well formed."""
    identity = reply.get("identity")
    if not isinstance(identity, dict) or not all(DIGEST.fullmatch(str(identity.get(k))) for k in ("program", "graph", "weights")):
        raise UnitFailed("the program's identity (from the sandbox or the store) does not name its content")
    built_with = str(reply.get("built_with"))
    if not DIGEST.fullmatch(built_with):
        raise UnitFailed("the program's identity (from the sandbox or the store) does not name its weights")
    return {k: str(identity[k]) for k in ("program", "graph", "weights", "weights_mode")}, built_with


def identify_in(sandbox: Sandbox, unit: Unit, store: Store, workdir: Path) -> Identify:
    """Name the program by fetching it and loading it in the sandbox."""
    def identify() -> tuple[dict[str, str], str]:
        program = store.fetch(unit.program.digest, workdir / "program.pt2")
        return parse_identity(sandbox.call("identify", workdir, unit.limits, time.monotonic() + unit.limits.timeout_s,
                                           device=resolve(unit.target).device, unit=unit, program=str(program)))
    return identify


def needs_check(unit: Unit, found: Found) -> bool:
    """Whether a hit on this manifest must be checked before it counts (the compile path does)."""
    manifest = found.manifest or {}
    swap = unit.target.weights == "shapes" and manifest.get("weights", {}).get("built_with") != found.built_with
    return swap or not unit.verify.covers(manifest) or unit.remeasure or bool(unit.hot_sizes)


def fill_hit(result: UnitResult, manifest: dict[str, Any]) -> None:
    """A hit's result, as its manifest describes the artifact."""
    result.status = "hit"
    result.artifact = BlobRef.from_dict(manifest["blobs"]["artifact"])
    result.log = BlobRef.from_dict(manifest["blobs"]["log"]) if manifest["blobs"].get("log") else None
    result.trace = BlobRef.from_dict(manifest["blobs"]["trace"]) if manifest["blobs"].get("trace") else None
    result.metrics.update(manifest.get("metrics", {}))
    timings = manifest.get("timings", {})
    result.saved_s = manifest.get("compile_s", sum(timings.get(p, 0.0) for p in COMPILE_PHASES))
    result.device = manifest.get("device")


def lookup_unit(unit: Unit, store: Store, sandbox: Sandbox) -> UnitResult | None:
    """The unit's result if its key is in the store and the hit needs no check; else None (the
    compile path takes it from there, and reports any failure). A scheduler whose own process
    computes keys exactly as its workers would (same toolchain) answers hits with it without
    starting any worker."""
    if unit.program is None:
        return None
    with sandbox.workdir("lookup") as tmp:
        try:
            found = find(unit, store, identify_in(sandbox, unit, store, tmp))
        except (UnitFailed, SandboxFailed, LoweringError, StoreError, UntrustedDocument, OSError):
            return None  # the compile path meets the same error and reports it with the unit's log
    if found.manifest is None or needs_check(unit, found):
        return None
    result = UnitResult(unit.graph, unit.target.label, "hit", key=found.key, components=found.components,
                        worker=socket.gethostname())
    fill_hit(result, found.manifest)
    if unit.target.candidate is not None:  # latencies measured since the candidate was published
        device = fingerprint_of(resolve(unit.target).device_fingerprint(unit.target))
        result.metrics.update(get_measurements(store, found.key, device))
    return result
