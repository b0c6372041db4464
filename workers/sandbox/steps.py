"""The steps of a unit that touch untrusted input. They run only in the sandbox child
(workers/sandbox/child.py), never in a process that holds credentials, and answer with plain
JSON-able values: the worker trusts nothing the child says beyond numbers and strings.

The child keeps the program it loaded between the steps of one unit (identify → lower →
check), so a unit loads its graph once.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch.export import ExportedProgram

from workers.autotune.share import benchmarked, recording_timings
from workers.autotune.specialize import reexport, specialization_problems, specialize
from workers.backends import LoweringError, jit_entries, resolve
from workers.check.benchmark import measure
from workers.check.inputs import dynamic_dims, input_sets, inputs_at, static_sets
from workers.check.train import random_ops, step, undifferentiable_collectives, verify_training
from workers.check.verify import VerifyReport, verify
from workers.errors import summary
from workers.gang.steps import GangSteps, gang_facts
from workers.sandbox import compiler_cache
from workers.sandbox.archive import ArchiveLimits, GiB, HostileArchive, check_archive
from workers.sandbox.env import HEADERS, environ_set
from workers.sandbox.program import ProgramError, load_program, program_identity, weights_digest
from workers.trace import torch_trace
from workers.unit import Unit


class StepFailed(Exception):
    """The step cannot go on for a reason the user can act on."""


def _archive_limits(unit: Unit) -> ArchiveLimits:
    return ArchiveLimits(max_bytes=int(unit.limits.archive_gb * GiB))


@contextlib.contextmanager
def unpacked_in(unit_dir: Path) -> Iterator[None]:
    """TMPDIR in the unit's own dir while an artifact loads: torch's AOTInductor loader unpacks the
    package into $TMPDIR/aotinductor_*, which only the loaded model's destructor removes, and a
    child is always killed in the end, so one dir per child was left in /tmp (thousands on a busy
    host). The unit's dir goes with the unit. Python's own temp dir stays: it is fixed at start,
    and so is Inductor's precompiled header beside it, which every child shares."""
    import tempfile

    tempfile.gettempdir()  # settled before TMPDIR moves, if nothing asked yet
    with environ_set("TMPDIR", str(unit_dir)):
        yield


@contextlib.contextmanager
def own_inductor_config() -> Iterator[None]:
    """Restore every Inductor setting after a lowering. AOTInductor leaves
    `aot_inductor.metadata` filled in; that setting is part of Inductor's FX graph cache key,
    so a later torch.compile in the same process would key its cache entries differently from
    a fresh serving process."""
    from torch._inductor import config

    saved = config.save_config()  # a pickled deep copy: survives settings mutated in place
    try:
        yield
    finally:
        config.load_config(saved)


# Options under which Inductor times kernels on the device while it lowers.
TIMES_KERNELS = ("max_autotune", "max_autotune_gemm", "max_autotune_pointwise", "coordinate_descent_tuning")


@contextlib.contextmanager
def alone_on_device(device: str, needed: bool = True) -> Iterator[None]:
    """Timings on a GPU shared by several workers are taken one worker at a time."""
    if device != "cuda" or not needed:
        yield
        return
    from workers.backends.cuda import exclusive_gpu

    with exclusive_gpu():
        yield


def _feeding_remote_caches(backend: Any, workdir: Path) -> contextlib.AbstractContextManager[None]:
    """A backend whose compile makes torch's own cache entries records them for the remote caches."""
    return jit_entries.recording(workdir) if getattr(backend, "feeds_remote_caches", False) else contextlib.nullcontext()


