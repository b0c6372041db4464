"""The environment a sandbox child gets: an allow-list of this process's variables, no secrets
(nothing AWS, Ray or farm-signing), an empty HOME of its own, and Inductor's cache where the
worker's is. Its own module because the GPU check (workers/backends/cuda.py) starts children
too, and the sandbox asks that check about its GPU."""
from __future__ import annotations

import contextlib
import getpass
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from workers.sandbox import compiler_cache

PROJECT = Path(__file__).resolve().parents[2]
HOST_RECORDS = "farm-host-checks"  # in shared_cache_dir(): what workers and children learnt of the node
HEADERS = "precompiled_headers"  # beside them: Inductor's (steps.headers_in_the_nodes_dir)
COMPILER_CACHE = "compiler-cache"  # in node_dir(): ccache's (workers/sandbox/compiler_cache.py)

# Passed to the child; everything else in the environment is dropped.
ENV_ALLOWED = re.compile(r"(PATH|LANG|LANGUAGE|TZ|TERM|USER|LOGNAME|PYTHONPATH|PYTHONHASHSEED|VIRTUAL_ENV|LD_LIBRARY_PATH|"
                         r"CC|CXX|CUDA_HOME|CUDA_PATH|CUDA_VISIBLE_DEVICES|OMP_NUM_THREADS|MKL_NUM_THREADS|"
                         r"LC_\w+|KMP_\w+|TORCH_\w+|TORCHINDUCTOR_\w+|TRITON_\w+|NVIDIA_\w+)")
ENV_SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|_KEY|AWS|RAY_", re.IGNORECASE)


def child_env(home: Path) -> dict[str, str]:
    """What of this process's environment a child gets (no secrets, nothing Ray or AWS), and its own HOME."""
    env = {k: v for k, v in os.environ.items() if ENV_ALLOWED.fullmatch(k) and not ENV_SECRET.search(k)}
    env.update(HOME=str(home), PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1")
    # Inductor's caches (and its precompiled header) stay where the worker's are, so a warm
    # host stays warm; HOME is empty so no ~/.aws, ~/.ray or other config is in reach.
    if "TORCHINDUCTOR_CACHE_DIR" not in env:
        env["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir()
    env["FARM_SHARED_CACHE"] = shared_cache_dir()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT), env.get("PYTHONPATH")) if p)  # a plain checkout too
    env.update(compiler_cache.children_env(node_dir() / COMPILER_CACHE, env.get("PATH", "")))
    return env


def inductor_cache_dir() -> str:
    """Inductor's cache directory: TORCHINDUCTOR_CACHE_DIR, or Inductor's default, which this
    process then sets so that its children agree. Inductor's own module for this
    (torch/_inductor/runtime/cache_dir_utils.py) imports torch, over a second of CPU in every
    worker, which otherwise imports no torch (its sandbox child has it); so outside the sandbox
    this reads Inductor's rule: the temp dir's `torchinductor_<user>`."""
    loaded = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    if loaded is not None:
        return loaded.cache_dir()
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_inductor_dir()
    chosen = os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(chosen)
    os.makedirs(chosen, exist_ok=True)
    return chosen


def default_inductor_dir() -> str:
    """Inductor's default cache dir, the temp dir's `torchinductor_<user>`, which is also where it
    keeps its precompiled headers whatever TORCHINDUCTOR_CACHE_DIR says (codecache._HEADER_DIR)."""
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def shared_cache_dir() -> str:
    """The dir where what the farm learns of this node is kept (workers/backends/inductor_host.py,
    workers/host_check.py: records of Inductor's ISA probes and of host checks), which the worker
    and its sandbox children can all write, whether the children are jailed as another uid or
    not: the node's (`node_dir`), whatever Inductor cache dir a worker uses, so that a fresh cache
    dir does not build the probes again (about 8 CPU-s of g++ here), as it does not build the
    precompiled headers again."""
    given = os.environ.get("FARM_SHARED_CACHE")  # a child: where its worker said
    return given or str(node_dir())


