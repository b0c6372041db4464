"""Inductor's compiled CPU kernels, shipped with training bundles and precompiled functions so a
fresh machine compiles nothing.

A torch.compile cache bundle (Mega-Cache) carries kernel *source*: loading it in a process with
an empty Inductor cache dir runs g++ again for every kernel (11.8 s of a 21.7 s cold start,
measured on the smoke MLP). Inductor looks for a kernel's binary at a path named by the hash of
its source and its build command, under its cache dir, before it compiles; so the farm records
which binaries the lowering loaded, ships them, and the consumer puts them at the same relative
paths. That works only where the consumer's build command is the producer's (compiler, flags,
include paths): `build_command` is recorded, and a consumer on another one is refused instead
of compiling every kernel without a word.

The artifact is a tar (not a zip: zips are checked as .pt2 archives): the compiled program's
parts (`bundle.bin` for a cache bundle, `fn-0.bin`, `fn-1.bin`, … for precompiled functions),
`facts.json`, and `kernels/<path under the cache dir>`.
"""
from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import re
import tarfile
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from workers.backends.base import LoweringError

MAX_MEMBERS = 4096
MAX_BYTES = 4 << 30  # an artifact's members, all together
PART = re.compile(r"bundle\.bin|fn-\d{1,3}\.bin")  # the compiled program's parts
_installed: set[Path] = set()  # kernels this process put in place (counting_builds leaves them out)


@contextlib.contextmanager
def capturing() -> Iterator[list[str]]:
    """The paths of the kernel binaries Inductor loads in the block. In-process caches are
    cleared first: a long-lived worker that loaded a kernel for an earlier unit would otherwise
    reuse it without loading it again, and this unit's bundle would miss it."""
    from torch._inductor.codecache import CppCodeCache
    from torch._inductor.utils import clear_caches

    clear_caches()
    loaded: list[str] = []
    original = CppCodeCache._load_library.__func__  # type: ignore[attr-defined]

    def recording(cls: Any, path: str, key: str) -> Any:
        loaded.append(path)
        return original(cls, path, key)

    CppCodeCache._load_library = classmethod(recording)  # type: ignore[method-assign]
    try:
        yield loaded
    finally:
        CppCodeCache._load_library = classmethod(original)  # type: ignore[method-assign]


def isa_probe(vec_isa: str) -> list[str]:
    """The binary Inductor built to check that this host runs `vec_isa` (with it in place, a
    fresh machine's check only loads it, instead of running g++ for 1.3 s first), if built."""
    path = isa_probe_path(vec_isa)
    return [path] if path is not None and os.path.isfile(path) else []


def isa_probe_path(vec_isa: str) -> str | None:
    """Where Inductor puts its probe for `vec_isa`, built or not (naming it builds nothing). The
    path comes from Inductor's private naming: on a torch that names it otherwise, None, and
    the consumer builds the probe itself."""
    from torch._inductor import cpu_vec_isa
    from torch._inductor.codecache import write
    from torch._inductor.cpp_builder import CppBuilder, CppTorchOptions

    try:
        (isa,) = [i for i in cpu_vec_isa.supported_vec_isa_list if str(i) == vec_isa]
        key, source = write(cpu_vec_isa.VecISA._avx_code, "cpp",
                            extra=cpu_vec_isa._get_isa_dry_compile_fingerprint(isa.build_arch_flags()))
        return CppBuilder(key, [source], CppTorchOptions(vec_isa=isa, warning_all=False),
                          os.path.dirname(source)).get_target_file_path()
    except (AttributeError, ValueError, TypeError):
        return None


def build_command() -> list[str]:
    """The command Inductor builds a vectorized CPU kernel with in this process, as it hashes
    it into the kernel's path (call it with the target's ISA pinned)."""
    from torch._inductor.codecache import CppCodeCache
    from torch._inductor.cpp_builder import CppBuilder, CppTorchDeviceOptions
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    options = CppTorchDeviceOptions(compile_only=True, min_optimize=False, device_type="cpu", vec_isa=pick_vec_isa(),
                                    extra_flags=(), use_relative_path=False, **CppCodeCache.cpp_compile_command_flags)
    return CppBuilder(name="o", sources="i", BuildOption=options).get_command_line().split()


