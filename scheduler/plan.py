"""Job → units. Every graph is ingested into the store once (so any worker can fetch it by
digest); a graph that cannot be read still becomes units, which fail with the reason, so
one bad graph never stops a job."""
from __future__ import annotations

import re
import tempfile
from dataclasses import replace
from pathlib import Path

from scheduler.compile_size import file_graph_bytes, graph_bytes
from scheduler.spec import BLOB_SCHEME, JobSpec, SpecError, TargetSpec
from storage import BlobRef, Store, StoreError, download_uri
from storage.store import blob_path
from workers.backends import LoweringError, resolve
from workers.sandbox import tempdirs
from workers.unit import BenchPolicy, Gang, Target, Unit, UnitLimits, VerifyPolicy


def ingest(store: Store, source: str, estimate: bool = False) -> tuple[BlobRef, int | None]:
    """Put a graph file (local path or URI) into the store; raise with a message for people. With
    `estimate`, also its graphs' bytes (scheduler/compile_size.py), read from the file at hand, or,
    for a blob a client uploaded, from the end of the blob in the store; else None."""
    if source.startswith(BLOB_SCHEME):
        ref = stored_blob(store, source)
        return ref, stored_graph_bytes(store, ref) if estimate else None
    if "://" in source and not source.startswith("file://"):
        with tempfile.TemporaryDirectory(prefix=tempdirs.prefix("ingest")) as tmp:
            local = Path(tmp) / "graph.pt2"
            try:
                download_uri(source, local)
            except (FileNotFoundError, StoreError, ValueError) as e:
                raise FileNotFoundError(f"cannot fetch {source}: {e}") from e
            return store.put_file(local), file_graph_bytes(local) if estimate else None
    path = Path(source.removeprefix("file://"))
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; check the path (relative paths start at the job file)")
    if path.is_dir():
        raise FileNotFoundError(f"{path} is a directory; name the .pt2 file written by torch.export.save")
    return store.put_file(path), file_graph_bytes(path) if estimate else None


def stored_blob(store: Store, source: str) -> BlobRef:
    """A graph a client uploaded before handing its job to a farm service."""
    match = re.fullmatch(r"blob://sha256/([0-9a-f]{64})", source)
    if match is None:
        raise FileNotFoundError(f"{source} is not a blob address: blob://sha256/ and 64 hex digits")
    size = store.backend.size(blob_path(match[1]))
    if size is None:
        raise FileNotFoundError(f"{source} is not in {store.uri}; the client uploads a graph before it submits, "
                                f"so submit the job again")
    return BlobRef(match[1], size)


def _target(t: TargetSpec, job: JobSpec) -> Target:
    return Target(backend=t.backend, isa=t.isa, options=tuple(sorted(t.options.items())), weights=job.weights,
                  mode=t.mode)


def _limits(job: JobSpec, t: TargetSpec) -> UnitLimits:
    lim = job.limits
    return UnitLimits(timeout_s=t.timeout_s or lim.timeout_s, memory_gb=lim.memory_gb, file_gb=lim.file_gb,
                      archive_gb=lim.archive_gb)


def _ingested(store: Store, source: str, estimate: bool = False) -> tuple[BlobRef | None, int | None, str | None]:
    try:
        return *ingest(store, source, estimate), None
    except (OSError, StoreError) as e:
        return None, None, str(e)


def stored_graph_bytes(store: Store, ref: BlobRef) -> int | None:
    """A stored program's graphs' bytes, read from the end of its blob; None, and the pool goes
    by its size, where the read fails."""
    try:
        return graph_bytes(lambda n: store.backend.read_tail(blob_path(ref.digest), n), ref.size)
    except StoreError:
        return None


def plan_gangs(job: JobSpec, store: Store) -> list[Gang]:
    """Every multi-rank model becomes one gang per target: a unit per rank, compiled together."""
    verify = VerifyPolicy(job.verify.atol, job.verify.rtol, job.verify.extra_sizes)
    bench = BenchPolicy(job.benchmark.warmup, job.benchmark.repeat)
    gangs: list[Gang] = []
    for spec in job.gangs:
        sources = [job.resolve(p) for p in spec.paths()]
        programs = [(ref, error) for ref, _, error in (_ingested(store, source) for source in sources)]
        for t in job.targets:
            target = _target(t, job)
            mismatch = _device_mismatch(target, spec.device, spec.name)
            ranks = tuple(Unit(graph=f"{spec.name}.rank{r}", source=source, target=target, program=ref,
                               ingest_error=mismatch or error, modules=tuple(job.modules) + tuple(spec.modules),
                               verify=verify, bench=bench, limits=_limits(job, t), lease_ttl_s=job.limits.lease_s)
                          for r, (source, (ref, error)) in enumerate(zip(sources, programs)))
            candidates = tuple((name, tuple(sorted({**t.options, **options}.items())))
                               for name, options in t.space().items()) if t.autotune else ()
            gangs.append(Gang(spec.name, ranks, spec.device, spec.collective_timeout_s, candidates))
    return gangs


