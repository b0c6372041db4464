"""Loading exported programs and naming their content.

The key of a unit hashes what a program *is* (graph, signature, shape ranges, weights),
never the archive bytes: `torch.export.save` writes a fresh serialization id every time.
"""
from __future__ import annotations

import hashlib
import importlib
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.export import ExportedProgram

from workers.errors import summary
from workers.sandbox.archive import ArchiveLimits, HostileArchive, check_archive


class ProgramError(Exception):
    """The program cannot be used; the message says what to do about it."""


def import_modules(modules: list[str]) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:
            raise ProgramError(f"cannot import module {name!r} named in the job's `modules`: {e}") from e


JOB_MODULES = "to the job's `modules` list"  # where a farm job's unit names the modules to import first


def load_program(path: Path, label: str, modules: list[str] = (), limits: ArchiveLimits = ArchiveLimits(),
                 modules_hint: str = JOB_MODULES) -> ExportedProgram:
    """Load a torch.export.save archive, turning torch's generic errors into actionable ones.
    `modules_hint` says where this caller names modules to import first (a farm job's `modules`;
    a client's own argument).

    The archive is hostile until checked (workers/sandbox/archive.py); torch's loader then runs with
    every `torch.load` forced to `weights_only=True`, so even a member the check missed cannot
    reach the full unpickler, and the graph may only call operators."""
    from torch._export.verifier import SpecViolationError
    from torch.export.pt2_archive._package import load_pt2

    import_modules(list(modules))
    path = Path(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic and magic != b"PK\x03\x04":
        raise ProgramError(f"{label} is not a .pt2 archive: save the program with torch.export.save(ep, 'model.pt2')")
    try:
        check_archive(path, label, limits)
    except HostileArchive as e:
        raise ProgramError(str(e)) from e
    try:
        with weights_only_loads():
            contents = load_pt2(str(path))
    except NotImplementedError as e:
        if "pytree is not registered" in str(e):
            raise ProgramError(
                f"{label}: {e} Add the module that registers this output type (for Hugging Face outputs, "
                f"e.g. 'transformers.modeling_outputs') {modules_hint}."
            ) from e
        raise ProgramError(f"{label}: its program (member 'models/model.json') could not be deserialized: "
                           f"{summary(e)}; export and save it again") from e
    except RuntimeError as e:
        if "zip archive" in str(e):
            raise ProgramError(f"{label} is a truncated or corrupt .pt2 archive ({str(e).split('.')[0]}); export and save it again") from e
        raise ProgramError(f"{label}: its program (member 'models/model.json') could not be deserialized: "
                           f"{summary(e)}; export and save it again") from e
    except SpecViolationError as e:  # torch's verifier: a node calls something that is not an operator
        raise ProgramError(f"{label}: member 'models/model.json': {summary(e)}; the farm only runs graphs of "
                           f"operators") from e
    except (AssertionError, KeyError, TypeError, ValueError, AttributeError) as e:  # torch's deserializer on bad input
        raise ProgramError(f"{label}: its program (member 'models/model.json') could not be deserialized: "
                           f"{type(e).__name__}: {summary(e)}; export and save it again") from e
    if "model" not in contents.exported_programs:
        found = sorted(contents.exported_programs) or "none"
        raise ProgramError(f"{label} holds no program named 'model' (found: {found}); save it with torch.export.save")
    ep = contents.exported_programs["model"]
    problem = foreign_call(ep)
    if problem:
        raise ProgramError(f"{label}: {problem}; the farm only runs graphs of operators")
    return ep


@contextmanager
def weights_only_loads() -> Iterator[None]:
    """torch's deserializer falls back to loading without `weights_only`; force it on every load."""
    original = torch.load

    def safe_load(*args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        return original(*args, **kwargs)

    torch.load = safe_load
    try:
        yield
    finally:
        torch.load = original


SAFE_PYTHON_OPS = {"getitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs", "eq",
                   "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "not_", "invert", "lshift", "rshift"}


def foreign_call(ep: ExportedProgram) -> str | None:
    """Why the graph calls something that is not an operator (e.g. `torch.os.system`, which
    torch's deserializer resolves by attribute lookup), or None."""
    import math
    import operator

    for mod in ep.graph_module.modules():
        if not isinstance(mod, torch.fx.GraphModule):
            continue
        for node in mod.graph.nodes:
            if node.op in ("call_method", "call_module"):
                return f"node {node.name} is a {node.op}, which exported programs never hold"
            if node.op != "call_function":
                continue
            t = node.target
            if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)):
                continue
            name = getattr(t, "__name__", "")
            if getattr(operator, name, None) is t and name in SAFE_PYTHON_OPS or getattr(math, name, None) is t:
                continue
            if getattr(torch, name, None) is t and name.startswith(("sym_", "_sym_")):
                continue
            if t in (torch._C._set_grad_enabled, torch.amp.autocast_mode._enter_autocast,
                     torch.amp.autocast_mode._exit_autocast):
                continue
            return f"node {node.name} calls {getattr(t, '__module__', '?')}.{name or t!r}, which is not an operator"
    return None


def _tensor_digest(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _tensor_meta(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"tensor[{t.dtype},{tuple(t.shape)}]"
    return f"object[{type(t).__qualname__}]"


def weights_digest(ep: ExportedProgram, values: bool = True) -> str:
    """Digest of parameters, buffers and constants: by value, or (values=False) only by
    name, shape and dtype, for compiles that keep weights out of the code."""
    items = {f"state:{k}": v for k, v in ep.state_dict.items()}
    items.update({f"const:{k}": v for k, v in ep.constants.items()})
    h = hashlib.sha256()
    for name in sorted(items):
        v = items[name]
        part = _tensor_digest(v) if values and isinstance(v, torch.Tensor) else _tensor_meta(v)
        h.update(f"{name}={part}\n".encode())
    return h.hexdigest()


def graph_digest(ep: ExportedProgram) -> str:
    """Digest of the code of every graph (submodules for control flow included), the
    signature, the shapes of inputs and the ranges of dynamic dimensions."""
    h = hashlib.sha256()
    for name, mod in sorted(ep.graph_module.named_modules(), key=lambda kv: kv[0]):
        if isinstance(mod, torch.fx.GraphModule):
            h.update(f"module {name}\n{mod.code}\n".encode())
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            h.update(f"input {node.name}: {_tensor_meta(node.meta.get('val'))} {_shape(node)}\n".encode())
    h.update(f"signature {ep.graph_signature}\n".encode())
    ranges = sorted(f"{k}:{v}" for k, v in ep.range_constraints.items())
    h.update(f"ranges {ranges}\n".encode())
    h.update(f"call {ep.call_spec}\n".encode())
    return h.hexdigest()


def _shape(node: torch.fx.Node) -> str:
    val = node.meta.get("val")
    return str(tuple(val.shape)) if isinstance(val, torch.Tensor) else ""


def program_identity(ep: ExportedProgram, weights_by_value: bool = True) -> dict[str, str]:
    g = graph_digest(ep)
    w = weights_digest(ep, values=weights_by_value)
    digest = hashlib.sha256(json.dumps({"graph": g, "weights": w}, sort_keys=True).encode()).hexdigest()
    return {"program": digest, "graph": g, "weights": w, "weights_mode": "values" if weights_by_value else "shapes"}