def build_problem(recorded: list[str]) -> str | None:
    """Why this process would not find the shipped kernels (its build command differs), or None."""
    ours = build_command()
    if ours == recorded:
        return None
    only_theirs = [t for t in recorded if t not in ours][:6]
    only_ours = [t for t in ours if t not in recorded][:6]
    differ = only_theirs + only_ours  # none: the same flags in another order
    if differ and all(t.startswith("-m") for t in differ):  # -mavx512bf16: what Inductor found of the CPU
        what = ("Inductor found other features in this CPU than in the one they were built on; pin an ISA where "
                "they are built and here, or compile on a worker with this CPU")
    else:
        what = "use the same compiler and torch install path as the farm's workers, or compile on a worker like this machine"
    return ("this process builds Inductor's CPU kernels with another command than the farm worker did, so it would "
            f"compile every kernel again (the farm's has {only_theirs or 'nothing more'}, this one has "
            f"{only_ours or 'nothing more'}); {what}")


def relative(path: str) -> str | None:
    """A binary's name under Inductor's cache dir (where the consumer puts it), or None outside it."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    p, root = Path(path).resolve(), Path(cache_dir()).resolve()
    return p.relative_to(root).as_posix() if p.is_relative_to(root) and p.is_file() else None


def pack(out: Path, parts: dict[str, bytes], kernels: list[str], facts: dict[str, Any]) -> int:
    """Write the artifact; returns how many kernels it holds. Kernels outside Inductor's cache
    dir (none expected) are left out."""
    names = {name: Path(k) for k in kernels if (name := relative(k))}
    with tarfile.open(out, "w") as tar:
        for name, data in (*parts.items(), ("facts.json", json.dumps(facts, sort_keys=True).encode())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, p in sorted(names.items()):
            tar.add(p, arcname=f"kernels/{name}", recursive=False)
    return len(names)


@dataclass
class Unpacked:
    parts: dict[str, bytes]  # the compiled program's parts, by name (PART)
    facts: dict[str, Any]
    kernels: dict[str, bytes]  # path under Inductor's cache dir → the binary


def _member_problem(m: tarfile.TarInfo) -> str | None:
    if m.name == "facts.json" or PART.fullmatch(m.name):
        return None if m.isfile() else "is not a plain file"
    parts = Path(m.name).parts
    if parts[0] != "kernels" or len(parts) < 2 or ".." in parts or m.name.startswith("/"):
        return "is not a kernel under kernels/"
    if not m.isfile() or not m.name.endswith(".so"):
        return "is not a plain .so file"
    return None


def unpack(artifact: Path, label: str) -> Unpacked:
    """Read an artifact from the store (hostile input): plain files only, named as `pack` names
    them, within size limits. Nothing is written to disk here."""
    try:
        with tarfile.open(artifact, "r:") as tar:
            members = tar.getmembers()
            if len(members) > MAX_MEMBERS or sum(m.size for m in members) > MAX_BYTES:
                raise LoweringError(f"{label}: {len(members)} members, {sum(m.size for m in members)} bytes: over "
                                    f"the limits of a training bundle ({MAX_MEMBERS} members, {MAX_BYTES} bytes)")
            files: dict[str, bytes] = {}
            for m in members:
                problem = _member_problem(m)
                if problem:
                    raise LoweringError(f"{label}: member {m.name!r} {problem}; the artifact is damaged or not the farm's")
                files[m.name] = tar.extractfile(m).read()  # type: ignore[union-attr]
    except tarfile.TarError as e:
        raise LoweringError(f"{label} is not a training bundle the farm wrote ({e})") from e
    parts = {name: files.pop(name) for name in list(files) if PART.fullmatch(name)}
    if not parts or "facts.json" not in files:
        raise LoweringError(f"{label} lacks its compiled program or facts.json; the artifact is damaged or not the farm's")
    try:
        facts = json.loads(files.pop("facts.json"))
    except ValueError as e:
        raise LoweringError(f"{label}: facts.json is not JSON ({e})") from e
    if not isinstance(facts, dict):
        raise LoweringError(f"{label}: facts.json is not a JSON object")
    return Unpacked(parts, facts, {k.removeprefix("kernels/"): v for k, v in files.items()})


def install(kernels: dict[str, bytes]) -> int:
    """Put the kernels where Inductor looks for them; returns how many were not there yet. Each
    one is written beside its place and renamed into it, so a process compiling at the same
    moment never loads half a file."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    root = Path(cache_dir())
    added = 0
    for name, data in kernels.items():
        dest = root / name
        if dest.exists():
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".farm-", suffix=".so")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dest)
        _installed.add(dest)
        added += 1
    return added