def node_dir() -> Path:
    """What Inductor and the farm keep once per node, whatever the cache dir: Inductor's default
    cache dir (where an unjailed Inductor keeps its precompiled headers, codecache._HEADER_DIR),
    its part that jailed children may write; or FARM_NODE_CACHE, which a bench sets to a fresh
    dir per side so that each side builds its own, as on a fresh node."""
    return childrens(Path(os.environ.get("FARM_NODE_CACHE") or default_inductor_dir()))


def header_dir() -> Path:
    """Where a jailed child's Inductor keeps its precompiled headers: the node's (`node_dir`)."""
    return node_dir() / HEADERS


def childrens(cache: Path) -> Path:
    """The part of a cache dir that jailed children may write: all of it when they keep this
    process's uid; when they are jailed as another uid (this process is root), a dir of that
    uid's inside it, so that a bench's or an operator's fresh cache dir still means a fresh cache."""
    from workers.sandbox import jail

    if jail.child_uid() == os.getuid():
        return cache
    path = cache / f"jail-{jail.child_uid()}"
    path.mkdir(parents=True, exist_ok=True)
    jail.make_writable(path)
    return path


@contextlib.contextmanager
def environ_set(name: str, value: str) -> Iterator[None]:
    """This process's environment variable `name` set to `value` inside, as it was after."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@contextlib.contextmanager
def as_childrens_cache(jailed: bool) -> Iterator[None]:
    """Inductor's cache dir, in this process, set to the one the sandbox's children use, for what
    the worker writes there for them (the farm's autotune timings, in Inductor's local timing
    file); what it wrote, a jailed child of another uid may rewrite."""
    path = str(childrens(Path(inductor_cache_dir()))) if jailed else inductor_cache_dir()
    try:
        with environ_set("TORCHINDUCTOR_CACHE_DIR", path):
            yield
    finally:
        if jailed:
            from workers.sandbox import jail

            timings = Path(path) / "cache"  # Inductor's local timing files (CacheBase.get_local_cache_path)
            for made in [timings, *timings.rglob("*")] if timings.is_dir() else []:
                jail.make_writable(made)


def jailed_env(env: dict[str, str]) -> tuple[dict[str, str], list[tuple[Path, Path]]]:
    """`env` for a jailed child, and what it may write besides its sandbox's dir, as (host dir,
    path inside): its own part of the Inductor (and Triton) cache (`childrens`)."""
    from workers.sandbox import jail

    env, binds = dict(env), []
    other_uid = jail.child_uid() != os.getuid()
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        if name in env:
            path = childrens(Path(env[name]))
            env[name] = str(path)
            binds.append((path, path))
    # Inductor uses its default cache dir, <tmp>/torchinductor_<user>, whatever TORCHINDUCTOR_CACHE_DIR
    # says. In the jail's own /tmp that dir is the jail's cache (clearing /tmp between units leaves
    # it), and in it two dirs are the node's (node_dir), as they are for an unjailed process: one
    # build per toolchain and ISA for every worker and cache dir of the node, not one per cache dir.
    # Its precompiled_headers (about 5 CPU-s of g++ each, two per ISA), named by a hash of the
    # preprocessed headers and the command line and built under Inductor's file lock there; and the
    # farm's records of its host checks (shared_cache_dir: Inductor's ISA probes, about 8 CPU-s), on
    # a file lock each. A child could already write the cache dir itself.
    user = "nobody" if other_uid else getpass.getuser()
    env["USER"] = env["LOGNAME"] = user
    inside = Path("/tmp") / f"torchinductor_{user}"
    binds.append((Path(env["TORCHINDUCTOR_CACHE_DIR"]), inside))
    node = node_dir()  # (made writable for the children once, not per dir bound from it)
    for name in (HEADERS, HOST_RECORDS):
        for made in (node / name, Path(env["TORCHINDUCTOR_CACHE_DIR"]) / name):  # the mount point too
            made.mkdir(parents=True, exist_ok=True)
            jail.make_writable(made)
        binds.append((node / name, inside / name))
    env["FARM_SHARED_CACHE"] = str(inside)
    if "CCACHE_DIR" in env:  # the node's compiler cache (compiler_cache.children_env), at its own path
        cache = Path(env["CCACHE_DIR"])
        cache.mkdir(parents=True, exist_ok=True)  # (a bind's source must exist; unjailed, ccache makes it)
        jail.make_writable(cache)
        binds.append((cache, cache))
    return env, binds