class Steps(GangSteps):
    def __init__(self) -> None:
        self._loaded: tuple[str, ExportedProgram] | None = None  # (unit id, its program)
        self._prepared: ExportedProgram | None = None  # the loaded program on the target's device
        self._compiled: tuple[str, Any] | None = None  # (artifact path, the loaded artifact): verify, then benchmark
        self._named: tuple[Unit, dict[str, Any]] | None = None  # the unit the loaded program is, and what it was named

    def _program(self, unit: Unit) -> ExportedProgram:
        if self._loaded is None or self._loaded[0] != unit.unit_id:
            raise StepFailed(f"{unit.unit_id}: no program loaded in this sandbox (identify first)")
        return self._loaded[1]

    def _on_device(self, unit: Unit) -> ExportedProgram:
        """The program as the backend lowers and runs it (e.g. moved to the GPU); made once per unit."""
        if self._prepared is None:
            self._prepared = resolve(unit.target).prepare(self._program(unit), unit.target)
        return self._prepared

    def identify(self, unit: Unit, program: str, facts: bool = False) -> dict[str, Any]:
        """Load the graph (checked first, see workers/sandbox/archive.py) and name its content; with
        `facts`, also say what a gang's compiler collectives compare (workers/gang/steps.py).

        The program still loaded for this very unit (the same archive digest, fetched and
        checked by the parent, and the same agreement, specialization and weights mode), with
        nothing lowered or run from it since, is named again without loading it: a gang's
        reader names its program for the gang, then compiles it."""
        if self._named is not None and self._named[0] == unit and self._prepared is None and self._compiled is None:
            return {**self._named[1], **({"facts": self._facts(self._loaded[1])} if facts else {})}
        self._loaded = self._prepared = self._compiled = self._named = None
        ep = load_program(Path(program), unit.source, list(unit.modules), _archive_limits(unit))
        if unit.specialize:
            where, size = unit.specialize
            try:
                ep = specialize(ep, where, size)
            except ValueError as e:
                raise StepFailed(f"cannot specialize {where}={size}: {e}") from e
        if unit.agreed:
            try:
                ep = reexport(ep, {w: (lo, hi) for w, lo, hi in unit.agreed_dims}, dict(unit.agreed_sizes))
            except Exception as e:  # export fails in many ways; the gang reports it for this rank
                raise StepFailed(f"cannot export the program again with the gang's agreed shapes "
                                 f"{list(unit.agreed_dims)}: {type(e).__name__}: {summary(e)}") from e
        identity = program_identity(ep, weights_by_value=unit.target.weights == "values")
        built_with = identity["weights"] if unit.target.weights == "values" else weights_digest(ep, values=True)
        self._loaded = (unit.unit_id, ep)
        self._named = (unit, {"identity": identity, "built_with": built_with})
        return {**self._named[1], **({"facts": self._facts(ep)} if facts else {})}

    @staticmethod
    def _facts(ep: ExportedProgram) -> dict[str, Any]:
        try:
            return gang_facts(ep)
        except ValueError as e:
            raise StepFailed(str(e)) from e

    def lower(self, unit: Unit, workdir: str) -> dict[str, Any]:
        backend = resolve(unit.target)
        ep = self._on_device(unit)
        problem = _training_problem(unit, ep) if unit.target.mode == "train" else None
        if problem:  # it could not be verified, or would train on wrong gradients: say so before compiling it
            raise StepFailed(problem)
        before = benchmarked()
        tunes = any(unit.target.options_dict.get(o) for o in TIMES_KERNELS)
        ccache_log = compiler_cache.stats_log(Path(workdir))  # None: no compiler cache here
        try:  # timings taken while lowering are taken alone on the GPU too
            with own_inductor_config(), alone_on_device(backend.device, tunes), recording_timings() as measured, \
                    torch_trace(Path(workdir)), _feeding_remote_caches(backend, Path(workdir)), \
                    environ_set("CCACHE_STATSLOG", str(ccache_log)) if ccache_log else contextlib.nullcontext():
                artifact = backend.lower(ep, unit.target, Path(workdir))
        except LoweringError:
            raise
        except Exception as e:  # Inductor and the C++ compiler fail in many ways: a unit error, traceback in the log
            raise StepFailed(f"lowering failed: {type(e).__name__}: {summary(e)} (see the unit log)") from e
        return {"artifact": str(artifact), "facts": backend.describe(artifact, unit.target),
                "autotune_benchmarked": benchmarked() - before, "autotune_entries": measured,
                "compiler_cache": compiler_cache.read_stats(ccache_log) if ccache_log else {}}

    def check(self, unit: Unit, artifact: str, verify_it: bool, bench_it: bool) -> dict[str, Any]:
        """Load an artifact (a freshly lowered one, or one from the store), verify it against the
        program run eagerly and measure both."""
        backend = resolve(unit.target)
        ep, device = self._on_device(unit), backend.device
        compiled = self._load_artifact(unit, ep, Path(artifact))
        out: dict[str, Any] = {"metrics": {}, "checked": [], "problems": []}
        program = self._program(unit)
        try:  # made on the CPU from the program as exported (random sizes need a CPU generator), then moved
            sets = static_sets(program, unit.target.sizes) if backend.static_shapes else \
                input_sets(program, unit.verify.extra_sizes if verify_it else 0)
            sets = [s.to(device) for s in sets]
        except ValueError as e:
            raise StepFailed(str(e)) from e
        if verify_it:
            report = self._verify(unit, ep, compiled, sets)
            print(f"verified on {', '.join(report.checked)}: max abs {report.max_abs_err:.3g}, "
                  f"max rel {report.max_rel_err:.3g}")
            out["metrics"].update(max_abs_err=report.max_abs_err, max_rel_err=report.max_rel_err)
            out["checked"], out["problems"] = report.checked, report.problems
            if not report.ok:
                return out
        if bench_it:
            with alone_on_device(device):
                out["metrics"].update(self._benchmark(unit, ep, compiled, sets[0], device))
        return out

    def _verify(self, unit: Unit, ep: ExportedProgram, compiled: Any, sets: list) -> VerifyReport:
        atol, rtol = unit.verify.atol, unit.verify.rtol
        if unit.target.mode == "inference":
            return verify(self.eager_reference(ep), compiled, sets, atol, rtol)
        problem = _randomness_problem(unit, ep)
        if problem:
            return VerifyReport(ok=False, max_abs_err=0.0, max_rel_err=0.0, problems=[problem])
        return verify_training(self.eager_reference(ep), compiled, sets, atol, rtol, seeded=bool(random_ops(ep)))

    def _load_artifact(self, unit: Unit, ep: ExportedProgram, path: Path) -> Any:
        if self._compiled is not None and self._compiled[0] == str(path):
            return self._compiled[1]
        if _is_zip(path):
            try:
                check_archive(path, f"artifact of {unit.unit_id}", _archive_limits(unit), native_code=True)
            except HostileArchive as e:
                raise StepFailed(str(e)) from e
        with unpacked_in(Path.cwd()):
            compiled = resolve(unit.target).load(path, unit.target, ep)
        self._compiled = (str(path), compiled)
        return compiled

    def _benchmark(self, unit: Unit, ep: ExportedProgram, compiled: Any, inputs: Any, device: str) -> dict[str, float]:
        """Forward calls, or in `mode: train` whole training steps (forward and backward)."""
        train = unit.target.mode == "train"
        as_run = step if train else (lambda fn: fn)
        eager = measure(as_run(self.eager_reference(ep)), inputs, unit.bench.warmup, unit.bench.repeat, device, train)
        compiled = as_run(compiled)
        fast = measure(compiled, inputs, unit.bench.warmup, unit.bench.repeat, device, train)
        metrics = dict(eager_ms=eager.median_ms, compiled_ms=fast.median_ms, compiled_spread_ms=fast.spread_ms,
                       speedup=eager.median_ms / fast.median_ms)
        print(f"eager {eager.median_ms:.3f} ms, compiled {fast.median_ms:.3f} ms ± {fast.spread_ms:.3f} "
              f"(median and interquartile range of {unit.bench.repeat} runs)")
        exported = self._program(unit)
        dims = dynamic_dims(exported)
        for where, size in unit.hot_sizes:  # where a specialization would compete with this artifact
            if where in dims:
                at = inputs_at(exported, {dims[where][0]: size}, f"{where}={size}", torch.Generator().manual_seed(0))
                hot = measure(compiled, at.to(device), unit.bench.warmup, unit.bench.repeat, device, train)
                metrics.update({f"compiled_ms@{where}={size}": hot.median_ms,
                                f"compiled_spread_ms@{where}={size}": hot.spread_ms})
                print(f"at {where}={size}: compiled {hot.median_ms:.3f} ms ± {hot.spread_ms:.3f}")
        return metrics

    def specialization_problems(self, unit: Unit, program: str, asked: list[tuple[str, list[int]]]) -> dict[str, Any]:
        """Hot sizes outside their dimension's range, one list per (`<input>.<dim>`, sizes) asked."""
        ep = load_program(Path(program), unit.source, list(unit.modules), _archive_limits(unit))
        return {"problems": [specialization_problems(ep, where, sizes) for where, sizes in asked]}

    def input_names(self, unit: Unit, program: str) -> dict[str, Any]:
        ep = load_program(Path(program), unit.source, list(unit.modules), _archive_limits(unit))
        return {"names": list(ep.graph_signature.user_inputs)}