class _HeaderSkip:
    """Inductor names and builds its precompiled header (a 155 MB `.gch` under /tmp: a g++
    preprocessing run every process, about 4 CPU-s of g++ where it is not built yet) before it
    looks for a kernel's binary, so a process whose every kernel is shipped still ran g++: a
    `use_farm_cache` hit on a fresh machine took 6.7 s against 2.4 s with the header in place.

    While held, a kernel whose binary is already there gets a plain header instead (a file that
    includes Inductor's, with no `.gch`): nothing is preprocessed or built for it, and its key is
    unchanged (Inductor hashes the build command before it adds the header). A kernel to build
    gets Inductor's precompiled header as before. Which kernel is asked for comes from Inductor's
    `write` of its source, just before, in the same thread; should its binary go before it is
    loaded, it builds with the plain header, which g++ reads whole: slower, not wrong. (So would
    a header asked for outside a kernel's load, as AOTInductor asks, right after a kernel that
    was there: nothing held here compiles with AOTInductor.)"""

    def __init__(self) -> None:
        self.state = threading.Lock()
        self.depth = 0
        self.originals: dict[str, Any] = {}
        self.asked = threading.local()  # .binary: the binary of the kernel Inductor last wrote in this thread
        self.plain: dict[str, str] = {}  # Inductor's header → a plain one that includes it

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        from torch._inductor import codecache

        with self.state:
            if self.depth == 0:
                self.originals = {"write": codecache.write, "_precompile_header": codecache._precompile_header}
                codecache.write, codecache._precompile_header = self.write, self.precompile_header
            self.depth += 1
        try:
            yield
        finally:
            with self.state:
                self.depth -= 1
                if self.depth == 0:
                    for name, original in self.originals.items():
                        setattr(codecache, name, original)

    def write(self, content: Any, extension: str, *args: Any, **kwargs: Any) -> Any:
        key, path = self.originals["write"](content, extension, *args, **kwargs)
        if extension == "main.cpp":  # CppCodeCache.load_async: the kernel's binary is <path>.so
            self.asked.binary = str(Path(path).with_suffix(".so"))
        return key, path

    def precompile_header(self, header: str, *args: Any, **kwargs: Any) -> str:
        binary = getattr(self.asked, "binary", None)
        if binary is None or not os.path.exists(binary):
            return self.originals["_precompile_header"](header, *args, **kwargs)
        with self.state:
            if header not in self.plain:
                fd, path = tempfile.mkstemp(prefix="farm-plain-", suffix=".h")
                with os.fdopen(fd, "w") as f:
                    f.write(f"#include <{header}>\n")
                self.plain[header] = path
                atexit.register(Path(path).unlink, missing_ok=True)
            return self.plain[header]


_header_skip = _HeaderSkip()


def skipping_unneeded_headers() -> contextlib.AbstractContextManager[None]:
    """Within it (nested or from several threads alike), Inductor's precompiled header is named
    and built only for kernels it builds: a process whose kernels are all shipped builds nothing.
    See _HeaderSkip."""
    return _header_skip.held()


def _is_probe(cache: Path, path: Path) -> bool:
    """One of Inductor's ISA probes, by its path under the cache dir (not a kernel's .main.so)."""
    from storage.remote_cache import PROBE_PATH

    return PROBE_PATH.fullmatch(path.relative_to(cache).as_posix()) is not None


def probes_in(cache: Path) -> dict[str, Path]:
    """Inductor's ISA probes in its cache dir, by their path under it."""
    return {p.relative_to(cache).as_posix(): p for p in cache.glob("*/*.so") if _is_probe(cache, p)}


def _built(cache: Path) -> set[Path]:
    from torch._inductor import codecache

    return ({p for p in cache.glob("*/*.so") if p not in _installed and not _is_probe(cache, p)}
            | set(Path(codecache._HEADER_DIR).glob("*.gch")))


@contextlib.contextmanager
def counting_builds() -> Iterator[list[str]]:
    """The kernel binaries and precompiled headers Inductor builds in the block, filled in when it
    ends. Counted on disk: Inductor may build in a pool of subprocesses, out of reach of anything
    patched here. Kernels `install` put in place are not builds, nor are Inductor's ISA probes
    (use_farm_cache works out the ISAs as Inductor first asks, within a compile)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    root = Path(cache_dir())
    before = _built(root)
    built: list[str] = []
    try:
        yield built
    finally:
        built.extend(sorted(str(p) for p in _built(root) - before))
