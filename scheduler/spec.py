"""The job spec: YAML, validated on load, with errors that name the file and the field.

It lives below the scheduler (the CLI and the client build on it; nothing here imports them),
and its defaults are the workers' own policies (VerifyPolicy, BenchPolicy, UnitLimits), so a
default is defined once: the command line's defaults are read from here."""
from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from scheduler.fair import DEFAULT_PRIORITY, Priority
from workers.autotune.space import DEFAULT_SPACE, resolve_space
from workers.backends.option_policy import options_problems
from workers.unit import BenchPolicy, Mode, Unit, UnitLimits, VerifyPolicy

RETRIES = 2  # re-queues of a unit whose worker died, unless the job or the command line says otherwise


class SpecError(ValueError):
    """The job spec is wrong; the message names the file and field and says what to do."""


def _plain_name(v: str) -> str:
    if not v or "/" in v or v.startswith("."):
        raise ValueError("must be a plain name without '/' (it becomes part of ids and result names)")
    return v


PlainName = Annotated[str, AfterValidator(_plain_name)]


def _allowed_options(v: dict[str, Any]) -> dict[str, Any]:
    problems = options_problems(v)
    if problems:
        raise ValueError("; ".join(problems))
    return v


InductorOptions = Annotated[dict[str, Any], AfterValidator(_allowed_options)]  # workers/backends/option_policy.py


def _module_name(v: str) -> str:
    if not all(part.isidentifier() for part in v.split(".")):
        raise ValueError(f"{v!r} is not a module name: give dotted names as `import` takes them "
                         "(e.g. transformers.modeling_outputs), never a path")
    return v


ModuleName = Annotated[str, AfterValidator(_module_name)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GraphSpec(_Strict):
    path: str = Field(description="a .pt2 written by torch.export.save: a path (relative to the job file) or s3:// URI")
    name: str | None = None
    modules: list[ModuleName] = []

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, v: Any) -> Any:
        return {"path": v} if isinstance(v, str) else v

    @property
    def label(self) -> str:
        return self.name or Path(self.path.rstrip("/")).name.removesuffix(".pt2") or self.path  # "." has no name


RankDevice = Literal["cpu", "cuda"]


class GangSpec(_Strict):
    """A multi-rank model: one exported program per rank, compiled together as a gang whose
    ranks agree through compiler collectives (workers/gang/rank.py)."""
    name: PlainName = Field(description="the model's name; its ranks' results are <name>.rank<N>")
    ranks: list[str] | str = Field(
        description="one .pt2 per rank, in rank order, or one pattern with {rank} (e.g. tp/rank{rank}.pt2)")
    world_size: int = Field(ge=1, le=1024, description="how many ranks the model runs on")
    devices: list[RankDevice] | RankDevice = Field(
        "cpu", description="cpu or cuda: one for every rank, or a list with one per rank; a gang talks over "
                           "gloo on CPU and NCCL on GPU, so its ranks are all one or all the other")
    collective_timeout_s: float = Field(
        60.0, gt=0, description="a compiler collective not answered by every rank within this fails the gang")
    modules: list[ModuleName] = []

    @model_validator(mode="after")
    def _one_program_per_rank(self) -> "GangSpec":
        if isinstance(self.ranks, str):
            if "{rank}" not in self.ranks:
                raise ValueError(f"ranks: the pattern {self.ranks!r} has no {{rank}}; give a list of paths, "
                                 f"or a pattern such as tp/rank{{rank}}.pt2")
        elif len(self.ranks) != self.world_size:
            raise ValueError(f"ranks: {len(self.ranks)} programs listed for world_size {self.world_size}; "
                             f"list one .pt2 per rank")
        if isinstance(self.devices, list):
            if len(self.devices) != self.world_size:
                raise ValueError(f"devices: {len(self.devices)} listed for world_size {self.world_size}; "
                                 f"give one per rank, or one for all")
            if len(set(self.devices)) > 1:
                raise ValueError("devices: a gang's ranks are all cpu (gloo) or all cuda (NCCL); "
                                 "split a mixed model into gangs per device")
        return self

    def paths(self) -> list[str]:
        if isinstance(self.ranks, str):
            return [self.ranks.replace("{rank}", str(r)) for r in range(self.world_size)]
        return list(self.ranks)

    @property
    def device(self) -> RankDevice:
        return self.devices[0] if isinstance(self.devices, list) else self.devices


class CandidateSpec(_Strict):
    name: str
    options: InductorOptions = {}