def _training_problem(unit: Unit, ep: ExportedProgram) -> str | None:
    """Why this program's training step cannot be compiled as asked, or None."""
    lacking = undifferentiable_collectives(ep)
    if lacking:
        return (f"the training step goes through {', '.join(lacking)}, which autograd in torch {torch.__version__} "
                "cannot differentiate (it would backpropagate as if it were the identity, with a warning, and train "
                "on wrong gradients); use a collective autograd supports (all_reduce, all_gather_into_tensor, "
                "reduce_scatter_tensor, all_to_all_single), or compile this program for inference")
    return _randomness_problem(unit, ep)


def _randomness_problem(unit: Unit, ep: ExportedProgram) -> str | None:
    """Why a training step's gradients could not be compared with eager's, or None."""
    drawn = random_ops(ep)
    if not drawn or unit.target.options_dict.get("fallback_random"):
        return None
    return (f"the program draws random numbers ({', '.join(drawn)}), which Inductor draws differently from eager, "
            "so its gradients cannot be compared; add the option fallback_random: true to the target (Inductor "
            "then draws as eager does), or export the model in eval mode")


def _is_zip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


USER_ERRORS = (StepFailed, ProgramError, LoweringError)


def warm_up() -> None:
    """Imports every step needs, paid once by the sandbox's zygote (workers/sandbox/zygote.py),
    whose children are forked with them: a lowering's modules too (Inductor's compiler, its
    passes and code generators, Dynamo's), which a child's first lowering would otherwise import.
    Imports only, and where Inductor keeps its precompiled headers: nothing here starts a thread
    or a process, so the zygote forks safely."""
    import torch._dynamo  # noqa: F401
    import torch._export.serde.serialize  # noqa: F401
    import torch._functorch.aot_autograd  # noqa: F401
    import torch._inductor.codecache  # noqa: F401
    import torch._inductor.codegen.cpp  # noqa: F401
    import torch._inductor.codegen.cpp_wrapper_cpu  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    import torch._inductor.fx_passes.post_grad  # noqa: F401
    import torch._inductor.lowering  # noqa: F401
    import torch._inductor.select_algorithm  # noqa: F401
    import torch.export.pt2_archive._package  # noqa: F401
    import torch.utils.cpp_extension  # noqa: F401

    headers_in_the_nodes_dir()


