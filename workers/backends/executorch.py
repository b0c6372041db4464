"""`executorch:portable` and `executorch:xnnpack`: an ExecuTorch program (.pte) for edge runtimes.

The exported program is lowered to the Edge dialect and emitted as a .pte, with no delegate
(every op runs on ExecuTorch's portable kernels) or with the XNNPACK delegate taking the ops it
supports; the ops it cannot take stay in the program and run on portable kernels, and `facts`
lists both, so nothing is dropped unseen. A node the partitioner offers and XNNPACK's
preprocessing then refuses (it checks more than the partitioner does) is kept off the delegate
and the program lowered again: `facts["delegate_refused"]` names each one and why. An op no
ExecuTorch kernel implements fails the lowering with a message that names it.

Verification and benchmarks run the .pte with ExecuTorch's Python runtime, in the sandbox like
every artifact; the runtime checks the program's internal consistency as it loads it.

`executorch` is an optional extra (`pip install -e '.[executorch]'`, which `./dev` does): a
host without it offers no `farm_executorch` slots, and a unit that reaches it anyway fails
saying which extra to install.
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import re
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from workers.backends import cpu_isa
from workers.backends.base import LoweringError, Placement
from workers.errors import summary
from workers.unit import Target

if TYPE_CHECKING:  # torch is the sandbox child's; the worker that plans and keys never imports it
    from torch.export import ExportedProgram

RESOURCE = "farm_executorch"
DELEGATES = ("portable", "xnnpack")
# Options a target may set (and an autotune candidate vary): the XNNPACK partitioner's.
OPTIONS = {"xnnpack": {"per_op_mode": bool}, "portable": {}}
MAX_REFUSALS = 32  # nodes the delegate may refuse before the lowering gives up (each costs a lowering)
INSTALL = "pip install -e '.[executorch]' in the farm's environment (./dev installs it)"


def installed() -> str | None:
    """ExecuTorch's version on this host, or None; without importing it (seconds of torchao)."""
    if importlib.util.find_spec("executorch") is None:
        return None
    try:
        return importlib.metadata.version("executorch")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def _xnnpack_schema() -> str | None:
    """The XNNPACK delegate's serialization schema (its flatbuffer identifier, e.g. XN01)."""
    spec = importlib.util.find_spec("executorch.backends.xnnpack")
    if spec is None or not spec.submodule_search_locations:
        return None
    schema = Path(next(iter(spec.submodule_search_locations))) / "serialization" / "schema.fbs"
    found = re.search(r'file_identifier\s+"(\w+)"', schema.read_text()) if schema.is_file() else None
    return found.group(1) if found else None


