"""Checking a .pt2 archive before torch sees it. Graphs and store artifacts are hostile input.

torch 2.13's loader runs code from an archive in several ways, all of them refused here:

- torch's full unpickler (`weights_only=False`) on pickled weights and constants (`use_pickle` payloads),
  and `deserialize_torch_artifact`, which retries `data/sample_inputs/*.pt` and the legacy
  `data/weights/<model>.pt` / `data/constants/<model>.pt` without `weights_only` when the safe
  load fails; `torch.export.load`'s 2.7-format fallback does the same for `serialized_*.pt`.
  Every member that is not a known plain-data file must load with torch's `weights_only`
  unpickler here, whatever its name.
- `pickle.loads` on `opaque_obj_*` constants and TorchScript's unpickler on `custom_obj_*`:
  arbitrary objects, refused outright.
- `data/aotinductor/`: `load_pt2` dlopens the compiled model in a graph archive. Native code is
  only accepted in artifacts, whose digest and manifest signature vouch for them.
- `sympy.sympify` on every `expr_str` of the JSON graph, which evaluates Python: each must be
  a plain arithmetic expression over symbols.

Structure is checked first: entry names (traversal, absolute, duplicates, symlinks), sizes
(declared and actually decompressed, streamed), format and schema versions.
"""
from __future__ import annotations

import ast
import functools
import io
import json
import re
import stat
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Iterator

GiB = 1 << 30
PLAIN_FILES = {"archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id",
               # torch 2.7's format (torch.export.load's fallback): refused after its pickles are checked
               "version", "serialized_exported_program.json", "serialized_state_dict.json", "serialized_constants.json"}
CONFIG = re.compile(r"data/(weights|constants)/[^/]+_config\.json")
SYMBOL_FUNCTIONS = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
MAX_EXPR_CHARS = 4096
MAX_JSON_BYTES = 256 << 20


class HostileArchive(Exception):
    """The archive is refused; the message names the member and says why."""


@dataclass(frozen=True)
class ArchiveLimits:
    max_bytes: int = 32 * GiB  # all entries together, declared and actual
    max_entries: int = 100_000
    max_ratio: int = 1000  # uncompressed / compressed, for compressed entries over 1 MiB


@dataclass
class _Layout:
    root: str
    names: dict[str, zipfile.ZipInfo]  # name inside the root → entry


def check_archive(path: Path, label: str, limits: ArchiveLimits = ArchiveLimits(), native_code: bool = False) -> None:
    """Raise HostileArchive unless the archive is safe to hand to torch's loader.

    native_code: the archive is a compiled artifact (AOTInductor package), allowed to carry
    `data/aotinductor/`; a graph never is."""
    path = Path(path)
    if path.stat().st_size == 0:
        raise HostileArchive(f"{label} is an empty file; export and save the program again")
    try:
        with zipfile.ZipFile(path) as zf:
            layout = _structure(zf, label, limits)
            _read_all(zf, layout, label, limits)
            _check_members(zf, layout, label, native_code)
            _check_versions(zf, layout, label)
    except zipfile.BadZipFile as e:
        raise HostileArchive(f"{label} is a truncated or corrupt .pt2 archive ({e}); export and save it again") from e


def _structure(zf: zipfile.ZipFile, label: str, limits: ArchiveLimits) -> _Layout:
    infos = zf.infolist()
    if not infos:
        raise HostileArchive(f"{label} is an empty archive")
    if len(infos) > limits.max_entries:
        raise HostileArchive(f"{label} has {len(infos)} entries, over the limit of {limits.max_entries}")
    seen: set[str] = set()
    roots: set[str] = set()
    declared = 0
    for info in infos:
        name = info.filename
        parts = PurePosixPath(name).parts
        if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name) or "\\" in name or "\x00" in name:
            raise HostileArchive(f"{label}: member {name!r} has an absolute or non-POSIX path; refused")
        if ".." in parts or "." in name.split("/"):
            raise HostileArchive(f"{label}: member {name!r} escapes the archive with '..'; refused")
        if stat.S_ISLNK(info.external_attr >> 16):
            raise HostileArchive(f"{label}: member {name!r} is a symbolic link; refused")
        if name in seen:
            raise HostileArchive(f"{label}: member {name!r} appears twice; refused")
        seen.add(name)
        declared += info.file_size
        if declared > limits.max_bytes:
            raise HostileArchive(f"{label}: members declare more than {limits.max_bytes} bytes in all (at {name!r}); "
                                 f"refused as a possible zip bomb")
        if (info.compress_type != zipfile.ZIP_STORED and info.file_size > 1 << 20
                and info.file_size > limits.max_ratio * max(info.compress_size, 1)):
            raise HostileArchive(f"{label}: member {name!r} expands {info.file_size // max(info.compress_size, 1)}x "
                                 f"(over {limits.max_ratio}x); refused as a possible zip bomb")
        if not name.endswith("/"):
            roots.add(parts[0] if len(parts) > 1 else "")
    if len(roots) != 1 or "" in roots:
        raise HostileArchive(f"{label}: a .pt2 keeps every member under one top-level folder, found {sorted(roots)[:5]}")
    root = roots.pop() + "/"
    return _Layout(root, {i.filename[len(root):]: i for i in infos if not i.filename.endswith("/")})


