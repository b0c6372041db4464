"""The node's compiler cache: ccache in front of the g++ that sandbox children run, so that C++ the
node compiled once (for any job, under any key) is not compiled again.

AOTInductor on CPU spends most of a lowering in g++, and the same generated code comes back under
many keys: a graph whose weights changed (with `weights: shapes` the code is the same for every
checkpoint), a new farm `KEY_VERSION`, options that change the key but not the code, the same
model in two jobs' stores. Its compiles are then served from the cache: the wrapper, AOTInductor's
largest (about 5 CPU-s of cc1plus for a smoke-zoo model here), the weights' object, and the
kernels, whose source quotes the dir it was generated in, so in a jail every lowering generates
through one path (workers/backends/aoti_cpu.py, same_path_every_time). What g++ builds and links
in one call (Inductor's JIT kernels, its ISA probes) ccache cannot cache: those run as before.

How: a child's PATH starts with the distribution's ccache masquerade dir (Debian's `ccache`
package: /usr/lib/ccache/g++ -> ccache), so Inductor's `g++` is ccache, which runs the real g++
on a miss; keys and Inductor still see the real compiler's name and `--version`. ccache keys an
object by the preprocessed source (or, in its direct mode, the source and every header it read,
the precompiled header among them), the compiler's identity and the command line, so a hit is the
object g++ would have built. For its hits to reach across units it is told:
- `base_dir`: paths under the temp dir are hashed relative to the compile's dir (each unit has its
  own work dir, at the same depth);
- `hash_dir=false`: the compile's dir, which `-g1` would hash, is left out (only debug info's
  compilation dir differs, which nothing reads);
- sloppiness `pch_defines,time_macros`: without them ccache caches nothing that uses Inductor's
  precompiled header; its `.gch` is still hashed, and no torch header uses __DATE__ or __TIME__.
  `include_file_mtime,include_file_ctime`: headers written moments before a compile (the
  precompiled header's) still count by their content.

Trust: the cache sits beside the node's precompiled headers (workers/sandbox/env.py, node_dir), and
jailed children may write it, as they may write those headers and Inductor's cache dir; a child
that broke out of its steps could already poison what later units on the node build, so this adds
no new reach. Which unit was served from it is recorded (`stats_log`), so compile times stay honest.

FARM_COMPILER_CACHE=off turns it off; without a ccache masquerade dir it is off.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

MASQUERADE_DIRS = ("/usr/lib/ccache", "/usr/lib64/ccache", "/usr/local/lib/ccache")
SLOPPINESS = "pch_defines,time_macros,include_file_mtime,include_file_ctime"
OFF = {"0", "off", "false", "no"}
STATS_LOG = "compiler-cache.log"  # in a lowering's work dir: ccache's counters for each compile


def masquerade_dir() -> str | None:
    """The dir whose `g++` is ccache, or None when the cache is off or ccache is not installed."""
    if os.environ.get("FARM_COMPILER_CACHE", "").strip().lower() in OFF:
        return None
    return next((d for d in MASQUERADE_DIRS if os.access(os.path.join(d, "g++"), os.X_OK)), None)


def children_env(cache_dir: Path, path: str) -> dict[str, str]:
    """What a sandbox child's environment gets for the cache in `cache_dir` (ccache makes it),
    given its PATH; nothing when the cache is off."""
    masquerade = masquerade_dir()
    if masquerade is None:
        return {}
    return {"PATH": os.pathsep.join(p for p in (masquerade, path) if p), "CCACHE_DIR": str(cache_dir),
            "CCACHE_BASEDIR": os.path.commonpath([tempfile.gettempdir(), "/tmp"]),
            "CCACHE_NOHASHDIR": "1", "CCACHE_SLOPPINESS": SLOPPINESS}


def stats_log(workdir: Path) -> Path | None:
    """Where ccache is to count a lowering's compiles (its CCACHE_STATSLOG: a child sets it while
    it lowers, workers/sandbox/steps.py), or None when this process compiles without the cache."""
    return workdir / STATS_LOG if os.environ.get("CCACHE_DIR") else None


def read_stats(log: Path) -> dict[str, int]:
    """ccache's stats log (a `# FILE` line, then that compile's counters, one a line) as hits and
    misses."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return {"hits": 0, "misses": 0}
    hits = misses = 0
    for block in text.split("# ")[1:]:
        counters = set(block.splitlines()[1:])
        if counters & {"direct_cache_hit", "preprocessed_cache_hit"}:
            hits += 1
        elif "cache_miss" in counters:
            misses += 1
    return {"hits": hits, "misses": misses}