def pte_contents(artifact: Path) -> dict[str, Any]:
    """What a .pte holds: its methods, the operators run on portable kernels, the delegates."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    program = deserialize_pte_binary(artifact.read_bytes())
    program = getattr(program, "program", program)
    plans = program.execution_plan
    return {
        "methods": [p.name for p in plans],
        "portable_ops": sorted({f"{o.name}.{o.overload}" if o.overload else o.name for p in plans for o in p.operators}),
        "delegates": sorted({d.id for p in plans for d in p.delegates}),
        "delegate_calls": sum(len(p.delegates) for p in plans),
    }


def is_pte(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(8)[4:6] == b"ET"  # the flatbuffer's file identifier, ET12 for example


def load_pte(artifact: Path, ep: ExportedProgram | None = None) -> Callable[..., Any]:
    """A callable running the .pte's `forward` with ExecuTorch's runtime. It takes the program's
    (args, kwargs) and, given the program, returns outputs in its structure (a list otherwise)."""
    import torch
    import torch.utils._pytree as pytree
    from executorch.runtime import Runtime, Verification

    try:
        program = Runtime.get().load_program(Path(artifact), verification=Verification.InternalConsistency)
        method = program.load_method("forward")
    except Exception as e:  # the runtime reports a malformed program as a RuntimeError (or worse) only
        raise LoweringError(f"ExecuTorch cannot load {artifact}: {type(e).__name__}: {e}") from e

    def run(*args: Any, **kwargs: Any) -> Any:
        flat = [a.contiguous() if isinstance(a, torch.Tensor) else a for a in pytree.tree_leaves((args, kwargs))]
        # outputs live in the method's planned memory: the next call overwrites them
        outputs = [o.clone() if isinstance(o, torch.Tensor) else o for o in method.execute(flat)]
        return pytree.tree_unflatten(outputs, ep.call_spec.out_spec) if ep is not None else outputs

    return run


# ExecuTorch's compiler, the XNNPACK partitioner, the .pte reader and the runtime: 1.3 CPU-s of
# imports beyond a sandbox child's own (torchao's among them), which its workers' zygotes import
# ahead (Placement.warm_imports); no other backend's unit runs on those workers.
WARM_IMPORTS = ("executorch.exir", "executorch.backends.xnnpack.partition.xnnpack_partitioner",
                "executorch.exir._serialize._program", "executorch.runtime")


class ExecuTorch:
    name = "executorch"
    weights_in_code = True  # a .pte holds its weights as constants
    device = "cpu"
    modes = ("inference",)
    static_shapes = False

    def delegate(self, target: Target) -> str:
        if target.isa not in DELEGATES:
            raise LoweringError(f"target {target.label}: say which ExecuTorch flavour: "
                                f"{' or '.join(f'executorch:{d}' for d in DELEGATES)}")
        return target.isa

    def validate(self, target: Target) -> None:
        allowed = OPTIONS[self.delegate(target)]
        for name, value in target.options_dict.items():
            if name not in allowed:
                raise LoweringError(f"target {target.label}: unknown option {name!r}; "
                                    f"it takes {', '.join(allowed) or 'no options'}")
            if not isinstance(value, allowed[name]):
                raise LoweringError(f"target {target.label}: option {name} must be a {allowed[name].__name__}")

    def target_components(self, target: Target) -> dict[str, Any]:
        return {"backend": self.name, "device": "cpu", "format": "pte", "delegate": self.delegate(target)}

    def toolchain(self, target: Target) -> dict[str, Any]:
        tools: dict[str, Any] = {"executorch": installed()}
        if tools["executorch"] is not None:
            from executorch.version import git_version

            tools["executorch_git"] = git_version
        if self.delegate(target) == "xnnpack":
            tools["xnnpack_schema"] = _xnnpack_schema()
        return tools

    def placement(self, target: Target) -> Placement:
        return Placement(RESOURCE, unoffered=f"targets executorch:* need the executorch extra on a node: {INSTALL}",
                         warm_imports=WARM_IMPORTS)

    def offers(self, slots: int) -> dict[str, float]:
        return {RESOURCE: float(slots)} if installed() else {}

    def device_fingerprint(self, target: Target) -> dict[str, Any]:
        return cpu_isa.cpu_fingerprint()

    def host_problem(self, target: Target) -> str | None:
        if installed() is None:
            return f"target {target.label} needs ExecuTorch, which this host lacks: {INSTALL}"
        return None

    def prepare(self, ep: ExportedProgram, target: Target) -> ExportedProgram:
        return ep

    def lower(self, ep: ExportedProgram, target: Target, workdir: Path) -> Path:
        from executorch.exir import to_edge_transform_and_lower

        delegate, refused = self.delegate(target), []
        while True:
            partitioners = [_xnnpack_partitioner(target.options_dict, refused)] if delegate == "xnnpack" else []
            try:
                program = to_edge_transform_and_lower(ep, partitioner=partitioners).to_executorch()
                break
            except RuntimeError as e:
                missing = re.search(r"Missing out variants: (\{.*?\})", str(e))
                if missing:  # an op neither the delegate nor a portable kernel takes: never dropped, named
                    raise LoweringError(f"ExecuTorch has no kernel for these operators: {missing.group(1)}; register "
                                        f"an out variant and kernel for them, or compile this graph for another "
                                        f"target") from e
                refusal = _refused_by_delegate(e)
                if refusal is None:
                    raise
                if refusal in refused or len(refused) >= MAX_REFUSALS:
                    raise LoweringError(f"the XNNPACK delegate kept refusing nodes ({len(refused) + 1}, the last "
                                        f"{refusal.node}: {refusal.reason}); compile this graph for "
                                        f"executorch:portable, which needs no delegate") from e
                # The partitioner offered the delegate a node its preprocessing then refused: lower
                # again with that node left to portable kernels, as for any op it does not take.
                traceback.print_exception(e)
                print(f"the XNNPACK delegate refused node {refusal.node} ({refusal.op}): {refusal.reason} "
                      f"Lowering again with it on portable kernels.")
                refused.append(refusal)
        out = workdir / "program.pte"
        with open(out, "wb") as f:
            program.write_to_file(f)
        _refusals_file(out).write_text(json.dumps([asdict(r) for r in refused]))
        return out

    def load(self, artifact: Path, target: Target, ep: ExportedProgram | None = None) -> Callable[..., Any]:
        problem = self.host_problem(target)
        if problem:
            raise LoweringError(problem, retryable=True)
        return load_pte(artifact, ep)

    def describe(self, artifact: Path, target: Target) -> dict[str, Any]:
        return {
            "format": "executorch-pte",
            "delegate": self.delegate(target),
            "executorch": installed(),
            **pte_contents(artifact),
            "delegate_refused": _read_refusals(artifact),
            "load": "executorch.runtime.Runtime.get().load_program(PATH).load_method('forward').execute([inputs...]), "
                    "or farm.client.load_compiled(PATH)",
        }


@dataclass(frozen=True)
class Refusal:
    """A node the XNNPACK partitioner accepted and its preprocessing refused (it runs on portable kernels)."""
    node: str
    op: str
    reason: str


def _refused_by_delegate(e: RuntimeError) -> Refusal | None:
    """The node whose serialization raised `e` inside XNNPACK's preprocessing, if that is where it
    was raised: the node visitors check what the partitioner does not (an unsqueeze whose output
    has two dynamic dimensions, for one) and raise without naming the node, so it is read from the
    visitor's frame."""
    import torch

    for frame, _ in traceback.walk_tb(e.__traceback__):
        if frame.f_code.co_name == "define_node" and "/backends/xnnpack/" in frame.f_code.co_filename:
            node = frame.f_locals.get("node")
            if isinstance(node, torch.fx.Node):
                return Refusal(node.name, getattr(node.target, "__name__", str(node.target)), summary(e))
    return None


def _xnnpack_partitioner(options: dict[str, Any], refused: list[Refusal]) -> Any:
    """XNNPACK's partitioner, taking none of the nodes its preprocessing refused before."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
        XnnpackPartitioner,
    )

    partitioner = XnnpackPartitioner(**options)
    names = {r.node for r in refused}
    if names:
        for config in partitioner.target_partitioner_configs.values():
            config.check_constraints = _not_in(names, config.check_constraints)
    return partitioner


def _not_in(names: set[str], check: Callable[..., bool]) -> Callable[..., bool]:
    return lambda node, ep: node.name not in names and check(node, ep)


def _refusals_file(artifact: Path) -> Path:
    return artifact.with_name(artifact.name + ".refused.json")


def _read_refusals(artifact: Path) -> list[dict[str, str]]:
    path = _refusals_file(artifact)
    return json.loads(path.read_text()) if path.is_file() else []
