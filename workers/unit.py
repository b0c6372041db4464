"""The typed messages a worker takes and gives back (they cross Ray, so no bare dicts)."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from storage import BlobRef, Transfer

Status = Literal["compiled", "hit", "failed", "skipped"]
WeightsMode = Literal["values", "shapes"]
# inference: the artifact serves forward calls; train: forward and backward of a training step
Mode = Literal["inference", "train"]
COMPILE_PHASES = ("lower", "verify", "benchmark")


@dataclass(frozen=True)
class Target:
    backend: str  # registry name, e.g. "aoti-cpu"
    isa: str | None = None  # CPU ISA the artifact is pinned to (None: the backend's default)
    options: tuple[tuple[str, Any], ...] = ()  # lowering options (Inductor config overrides), sorted
    # values: the key hashes every weight (an artifact per checkpoint); shapes: only names, shapes
    # and dtypes, and the artifact keeps weights out of its code so any checkpoint loads into it
    weights: WeightsMode = "values"
    candidate: str | None = None  # the autotune candidate these options come from, if any
    # inductor-cache in a gang: `<input>.<dim>`s every rank marks dynamic before torch.compile sees them
    mark_dynamic: tuple[str, ...] = ()
    mode: Mode = "inference"
    # aot-compile: the sizes (`<input>.<dim>`, size) it also builds for besides the example's (its shapes are static)
    sizes: tuple[tuple[str, int], ...] = ()

    @property
    def base_label(self) -> str:
        label = f"{self.backend}:{self.isa}" if self.isa else self.backend
        return label if self.mode == "inference" else f"{label}+{self.mode}"

    @property
    def label(self) -> str:
        return f"{self.base_label}[{self.candidate}]" if self.candidate else self.base_label

    @property
    def options_dict(self) -> dict[str, Any]:
        return dict(self.options)


@dataclass(frozen=True)
class VerifyPolicy:
    atol: float = 1e-4
    rtol: float = 1e-4
    extra_sizes: int = 2  # sizes tried per dynamic dimension besides the example's

    def gap(self, manifest: dict[str, Any]) -> tuple[str | None, bool]:
        """How a manifest's verification falls short of these tolerances (None: it covers them),
        and whether its recorded max error shows the artifact within them anyway. The key is the
        same at any tolerance, so a hit under stricter ones must be checked, not assumed."""
        verified = manifest.get("verify") or {}
        atol, rtol = verified.get("atol"), verified.get("rtol")
        if not all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in (atol, rtol)):
            why = "the manifest does not say what tolerances it was verified at"
        elif atol <= self.atol and rtol <= self.rtol:
            return None, True
        else:
            why = (f"the stored artifact was verified at atol={atol:g}, rtol={rtol:g}; this job asks "
                   f"atol={self.atol:g}, rtol={self.rtol:g}")
        # |compiled - eager| <= atol passes allclose at any rtol, on the inputs it was checked at
        err = (manifest.get("metrics") or {}).get("max_abs_err")
        return why, isinstance(err, (int, float)) and not isinstance(err, bool) and 0 <= err <= self.atol

    def covers(self, manifest: dict[str, Any]) -> bool:
        """Whether a hit on this manifest needs no verification at these tolerances."""
        looser, within = self.gap(manifest)
        return looser is None or within


@dataclass(frozen=True)
class BenchPolicy:
    warmup: int = 3
    repeat: int = 20


@dataclass(frozen=True)
class UnitLimits:
    """What one unit may use in its sandbox (workers/sandbox/process.py). The job spec's `limits` defaults come from here."""
    timeout_s: float = 1800.0  # wall clock, for the whole unit
    memory_gb: float = 16.0  # address space of the sandbox and of the compilers it runs
    file_gb: float = 8.0  # largest file the sandbox may write
    archive_gb: float = 32.0  # a graph archive's members, declared and decompressed, all together

    @property
    def cpu_s(self) -> float:
        """CPU seconds per unit: the wall-clock limit on every core."""
        return self.timeout_s * (os.cpu_count() or 1)