def _read_all(zf: zipfile.ZipFile, layout: _Layout, label: str, limits: ArchiveLimits) -> None:
    """Decompress every member in chunks: sizes that lie, and bad CRCs, are caught before any parse."""
    total = 0
    for name, info in layout.names.items():
        got = 0
        with zf.open(info) as f:
            while chunk := f.read(1 << 20):
                got += len(chunk)
                total += len(chunk)
                if got > info.file_size or total > limits.max_bytes:
                    raise HostileArchive(f"{label}: member {name!r} decompresses to more than it declares "
                                         f"({info.file_size} bytes) or the archive exceeds {limits.max_bytes} bytes; "
                                         f"refused as a possible zip bomb")


def _text(zf: zipfile.ZipFile, layout: _Layout, name: str) -> str | None:
    info = layout.names.get(name)
    return None if info is None else zf.read(info).decode("utf-8", errors="replace").strip()


def _check_versions(zf: zipfile.ZipFile, layout: _Layout, label: str) -> None:
    from torch._export.serde.schema import SCHEMA_VERSION
    from torch.export.pt2_archive.constants import ARCHIVE_VERSION_VALUE

    if "archive_version" not in layout.names:
        legacy = "serialized_exported_program.json" in layout.names
        raise HostileArchive(f"{label} is a {'torch 2.7-format' if legacy else 'non-pt2'} archive (no archive_version); "
                             f"re-export the program and save it with torch.export.save from this torch")
    version = _text(zf, layout, "archive_version")
    if version != ARCHIVE_VERSION_VALUE:
        raise HostileArchive(f"{label}: member 'archive_version' says {version!r}, but this torch reads archive version "
                             f"{ARCHIVE_VERSION_VALUE}; save it with a torch that matches the farm's")
    for name in [n for n in layout.names if n.startswith("models/") and n.endswith(".json")]:
        doc = _json(zf, layout, name, label)
        _check_program_json(doc, name, label, SCHEMA_VERSION)


def _json(zf: zipfile.ZipFile, layout: _Layout, name: str, label: str) -> Any:
    info = layout.names[name]
    if info.file_size > MAX_JSON_BYTES:
        raise HostileArchive(f"{label}: member {name!r} is {info.file_size} bytes of JSON, over {MAX_JSON_BYTES}")
    try:
        return json.loads(zf.read(info))
    except (ValueError, UnicodeDecodeError) as e:
        raise HostileArchive(f"{label}: member {name!r} is not valid JSON ({e})") from e


def _check_program_json(doc: Any, name: str, label: str, schema_version: tuple[int, int]) -> None:
    from torch._export.serde import schema
    from torch._export.serde.serialize import _dict_to_dataclass

    where = f"{label}: member {name!r}"
    if not isinstance(doc, dict) or not isinstance(doc.get("graph_module"), dict):
        raise HostileArchive(f"{where} is not an exported program (no `graph_module` object); save it with torch.export.save")
    version = doc.get("schema_version")
    if not (isinstance(version, dict) and isinstance(version.get("major"), int) and isinstance(version.get("minor"), int)):
        raise HostileArchive(f"{where} has no valid `schema_version`")
    if (version["major"], version["minor"]) > tuple(schema_version) or version["major"] != schema_version[0]:
        raise HostileArchive(f"{where} uses export schema {version['major']}.{version['minor']}, which this torch "
                             f"(schema {schema_version[0]}.{schema_version[1]}) cannot read; export it with the farm's torch")
    for expr in _values_of(doc, "expr_str"):
        problem = _expr_problem(expr)
        if problem:
            raise HostileArchive(f"{where}: symbolic expression {str(expr)[:80]!r} is refused: {problem}")
    try:
        _dict_to_dataclass(schema.ExportedProgram, doc)
    except Exception as e:  # torch raises any of AssertionError, TypeError, KeyError... for a wrong shape
        raise HostileArchive(f"{where} does not match torch's export schema: {type(e).__name__}: {e}") from e


def _values_of(doc: Any, key: str) -> Iterator[Any]:
    stack = [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                if k == key:
                    yield v
                else:
                    stack.append(v)
        elif isinstance(node, list):
            stack.extend(node)


_EXPR_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.Call, ast.Name, ast.Load,
               ast.Constant, ast.keyword, ast.operator, ast.unaryop, ast.boolop, ast.cmpop)