def _device_mismatch(target: Target, device: str, gang: str) -> str | None:
    try:
        built_for = resolve(target).device
    except LoweringError as e:
        return str(e)
    if built_for != device:
        return (f"target {target.label} builds for {built_for}, but gang {gang}'s ranks run on {device}; "
                f"set the gang's devices or list a {device} target")
    return None


def plan(job: JobSpec, store: Store) -> list[Unit]:
    verify = VerifyPolicy(job.verify.atol, job.verify.rtol, job.verify.extra_sizes)
    bench = BenchPolicy(job.benchmark.warmup, job.benchmark.repeat)
    units: list[Unit] = []
    seen: set[str] = set()
    for graph in job.graphs:
        source = job.resolve(graph)
        ref, estimate, error = _ingested(store, source, estimate=len(job.graphs) > 1)  # (one graph: nothing to order)
        label = _unique(graph.label, seen)
        for t in job.targets:
            unit = Unit(
                graph=label,
                source=source,
                target=_target(t, job),
                program=ref,
                ingest_error=error,
                modules=tuple(job.modules) + tuple(graph.modules),
                verify=verify,
                bench=bench,
                limits=_limits(job, t),
                lease_ttl_s=job.limits.lease_s,
                graph_bytes=estimate,
            )
            units.extend(_candidates(unit, t) if t.autotune else [unit])
    return units


def _candidates(unit: Unit, t: TargetSpec) -> list[Unit]:
    """An autotuned target becomes one unit per candidate: each is compiled, verified and
    benchmarked on its own worker (scheduler/tuning.py then picks the winner). Configuration
    candidates are also measured at every hot size; each hot size gets a static
    specialization candidate of its own."""
    hot = tuple((where, size) for where, sizes in t.autotune.specialize.items() for size in sizes)
    static = unit.target.backend == "aot-compile"  # static shapes: it builds for every hot size as well
    configs = [
        replace(unit, target=replace(unit.target, candidate=name, options=tuple(sorted({**t.options, **options}.items())),
                                     sizes=hot if static else ()),
                remeasure=t.autotune.retune, hot_sizes=hot)
        for name, options in t.space().items()
    ]
    statics = [replace(unit, target=replace(unit.target, candidate=f"{where}={size}"), remeasure=t.autotune.retune,
                       specialize=(where, size)) for where, size in hot]
    return configs + statics


def check_specializations(job: JobSpec, store: Store, units: list[Unit]) -> None:
    """Hot sizes must lie inside their dimension's range: checked against each program before
    anything runs, so a job with an impossible specialization is rejected as it loads."""
    import time

    from scheduler.kept_sandbox import warm_sandbox
    from workers.sandbox.process import SandboxFailed

    asked = [(i, t) for i, t in enumerate(job.targets) if t.autotune and t.autotune.specialize]
    programs = {u.graph: u for u in units if u.program is not None}
    if not asked or not programs:
        return
    with warm_sandbox() as sandbox, sandbox.workdir("check") as tmp:  # graphs are hostile input
        wanted = [(i, where, sizes) for i, t in asked for where, sizes in t.autotune.specialize.items()]
        for graph, unit in sorted(programs.items()):
            program = store.fetch(unit.program.digest, tmp / "program.pt2")
            try:  # one load of the graph answers every target's hot sizes
                reply = sandbox.call("specialization_problems", tmp, unit.limits,
                                     time.monotonic() + unit.limits.timeout_s, unit=unit, program=str(program),
                                     asked=[(where, sizes) for _, where, sizes in wanted])
            except SandboxFailed:
                continue  # its units fail with the reason; nothing to check against
            found = reply.get("problems") if isinstance(reply.get("problems"), list) else []
            for (i, where, _), problems in zip(wanted, found):
                if problems:
                    raise SpecError(f"graph {graph}: targets.{i}.autotune.specialize.{where}: "
                                    + "; ".join(str(p) for p in problems)
                                    + "; list sizes inside the range, or drop the dimension")


def _unique(label: str, seen: set[str]) -> str:
    """Two graphs with one file name (a/model.pt2, b/model.pt2) must stay apart in results."""
    candidate, n = label, 2
    while candidate in seen:
        candidate, n = f"{label}#{n}", n + 1
    seen.add(candidate)
    return candidate
