"""After the candidates of an autotuned unit have run: pick the winner, keep the tuning
record, publish the unit.

The autotuned unit has a key of its own: the default candidate's components plus the
candidate space. Its manifest is the winner's (same artifact blob) and names the winner and
the tuning record. A later job with the same program, space and device finds that manifest
and reuses the decision; its candidates are hits, so nothing is benchmarked. With `retune`
the candidates are measured again, the record is rewritten, and the manifest replaced.
"""
from __future__ import annotations

import collections
import datetime as dt
import socket
from typing import Any, Iterable

from storage import BlobRef, Store
from storage.tuning import put_tuning_record, record_path
from workers.autotune.share import fingerprint_of
from workers.autotune.space import Measured, decide
from workers.keys import key_of
from workers.unit import Unit, UnitResult


def _measured(unit: Unit, r: UnitResult) -> Measured:
    return Measured.of(unit.target.candidate, r, remeasured=unit.remeasure and "benchmark" in r.timings)


def finish_tuning(done: Iterable[tuple[Unit, UnitResult]], store: Store) -> list[UnitResult]:
    """One result per autotuned unit (graph × autotuned target) among the finished units."""
    groups: dict[tuple[str, str], list[tuple[Unit, UnitResult]]] = collections.defaultdict(list)
    for unit, result in done:
        if unit.target.candidate is not None:
            groups[(unit.graph, unit.target.base_label)].append((unit, result))
    return [_finish(graph, label, members, store) for (graph, label), members in groups.items()]


def _finish(graph: str, label: str, members: list[tuple[Unit, UnitResult]], store: Store) -> UnitResult:
    tuned = UnitResult(graph, f"{label} (autotuned)", "failed", worker=socket.gethostname())
    by_name = {u.target.candidate: (u, r) for u, r in members}
    default_unit, default = by_name["default"]
    if default.components is None:  # the program never loaded: every candidate failed the same way
        tuned.error = default.error
        return tuned
    space = {name: u.target.options_dict for name, (u, _) in by_name.items()}
    tuned.components = {**default.components, "autotune": space}
    tuned.key = key_of(tuned.components)
    retune = default_unit.remeasure

    existing = store.get_manifest(tuned.key)
    if existing is not None and not retune:  # decided before: reuse it, measure nothing
        tuned.status, tuned.candidate = "hit", existing["autotune"]["winner"]
        _take(tuned, existing)
        return tuned

    configs = [(u, r) for u, r in members if u.specialize is None]
    measured = [_measured(u, r) for u, r in configs]
    decision = decide(measured)
    if decision is None:
        tuned.error = f"graph {graph} ({label}): no candidate compiled and verified; see the candidates' rows"
        return tuned
    winner_unit, winner = by_name[decision.winner]
    statics = [_static(u, r, winner) for u, r in members if u.specialize is not None]
    device = winner.device or {}
    path = record_path(default.components["program"]["graph"], fingerprint_of(device))
    put_tuning_record(store, path, {
        "graph": graph, "target": label, "program": default.components["program"], "device": device,
        "space": space, "candidates": [m.to_dict() for m in measured],
        "winner": decision.winner, "reason": decision.reason, "specializations": statics,
        "decided_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    })
    manifest = {**store.get_manifest(winner.key), "key": tuned.key, "components": tuned.components,
                "target": tuned.target, "metrics": dict(winner.metrics), "device": winner.device,
                "autotune": {"winner": decision.winner, "reason": decision.reason, "tuning_record": path,
                             "candidates": {m.name: m.key for m in measured},
                             "specializations": [{k: st[k] for k in ("dim", "size", "key", "chosen", "reason")}
                                                 for st in statics]}}
    manifest["blobs"] = {**manifest["blobs"], **{f"static {st['dim']}={st['size']}": st["artifact"]
                                                 for st in statics if st["chosen"]}}
    if retune:
        store.replace_manifest(tuned.key, manifest)
    elif not store.publish_manifest(tuned.key, manifest):  # a concurrent job decided first: its decision stands
        manifest = store.get_manifest(tuned.key)
    tuned.status, tuned.candidate = "compiled", manifest["autotune"]["winner"]
    _take(tuned, manifest)
    return tuned


def _static(unit: Unit, r: UnitResult, winner: UnitResult) -> dict[str, Any]:
    """A static specialization is kept only if it beats the dynamic winner at its size by more
    than the noise of both; otherwise the dynamic artifact serves that size too."""
    where, size = unit.specialize
    at = f"{where}={size}"
    entry = {"dim": where, "size": size, "key": r.key, "status": r.status, "error": r.error,
             "median_ms": r.metrics.get("compiled_ms"), "spread_ms": r.metrics.get("compiled_spread_ms"),
             "dynamic_ms": winner.metrics.get(f"compiled_ms@{at}"),
             "dynamic_spread_ms": winner.metrics.get(f"compiled_spread_ms@{at}"),
             "artifact": r.artifact.to_dict() if r.artifact else None, "chosen": False}
    if r.status not in ("compiled", "hit") or entry["median_ms"] is None:
        entry["reason"] = "did not compile and verify"
    elif entry["dynamic_ms"] is None:
        entry["reason"] = f"the dynamic artifact was not measured at {at}"
    else:
        gain = entry["dynamic_ms"] - entry["median_ms"]
        noise = (entry["spread_ms"] or 0.0) + (entry["dynamic_spread_ms"] or 0.0)
        entry["chosen"] = gain > noise
        entry["reason"] = (f"{gain:.4f} ms faster than the dynamic artifact at {at}, "
                           f"{'more' if entry['chosen'] else 'not more'} than the noise {noise:.4f} ms")
    return entry


def _take(tuned: UnitResult, manifest: dict[str, Any]) -> None:
    tuned.artifact = BlobRef.from_dict(manifest["blobs"]["artifact"])
    tuned.log = BlobRef.from_dict(manifest["blobs"]["log"]) if manifest["blobs"].get("log") else None
    tuned.metrics.update(manifest.get("metrics", {}))
    tuned.device = manifest.get("device")