SYMPY_CORE = ("Symbol", "Integer", "Rational", "Float", "Add", "Mul", "Pow", "Mod", "Max", "Min", "Abs", "Eq", "Ne",
              "Lt", "Le", "Gt", "Ge", "StrictLessThan", "StrictGreaterThan", "LessThan", "GreaterThan", "Equality",
              "Unequality", "And", "Or", "Not", "floor", "ceiling", "sqrt", "Piecewise", "ITE")


@functools.cache
def _sympy_callables() -> frozenset[str]:
    """sympy's arithmetic classes and torch's symbolic-shape functions (FloorDiv, ModularIndexing, ...)."""
    import sympy
    from torch.utils._sympy import functions

    defined = {n for n, v in vars(functions).items() if isinstance(v, type) and issubclass(v, sympy.Basic)}
    return frozenset(defined | set(SYMPY_CORE))


def _expr_problem(expr: Any) -> str | None:
    """sympy.sympify evaluates its string as Python; only arithmetic over symbols may pass, as
    torch writes it: `Mul(Integer(32), Symbol('s27', positive=True, integer=True))`."""
    if not isinstance(expr, str) or not expr.strip():
        return "not a non-empty string"
    if len(expr) > MAX_EXPR_CHARS:
        return f"longer than {MAX_EXPR_CHARS} characters"
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        return "not an arithmetic expression"
    for node in ast.walk(tree):
        if not isinstance(node, _EXPR_NODES):
            return f"contains {type(node).__name__}, which is not arithmetic"
        if isinstance(node, ast.Name) and not SYMBOL_FUNCTIONS.fullmatch(node.id):
            return f"name {node.id!r} is not a symbol"
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in _sympy_callables()):
            return "only sympy and torch symbolic-shape functions may be called"
        if isinstance(node, ast.keyword) and not (SYMBOL_FUNCTIONS.fullmatch(node.arg or "")
                                                  and isinstance(node.value, ast.Constant)):
            return "keyword arguments must be name=constant"
        if isinstance(node, ast.Constant) and not (isinstance(node.value, (int, float, bool))
                                                   or (isinstance(node.value, str) and SYMBOL_FUNCTIONS.fullmatch(node.value))):
            return f"constant {node.value!r} is neither a number nor a symbol name"
    return None


def _raw_payloads(zf: zipfile.ZipFile, layout: _Layout, label: str) -> tuple[set[str], list[str]]:
    """Members the configs list as raw tensor bytes (never unpickled), and refusals found there."""
    raw: set[str] = set()
    refused: list[str] = []
    for name in [n for n in layout.names if CONFIG.fullmatch(n)]:
        doc = _json(zf, layout, name, label)
        config = doc.get("config") if isinstance(doc, dict) else None
        if not isinstance(config, dict):
            raise HostileArchive(f"{label}: member {name!r} has no `config` mapping")
        folder = name.rsplit("/", 1)[0] + "/"
        for fqn, meta in config.items():
            path_name = meta.get("path_name") if isinstance(meta, dict) else None
            if not isinstance(path_name, str) or "/" in path_name or path_name in ("", ".", ".."):
                raise HostileArchive(f"{label}: member {name!r}: entry {fqn!r} has a bad path_name {path_name!r}")
            if path_name.startswith(("opaque_obj_", "custom_obj_")):
                refused.append(f"member {folder + path_name!r} (constant {fqn!r}) is a pickled Python or TorchScript "
                               f"object, which the farm never loads; export without opaque or script-object constants")
            elif not meta.get("use_pickle"):
                raw.add(folder + path_name)
    return raw, refused


def _check_members(zf: zipfile.ZipFile, layout: _Layout, label: str, native_code: bool) -> None:
    import torch

    raw, refused = _raw_payloads(zf, layout, label)
    if refused:
        raise HostileArchive(f"{label}: {refused[0]}")
    for name, info in layout.names.items():
        if name in PLAIN_FILES or name in raw or CONFIG.fullmatch(name) or name.startswith("extra/"):
            continue
        if name.startswith("models/") and name.endswith(".json"):
            continue
        if name.startswith("data/aotinductor/"):
            if native_code:
                continue
            raise HostileArchive(f"{label}: member {name!r} is compiled native code inside a graph archive; "
                                 f"the farm never loads code from a graph. Save the program without AOTInductor output")
        data = zf.read(info)
        if not data:
            continue  # torch reads an empty payload as nothing
        try:
            torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        except Exception as e:  # the weights-only unpickler raises UnpicklingError, RuntimeError, ... for anything unsafe
            raise HostileArchive(f"{label}: member {name!r} is not plain tensor data (torch's weights_only unpickler "
                                 f"refused it: {_unpickler_reason(e)}); the farm never unpickles code") from e


def _unpickler_reason(e: BaseException) -> str:
    """torch's message opens with advice about weights_only=False (never take it); keep the reason."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    reason = next((ln for ln in lines if "GLOBAL" in ln or "WeightsUnpickler error" in ln or "Unsupported" in ln), None)
    return (reason or (lines[0] if lines else type(e).__name__))[:300]
