"""A generator of hostile .pt2 archives, made from a real exported program at test time (no
attack is kept in the repo as a binary). Every code-running payload touches a canary path
outside the unit's temp dir, so a test can tell that nothing ran.

Each maker takes (good archive, destination, canary) and returns the member the farm must
name when it refuses the archive.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import zipfile
from pathlib import Path
from typing import Callable

import torch


class Payload:
    """Unpickling this runs a shell command: the attack of issue 9."""

    def __init__(self, canary: Path):
        self.canary = canary

    def __reduce__(self):
        return os.system, (f"touch {self.canary}",)


def evil_torch_save(canary: Path) -> bytes:
    buf = io.BytesIO()
    torch.save(Payload(canary), buf)
    return buf.getvalue()


def _members(good: Path) -> tuple[str, dict[str, bytes]]:
    with zipfile.ZipFile(good) as z:
        names = z.namelist()
        root = names[0].split("/")[0] + "/"
        return root, {n[len(root):]: z.read(n) for n in names}


def _write(dest: Path, root: str, members: dict[str, bytes], compress: int = zipfile.ZIP_STORED) -> None:
    with zipfile.ZipFile(dest, "w", compression=compress) as z:
        for name, data in members.items():
            z.writestr(root + name, data)


def _edit(good: Path, dest: Path, change: Callable[[dict[str, bytes]], str]) -> str:
    root, members = _members(good)
    member = change(members)
    _write(dest, root, members)
    return member


def _json(members: dict[str, bytes], name: str) -> dict:
    return json.loads(members[name])


def sample_inputs(good: Path, dest: Path, canary: Path) -> str:
    """The reported attack: deserialize_torch_artifact retries without weights_only."""
    def change(m):
        m["data/sample_inputs/model.pt"] = evil_torch_save(canary)
        return "data/sample_inputs/model.pt"
    return _edit(good, dest, change)


def pickled_weight(good: Path, dest: Path, canary: Path) -> str:
    """A weight marked use_pickle: torch.load(weights_only=False)."""
    def change(m):
        config = _json(m, "data/weights/model_weights_config.json")
        fqn = next(iter(config["config"]))
        entry = config["config"][fqn]
        entry["use_pickle"] = True
        m["data/weights/model_weights_config.json"] = json.dumps(config).encode()
        m["data/weights/" + entry["path_name"]] = evil_torch_save(canary)
        return "data/weights/" + entry["path_name"]
    return _edit(good, dest, change)


def _constant(path_name: str, data: Callable[[Path], bytes], use_pickle: bool = True):
    def make(good: Path, dest: Path, canary: Path) -> str:
        def change(m):
            config = _json(m, "data/constants/model_constants_config.json")
            config["config"]["evil"] = {"path_name": path_name, "is_param": False, "use_pickle": use_pickle,
                                        "tensor_meta": None}
            m["data/constants/model_constants_config.json"] = json.dumps(config).encode()
            m["data/constants/" + path_name] = data(canary)
            return "data/constants/" + path_name
        return _edit(good, dest, change)
    return make


pickled_constant = _constant("tensor_0", evil_torch_save)
opaque_constant = _constant("opaque_obj_0", lambda c: pickle.dumps(Payload(c)), use_pickle=False)
script_object_constant = _constant("custom_obj_0", evil_torch_save, use_pickle=False)


def _legacy_file(name: str):
    """The BC path: data/weights/<model>.pt or data/constants/<model>.pt, deserialized with fallback."""
    def make(good: Path, dest: Path, canary: Path) -> str:
        def change(m):
            m[name] = evil_torch_save(canary)
            return name
        return _edit(good, dest, change)
    return make


legacy_weights = _legacy_file("data/weights/model.pt")
legacy_constants = _legacy_file("data/constants/model.pt")


def torch27_format(good: Path, dest: Path, canary: Path) -> str:
    """torch.export.load's fallback for 2.7 archives, which unpickles serialized_*.pt."""
    root, members = _members(good)
    legacy = {"version": b"8.20", "serialized_exported_program.json": members["models/model.json"],
              "serialized_state_dict.pt": evil_torch_save(canary), "serialized_constants.pt": b"",
              "serialized_example_inputs.pt": b""}
    _write(dest, root, legacy)
    return "serialized_state_dict.pt"


def native_code(good: Path, dest: Path, canary: Path) -> str:
    """load_pt2 dlopens data/aotinductor/<model>/*.so found in any archive."""
    lib = dest.parent / "evil.so"
    build_library(lib, f'system("touch {canary}");')
    def change(m):
        m["data/aotinductor/model/model.so"] = lib.read_bytes()
        return "data/aotinductor/model/model.so"
    return _edit(good, dest, change)


def _edit_program(good: Path, dest: Path, change: Callable[[dict], None]) -> str:
    """Edit the JSON graph (models/model.json) of a good archive."""
    def edit(m):
        doc = json.loads(m["models/model.json"])
        change(doc)
        m["models/model.json"] = json.dumps(doc).encode()
        return "models/model.json"
    return _edit(good, dest, edit)