@dataclass(frozen=True)
class Unit:
    graph: str  # a name a person recognises (file stem or the job's `name`)
    source: str  # where the graph came from (path or URI), for messages
    target: Target
    program: BlobRef | None  # the .pt2 in the store; None when it could not be ingested
    ingest_error: str | None = None
    modules: tuple[str, ...] = ()
    verify: VerifyPolicy = VerifyPolicy()
    bench: BenchPolicy = BenchPolicy()
    limits: UnitLimits = UnitLimits()
    lease_ttl_s: float = 60.0  # a compile whose worker shows no life for this long is taken over
    remeasure: bool = False  # on a hit, benchmark the stored artifact again (retuning)
    specialize: tuple[str, int] | None = None  # compile the program with dimension `<input>.<dim>` fixed at a size
    hot_sizes: tuple[tuple[str, int], ...] = ()  # also benchmark at these sizes (autotune compares specializations)
    # a gang's agreed shapes: the program is re-exported with exactly these dynamic dimensions
    # (`<input>.<dim>`, lowest, highest or None) and example inputs of these sizes (`<input>.<dim>`, size)
    agreed_dims: tuple[tuple[str, int, int | None], ...] = ()
    agreed_sizes: tuple[tuple[str, int], ...] = ()
    graph_bytes: int | None = None  # its program's serialized graphs, without weights (scheduler/compile_size.py)

    @property
    def unit_id(self) -> str:
        return f"{self.graph}@{self.target.label}"

    @property
    def compile_size(self) -> int:
        """What the pools send a class's units out by, largest first: its graphs' bytes where its
        archive said, else the whole program's (weights too: it then goes out early, the safe side)."""
        if self.graph_bytes is not None:
            return self.graph_bytes
        return self.program.size if self.program else 0

    @property
    def agreed(self) -> tuple:
        """The gang's agreement on this rank's shapes, () when there is none."""
        return (self.agreed_dims, self.agreed_sizes) if self.agreed_dims or self.agreed_sizes else ()


@dataclass(frozen=True)
class Gang:
    """A multi-rank model's ranks for one target, compiled together (workers/gang/rank.py)."""
    name: str
    ranks: tuple[Unit, ...]  # rank r's unit at index r
    device: str = "cpu"  # cpu: the ranks' artifacts talk over gloo; cuda: over NCCL
    collective_timeout_s: float = 60.0
    # autotune: candidate name → its options; the candidates are split across the ranks
    candidates: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def label(self) -> str:
        return f"{self.name}@{self.ranks[0].target.label}"

    @property
    def identical(self) -> bool:
        """Whether every rank's archive has the same bytes (rank 0 reads for them all)."""
        return all(self.reader_of(r) == 0 for r in range(self.world_size))

    def reader_of(self, rank: int) -> int:
        """The rank that loads rank `rank`'s archive: the lowest rank whose archive has the same
        bytes (what a graph says follows from its bytes, so identical archives are read once)."""
        program = self.ranks[rank].program
        if program is None:
            return rank
        return next(r for r, u in enumerate(self.ranks) if u.program is not None and u.program.digest == program.digest)


@dataclass
class UnitResult:
    graph: str
    target: str
    status: Status
    key: str | None = None
    error: str | None = None
    retryable: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    artifact: BlobRef | None = None
    log: BlobRef | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    worker: str | None = None
    retries: int = 0  # times the unit was re-queued after its worker died
    components: dict[str, Any] | None = None  # what the key hashed (for `farm explain`)
    saved_s: float | None = None  # for hits: the compile time the manifest recorded
    device: dict[str, Any] | None = None  # the device fingerprint its latencies were measured on
    candidate: str | None = None  # autotune: the candidate of a candidate's row, the winner of the tuned row
    transfer: Transfer = field(default_factory=Transfer)
    note: str | None = None  # how a hit was accepted when the manifest alone did not settle it
    transient: bool = False  # failed because the store could not be reached: the job runs it again shortly
    failed_in: str | None = None  # the phase it failed in (fetch, load, lower, verify, …)
    trace: BlobRef | None = None  # the lowering's torch trace (workers/trace.py), compiled or failed

    def to_row(self, job_id: str) -> dict[str, Any]:
        t = self.timings
        return {
            "job_id": job_id,
            "graph": self.graph,
            "target": self.target,
            "key": self.key,
            "status": self.status,
            "error": self.error,
            "retryable": self.retryable,
            **{f"{p}_s": t.get(p) for p in ("fetch", "load", "lower", "verify", "benchmark", "upload", "total")},
            "artifact_digest": self.artifact.digest if self.artifact else None,
            "artifact_bytes": self.artifact.size if self.artifact else None,
            "log_digest": self.log.digest if self.log else None,
            "trace_digest": self.trace.digest if self.trace else None,
            **{k: self.metrics.get(k) for k in ("max_abs_err", "max_rel_err", "eager_ms", "compiled_ms", "speedup")},
            "worker": self.worker,
            "retries": self.retries,
            "candidate": self.candidate,
            "compiled_spread_ms": self.metrics.get("compiled_spread_ms"),
            "weights_mode": (self.components or {}).get("program", {}).get("weights_mode"),
            "compile_s": sum(t[p] for p in COMPILE_PHASES if p in t) if self.status == "compiled" else None,
            "saved_s": self.saved_s,
            "lease_wait_s": t.get("lease_wait"),
            "bytes_uploaded": self.transfer.uploaded,
            "bytes_downloaded": self.transfer.downloaded,
            "bytes_cached": self.transfer.cached,
            "note": self.note,
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "UnitResult":
        """The inverse of to_dict (a job's results as a farm service wrote them to the store)."""
        refs = {k: BlobRef.from_dict(d[k]) if d.get(k) else None for k in ("artifact", "log", "trace")}
        return cls(**{**d, **refs, "transfer": Transfer(**(d.get("transfer") or {}))})