class AutotuneSpec(_Strict):
    candidates: list[str | CandidateSpec] = Field(
        list(DEFAULT_SPACE), description="preset names (default, max_autotune, freezing, ...) or {name, options}")
    retune: bool = Field(False, description="measure every candidate again even if a tuning record exists")
    specialize: dict[str, list[int]] = Field(
        {}, description="`<input>.<dim>` of a dynamic dimension → hot sizes to compile static specializations for")

    @field_validator("specialize")
    @classmethod
    def _dims_and_sizes(cls, v: dict[str, list[int]]) -> dict[str, list[int]]:
        for where, sizes in v.items():
            name, _, dim = where.rpartition(".")
            if not name or not dim.isdigit():
                raise ValueError(f"{where!r}: name a dimension as <input>.<dim>, e.g. x.0 for the first dimension of input x")
            if not sizes or any(s < 1 for s in sizes) or len(set(sizes)) != len(sizes):
                raise ValueError(f"{where}: give distinct sizes of at least 1, got {sizes}")
        return v

    @field_validator("candidates")
    @classmethod
    def _names_unique(cls, v: list[str | CandidateSpec]) -> list[str | CandidateSpec]:
        names = [c if isinstance(c, str) else c.name for c in v]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"candidate names must be unique; listed twice: {', '.join(twice)}")
        return v


class TargetSpec(_Strict):
    backend: str = Field(description="lowering backend, e.g. aoti-cpu")
    isa: str | None = None
    mode: Mode = Field("inference", description="inference: the forward only; train: forward and backward of a "
                                                "training step (inductor-cache, aot-compile)")
    options: InductorOptions = {}
    timeout_s: float | None = Field(None, gt=0, description="overrides limits.timeout_s for this target's units")
    autotune: AutotuneSpec | None = Field(None, description="compile candidates in parallel and keep the fastest")

    @model_validator(mode="after")
    def _space_resolves(self) -> "TargetSpec":
        if self.autotune is not None:
            self.space()  # raises with the reason, which pydantic attaches to this target
        return self

    def space(self) -> dict[str, dict[str, Any]]:
        """Candidate name → its Inductor options (on top of `options`); `default` first."""
        assert self.autotune is not None
        raw = [c if isinstance(c, str) else c.model_dump() for c in self.autotune.candidates]
        return resolve_space(self.backend, raw)

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, v: Any) -> Any:
        """'aoti-cpu', 'aoti-cpu:avx512', or with the mode as target labels write it: 'inductor-cache:avx2+train'."""
        if isinstance(v, str):
            v, _, mode = v.partition("+")
            backend, _, isa = v.partition(":")
            return {"backend": backend, "isa": isa or None, **({"mode": mode} if mode else {})}
        return v


class VerifySpec(_Strict):
    atol: float = Field(VerifyPolicy.atol, ge=0)
    rtol: float = Field(VerifyPolicy.rtol, ge=0)
    extra_sizes: int = Field(VerifyPolicy.extra_sizes, ge=0, le=8, description="sizes to try per dynamic dimension besides the example")


class BenchmarkSpec(_Strict):
    warmup: int = Field(BenchPolicy.warmup, ge=0)
    repeat: int = Field(BenchPolicy.repeat, ge=1)


class LimitsSpec(_Strict):
    timeout_s: float = Field(UnitLimits.timeout_s, gt=0, description="a unit still running after this is failed with reason timeout")
    retries: int = Field(RETRIES, ge=0, description="times a unit is re-queued when its worker dies")
    workers: int | None = Field(None, ge=1, description="workers per device class (default: every slot offered)")
    lease_s: float = Field(Unit.lease_ttl_s, gt=0, description="a compile whose worker shows no life for this long is taken over")
    memory_gb: float = Field(UnitLimits.memory_gb, gt=0, description="memory of a unit's sandbox, compilers included")
    file_gb: float = Field(UnitLimits.file_gb, gt=0, description="largest file a unit's sandbox may write")
    archive_gb: float = Field(UnitLimits.archive_gb, gt=0, description="a graph archive's members, decompressed, in all")


class JobSpec(_Strict):
    name: PlainName = "job"
    gangs: list[GangSpec] = Field([], description="multi-rank models, compiled as gangs (one program per rank)")
    graphs: list[GraphSpec] = Field([], validate_default=True)
    targets: list[TargetSpec] = Field(min_length=1)
    modules: list[ModuleName] = Field([], description="modules to import before loading any program (e.g. pytree "
                                                       "registrations)")
    verify: VerifySpec = VerifySpec()
    benchmark: BenchmarkSpec = BenchmarkSpec()
    limits: LimitsSpec = LimitsSpec()
    weights: Literal["values", "shapes"] = Field(
        "values", description="values: one artifact per checkpoint; shapes: the key hashes only weight names, shapes "
                              "and dtypes, and any checkpoint of the same architecture loads into the artifact")
    priority: Priority = Field(DEFAULT_PRIORITY, description="interactive, batch or nightly: a job's share of a farm "
                                                             "service's workers (scheduler/fair.py has the weights)")
    base_dir: str = Field(".", exclude=True, description="where relative graph paths start; set from the job file")

    @field_validator("graphs")
    @classmethod
    def _something_to_compile(cls, v: list[GraphSpec], info: ValidationInfo) -> list[GraphSpec]:
        if not v and not info.data.get("gangs"):
            raise ValueError("list at least one graph, or a multi-rank model under gangs")
        return v

    @model_validator(mode="after")
    def _gangs_apart(self) -> "JobSpec":
        names = [g.name for g in self.gangs]
        if len(set(names)) != len(names):
            raise ValueError(f"gangs: names must be unique, got {names}")
        if self.gangs and any(t.autotune and t.autotune.specialize for t in self.targets):
            raise ValueError("gangs: autotune.specialize (static specializations) is not supported for gangs; "
                             "drop it, or list the multi-rank model's targets in a job of its own")
        return self

    def resolve(self, graph: GraphSpec | str) -> str:
        """A graph's source (a GraphSpec or a path as written) as a URI or absolute path."""
        path = graph.path if isinstance(graph, GraphSpec) else graph
        if "://" in path or Path(path).is_absolute():
            return path
        return str((Path(self.base_dir) / path).resolve())