def symbolic_expression(good: Path, dest: Path, canary: Path) -> str:
    """sympy.sympify(expr_str) evaluates Python."""
    return _edit_program(good, dest, lambda doc: _replace_first(doc, "expr_str", f"__import__('os').system('touch {canary}')"))


def foreign_call(good: Path, dest: Path, canary: Path) -> str:
    """A node whose target torch's deserializer resolves by attribute lookup: torch.os.system."""
    return _edit_program(good, dest, lambda doc: doc["graph_module"]["graph"]["nodes"][0].update(target="torch.os.system"))


def _replace_first(doc, key: str, value) -> None:
    stack = [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if key in node:
                node[key] = value
                return
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    raise AssertionError(f"no {key} in the program")


def build_library(path: Path, body: str) -> Path:
    """A shared library whose constructor runs body (C) as soon as it is loaded."""
    src = path.with_suffix(".c")
    src.write_text("#include <stdlib.h>\n#include <signal.h>\n#include <unistd.h>\n"
                   f"__attribute__((constructor)) static void on_load(void) {{ {body} }}\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(path), str(src)], check=True)
    return path


def crashing_package(good_package: Path, dest: Path, body: str) -> Path:
    """An AOTInductor package whose model library runs body when loaded (abort, segfault, sleep)."""
    lib = build_library(dest.parent / f"{dest.stem}.so", body)
    root, members = _members(good_package)
    for name in [n for n in members if n.startswith("data/aotinductor/") and n.endswith(".so")]:
        members[name] = lib.read_bytes()
    _write(dest, root, members)
    return dest


# Structure: these run no code, they exhaust or escape.

def zip_bomb(good: Path, dest: Path, canary: Path) -> str:
    root, members = _members(good)
    members["extra/bomb"] = b"\0" * (64 << 20)  # 64 MiB of zeros deflate to ~64 KiB
    _write(dest, root, members, compress=zipfile.ZIP_DEFLATED)
    return "extra/bomb"


def lying_size(good: Path, dest: Path, canary: Path) -> str:
    """A member whose central directory declares fewer bytes than it holds."""
    root, members = _members(good)
    _write(dest, root, members)
    data = bytearray(dest.read_bytes())
    name = (root + "models/model.json").encode()
    pos = data.find(b"PK\x01\x02")  # central directory entries: the sizes zipfile trusts
    while pos != -1:
        n = int.from_bytes(data[pos + 28:pos + 30], "little")
        if bytes(data[pos + 46:pos + 46 + n]) == name:
            data[pos + 24:pos + 28] = (100).to_bytes(4, "little")  # uncompressed size
            break
        pos = data.find(b"PK\x01\x02", pos + 4)
    assert pos != -1
    dest.write_bytes(bytes(data))
    return "models/model.json"


def _raw_entry(name: str, data: bytes = b"x", mode: int | None = None):
    def make(good: Path, dest: Path, canary: Path) -> str:
        root, members = _members(good)
        _write(dest, root, members)
        with zipfile.ZipFile(dest, "a") as z:
            info = zipfile.ZipInfo(name if name.startswith("/") or name.startswith("..") else root + name)
            if mode is not None:
                info.external_attr = mode << 16
            z.writestr(info, data)
        return name
    return make


traversal = _raw_entry("../escape.txt")
absolute = _raw_entry("/tmp/absolute.txt")
symlink = _raw_entry("extra/link", b"/etc/passwd", mode=0o120777)


def duplicate(good: Path, dest: Path, canary: Path) -> str:
    root, members = _members(good)
    _write(dest, root, members)
    with zipfile.ZipFile(dest, "a") as z:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # zipfile warns about the duplicate: that is the point
            z.writestr(root + "models/model.json", members["models/model.json"])
    return "models/model.json"


def newer_archive_version(good: Path, dest: Path, canary: Path) -> str:
    def change(m):
        m["archive_version"] = b"99"
        return "archive_version"
    return _edit(good, dest, change)


def newer_schema(good: Path, dest: Path, canary: Path) -> str:
    return _edit_program(good, dest, lambda doc: doc.update(schema_version={"major": 99, "minor": 0}))


def wrong_schema(good: Path, dest: Path, canary: Path) -> str:
    return _edit_program(good, dest, lambda doc: doc["graph_module"]["graph"].update(nodes="not a list of nodes"))


def empty_file(good: Path, dest: Path, canary: Path) -> str:
    dest.write_bytes(b"")
    return "empty"


CODE = {"sample_inputs": sample_inputs, "pickled_weight": pickled_weight, "pickled_constant": pickled_constant,
        "opaque_constant": opaque_constant, "script_object_constant": script_object_constant,
        "legacy_weights": legacy_weights, "legacy_constants": legacy_constants, "torch27_format": torch27_format,
        "native_code": native_code, "symbolic_expression": symbolic_expression, "foreign_call": foreign_call}
STRUCTURE = {"zip_bomb": zip_bomb, "lying_size": lying_size, "traversal": traversal, "absolute": absolute,
             "symlink": symlink, "duplicate": duplicate, "newer_archive_version": newer_archive_version,
             "newer_schema": newer_schema, "wrong_schema": wrong_schema, "empty_file": empty_file}
