"""What Inductor can build on this host, asked of Inductor once per host and kept on disk.

Inductor finds the vector ISAs a host can use by building and loading a probe program per ISA,
and whether it can pin an ISA at all is a property of its config. Asking either means importing
Inductor, and with it Dynamo (over two seconds of CPU with torch's own import), in a process
that otherwise never needs torch: a pool's worker, which names keys, places work, fingerprints
its CPU for benchmarks and checks the host, while torch lives in its sandbox child. So the
answer is kept in the node's dir (workers/sandbox/env.py shared_cache_dir: whatever Inductor cache
dir a worker uses, as Inductor's precompiled headers are), keyed by the CPU
(model and feature flags), the compiler, torch and Python: the host's first process to ask
computes it under a file lock, and every later one reads it.

The file is only a cache of what Inductor would answer: one that does not parse, or was asked
about another CPU, compiler or torch, is asked again.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any, Callable

from filelock import FileLock

from workers.backends import cxx
from workers.sandbox.env import HOST_RECORDS, shared_cache_dir
from workers.sandbox.jail import make_writable
from workers.torch_files import standalone


@functools.cache
def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


@functools.cache
def cpu_identity() -> dict[str, str]:
    """The CPU as far as what it can run goes: its model and its feature flags (hashed)."""
    return {"model": cpu_model(), "flags": hashlib.sha256(_cpuinfo("flags").encode()).hexdigest()[:16]}


def _cpuinfo(field: str) -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.split(":", 1)[0].strip() == field), "")
    except OSError:
        return ""


def _asked() -> dict[str, Any]:
    return {"cpu": cpu_identity(), "compiler": cxx.compiler(), "torch": standalone("version.py").__version__,
            "python": sys.executable}


@functools.cache
def inductor_host() -> dict[str, Any]:
    """{"vec_isas": [...], "can_pin": bool, ...} for this host, from the record or from Inductor."""
    return kept_on_host(shared_cache_dir(), "inductor-host-", _asked(), _ask_inductor, _valid)


def inductor_host_known() -> dict[str, Any] | None:
    """The record, if this host has one; None instead of asking Inductor (which probes every ISA)."""
    return kept_on_host(shared_cache_dir(), "inductor-host-", _asked(), None, _valid)


def kept_on_host(where: str, kind: str, asked: dict[str, Any], compute: Callable[[], dict[str, Any]] | None,
                 keep: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
    """compute()'s answer to `asked`, kept in `where` for every process of this host
    that asks the same: the first computes it under a file lock, the others read it. A record that
    does not parse, answers something else or that `keep` refuses is computed again, and an answer
    `keep` refuses is not written (workers/host_check.py keeps only a "yes"). Without `compute`,
    a record missing is None."""
    asked = json.loads(json.dumps(asked, default=str))  # as it reads back
    digest = hashlib.sha256(json.dumps(asked, sort_keys=True).encode()).hexdigest()[:32]
    path = Path(where) / HOST_RECORDS / f"{kind}{digest}.json"
    lock = path.with_name(f"{path.name}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    for made in (lock.parent, lock):
        make_writable(made)  # a jailed child (another uid) asks and writes here too
    with FileLock(lock, timeout=600):
        try:
            record = json.loads(path.read_text())
            if isinstance(record, dict) and all(record.get(k) == v for k, v in asked.items()) and keep(record):
                return record
        except (OSError, ValueError):
            pass  # not asked yet on this host, or a torn file: ask
        if compute is None:
            return None
        record = {**compute(), **asked}
        if keep(record):
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps(record))
            os.replace(partial, path)
        return record


def can_pin() -> bool:
    from torch._inductor import config

    return hasattr(config.cpp, "march")  # `cpp.march` is newer than torch 2.11


# What Inductor's check finds out about an ISA beyond its name. It keeps each on its ISA object
# (one per process) and adds it to that ISA's build flags (`-mavx512bf16`, `-mamx-fp16`) and so to
# every kernel's path: a process that takes the ISAs from the record must set them as the check
# would have, or its kernels miss those built by the host's first process (which ran the check).
ISA_EXTRAS = ("_is_avx512_bf16_supported", "_is_amx_fp16_supported")


def isa_extras(isa: Any) -> dict[str, bool]:
    """What Inductor found out about `isa` (one of its ISA objects) beyond its name."""
    return {name: bool(getattr(isa, name)) for name in ISA_EXTRAS if hasattr(isa, name)}


def _ask_inductor() -> dict[str, Any]:
    from torch._inductor import cpu_vec_isa

    valid = cpu_vec_isa.valid_vec_isa_list()  # builds and loads a probe per ISA, and per extra
    return {"vec_isas": sorted(str(i) for i in valid), "vec_isa_extras": {str(i): isa_extras(i) for i in valid},
            "can_pin": can_pin()}


def _valid(record: dict[str, Any]) -> bool:
    extras = record.get("vec_isa_extras")
    return (isinstance(record.get("can_pin"), bool) and isinstance(record.get("vec_isas"), list)
            and all(isinstance(i, str) and len(i) < 100 for i in record["vec_isas"])
            and isinstance(extras, dict)  # a record from before extras were kept is asked again
            and all(isinstance(e, dict) and all(isinstance(v, bool) for v in e.values()) for e in extras.values()))