def _field_names() -> set[str]:
    """Every field a job spec has, at any depth (what a misspelt one is matched against)."""
    models, names = list(_Strict.__subclasses__()), set()
    while models:
        model = models.pop()
        names |= set(model.model_fields)
        models += model.__subclasses__()
    return names


def _format(e: ValidationError, source: str) -> str:
    lines = [f"{source}: the job spec is invalid:"]
    for err in e.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        hint = ""
        if err["type"] == "extra_forbidden" and err["loc"]:
            close = difflib.get_close_matches(str(err["loc"][-1]), _field_names() - {"base_dir"}, n=1, cutoff=0.75)
            hint = f" (did you mean `{close[0]}`?)" if close else ""
        lines.append(f"  {where}: {err['msg']}{hint}")
    lines.append("  see README.md 'Job spec' for every field")
    return "\n".join(lines)


def parse_job(data: Any, source: str = "<job>", base_dir: str | Path = ".") -> JobSpec:
    if not isinstance(data, dict):
        raise SpecError(f"{source}: a job spec is a YAML mapping with `graphs` and `targets`, got {type(data).__name__}")
    try:
        job = JobSpec.model_validate({**data, "base_dir": str(base_dir)})
    except ValidationError as e:
        raise SpecError(_format(e, source)) from e
    _check_sources(job, source)
    return job


# A graph already in the farm's store, by digest (`blob://sha256/<hex>`): what a client that hands
# its job to a farm service names its local graphs as, once it has uploaded them.
BLOB_SCHEME = "blob://"


def is_local_source(path: str) -> bool:
    """A graph named by a path on the machine that wrote the spec (not in the store, not a remote URI)."""
    return not path.startswith(BLOB_SCHEME) and ("://" not in path or path.startswith("file://"))


def allowed_sources() -> list[str]:
    """FARM_ALLOWED_SOURCES: comma-separated prefixes (`s3://models/`, `/data/graphs/`) every graph
    must come from; unset or empty allows any."""
    return [p.strip() for p in os.environ.get("FARM_ALLOWED_SOURCES", "").split(",") if p.strip()]


def _check_sources(job: JobSpec, source: str) -> None:
    prefixes = allowed_sources()
    if not prefixes:
        return
    named = [(f"graphs.{i}.path", job.resolve(g)) for i, g in enumerate(job.graphs)]
    named += [(f"gangs.{i}.ranks.{r}", job.resolve(p)) for i, g in enumerate(job.gangs) for r, p in enumerate(g.paths())]
    for field_name, where in named:
        if not where.startswith(BLOB_SCHEME) and not any(where.startswith(p) for p in prefixes):
            raise SpecError(f"{source}: {field_name}: {where} is outside the sources this farm allows "
                            f"(FARM_ALLOWED_SOURCES: {', '.join(prefixes)}); copy the graph there")


MAX_JOB_BYTES = 1 << 20


class _NoAliasLoader(yaml.SafeLoader):
    """YAML without anchors and aliases: a few lines of `*alias` can expand to billions of nodes."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed in a job spec; "
                                              "write the value out", mark)
        return super().compose_node(parent, index)


def load_job(path: str | Path) -> JobSpec:
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_JOB_BYTES:
            raise SpecError(f"{path}: {size} bytes is too big for a job spec (limit {MAX_JOB_BYTES}); "
                            f"list fewer graphs per job or split the job")
        data = yaml.load(path.read_text(), Loader=_NoAliasLoader)
    except FileNotFoundError as e:
        raise SpecError(f"{path}: no such job file") from e
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: not valid YAML: {e}") from e
    return parse_job(data, str(path), path.parent.resolve())


def job_to_yaml(job: JobSpec) -> str:
    return yaml.safe_dump(job.model_dump(mode="json", exclude={"base_dir"}), sort_keys=False)