def headers_in_the_nodes_dir() -> None:
    """Inductor keeps its precompiled headers (about 5 CPU-s of g++ each, two per ISA) in its default
    cache dir whatever TORCHINDUCTOR_CACHE_DIR says (codecache._HEADER_DIR, set as it is imported).
    A jailed child's default dir is where its worker bound the node's in (env.jailed_env), and so is
    FARM_SHARED_CACHE. An unjailed child's default dir is the host's temp dir's, which is not the
    node's where FARM_NODE_CACHE names another (a pod's cache volume, which a restarted pod keeps; a
    bench's fresh node per side): there its headers were built again after every pod restart, and a
    bench's "cold" side found the other side's. So a child keeps them in the dir its worker said, the
    node's, jailed or not."""
    from torch._inductor import codecache

    node = os.environ.get("FARM_SHARED_CACHE")
    if node and hasattr(codecache, "_HEADER_DIR"):  # (another torch may keep them otherwise: left as it is)
        codecache._HEADER_DIR = os.path.join(node, HEADERS)
        codecache._HEADER_LOCK_DIR = os.path.join(codecache._HEADER_DIR, "locks")


def import_ahead(names: Sequence[str]) -> None:
    """Import each module now, for the children a zygote forks after; one that fails (another
    torch version, an extra not installed) is said, and left to the step that needs it."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001
            print(f"sandbox warm-up: not imported ahead: {name} ({type(e).__name__}: {e})", file=sys.stderr)


def warm_up_lowering() -> None:
    """What a process's first lowering does beyond warm_up's imports (0.5 CPU-s here, 0.9 s of a
    job's first unit): import Inductor's code generators and sympy's modules, trace Inductor's
    pattern-matcher passes. The zygote does it once one of its children has lowered, so the next
    children fork with it done (workers/sandbox/zygote.py). Nothing here starts a thread or
    leaves a lock its children would share. It only saves children work: should another torch
    version lack or break any of it, a child does it as its first lowering would."""
    import_ahead(FIRST_LOWERING_IMPORTS)
    try:
        _register_inductor_patterns()
    except Exception as e:  # noqa: BLE001
        print(f"sandbox warm-up: Inductor's patterns not traced ahead ({type(e).__name__}: {e})", file=sys.stderr)


# What an AOTInductor lowering imports the first time a process lowers, beyond the imports above:
# Inductor's code generators for every device (its backend registration imports them all, even
# for a CPU graph), torch.export's tracer, the package writer, and sympy's modules that its
# simplification imports. Each fresh child imported them again in its first lowering.
FIRST_LOWERING_IMPORTS = (
    "sympy.physics.units", "sympy.tensor.tensor", "sympy.combinatorics",
    "torch._export.passes.add_runtime_assertions_for_constraints_pass", "torch.export._trace", "torch.export._unlift",
    "torch._inductor.bounds", "torch._inductor.choices", "torch._inductor.extern_node_serializer",
    "torch._inductor.package.package", "torch._inductor.codegen.cpp_wrapper_cpu_array_ref",
    "torch._inductor.codegen.cpp_wrapper_gpu", "torch._inductor.codegen.cpp_wrapper_mps",
    "torch._inductor.codegen.cuda_combined_scheduling", "torch._inductor.codegen.halide", "torch._inductor.codegen.mps",
    "torch._inductor.codegen.pallas", "torch._inductor.codegen.python_wrapper_mtia",
    "torch._inductor.codegen.wrapper_fxir", "torch._inductor.codegen.xpu.xpu_combined_scheduling",
    "torch._inductor.codegen.segmented_tree", "torch._inductor.codegen.cpu_device_op_overrides",
    "torch._inductor.codegen.cuda.device_op_overrides", "torch._inductor.codegen.mps_device_op_overrides",
    "torch._inductor.codegen.mtia.device_op_overrides", "torch._inductor.codegen.xpu.device_op_overrides",
    "torch._inductor.fx_passes.freezing_patterns", "torch._subclasses.schema_check_mode",
    "torch.fx.experimental.validator", "torch.utils.serialization", "torchgen.aoti.fallback_ops",
)


def _register_inductor_patterns() -> None:
    """Inductor's pattern-matcher passes, traced once per process as it first compiles (0.3 CPU-s
    here, in every child's first lowering), are traced in the zygote for CPU graphs. Their
    registration reads no config, so a child forked with them is as a process that compiled
    once before. (Not Inductor's backend registration, which picks a wrapper by the config at
    hand: that stays with the child's first lowering and its unit's options.)"""
    from torch._inductor.fx_passes import joint_graph, post_grad, pre_grad

    with _tqdm_left_unstarted():
        joint_graph.lazy_init(torch.device("cpu"))
        post_grad.lazy_init()
        pre_grad.lazy_init()


@contextlib.contextmanager
def _tqdm_left_unstarted() -> Iterator[None]:
    """fx's interpreter opens a (disabled) tqdm bar per run, and tqdm's first bar starts a monitor
    thread and makes a multiprocessing lock. A zygote forks with no thread, and its children
    must share no lock: one killed holding it would hang the others. So tqdm is left as
    imported: each child makes its own, as it did before."""
    from tqdm import std

    interval = std.tqdm.monitor_interval
    std.tqdm.monitor_interval = 0  # no monitor thread
    try:
        yield
    finally:
        std.tqdm.monitor_interval = interval
        for cls, made in ((std.tqdm, "_lock"), (std.TqdmDefaultWriteLock, "mp_lock")):
            if made in cls.__dict__:
                delattr(cls, made)
