"""The node's compiler cache (workers/sandbox/compiler_cache.py): what a child's environment gets,
and how a lowering's compiles are counted from ccache's stats log. A real lowering served by it:
tests/test_weights_and_cache_bundle.py."""
from __future__ import annotations

import pytest

from workers.sandbox import compiler_cache
from workers.sandbox.env import COMPILER_CACHE, child_env, node_dir

# ccache 4.7's stats log for one AOTInductor lowering, as written here (paths shortened): a probe
# built and linked in one call, the precompiled header's preprocessing, the wrapper and the weights
# served by the cache, the kernel compiled, then the link.
STATS_LOG = """\
# 
no_input_file
# ../c3kfgfd3.cpp
called_for_link
# ../header.hpp
called_for_preprocessing
# ../cw5svj6n.wrapper.cpp
direct_cache_hit
local_storage_hit
local_storage_read_hit
# ../ccwjnrtx.kernel.cpp
cache_miss
direct_cache_miss
local_storage_miss
local_storage_write
preprocessed_cache_miss
# ../cwybdm34.weights.S
preprocessed_cache_hit
local_storage_hit
# ../cw5svj6n.wrapper.o
called_for_link
"""


def test_the_stats_log_counts_hits_and_misses_and_leaves_out_what_ccache_cannot_cache(tmp_path):
    (tmp_path / "stats.log").write_text(STATS_LOG)
    assert compiler_cache.read_stats(tmp_path / "stats.log") == {"hits": 2, "misses": 1}
    assert compiler_cache.read_stats(tmp_path / "missing.log") == {"hits": 0, "misses": 0}  # no compile ran


def test_a_lowering_outside_the_cache_counts_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("CCACHE_DIR", raising=False)
    assert compiler_cache.stats_log(tmp_path) is None


@pytest.mark.skipif(compiler_cache.masquerade_dir() is None, reason="no ccache here (./dev installs Debian's ccache as root)")
def test_children_compile_through_the_node_cache_unless_it_is_turned_off(tmp_path, monkeypatch):
    env = child_env(tmp_path)
    assert env["PATH"].split(":")[0] == compiler_cache.masquerade_dir()
    assert env["CCACHE_DIR"] == str(node_dir() / COMPILER_CACHE)
    assert "time_macros" in env["CCACHE_SLOPPINESS"] and env["CCACHE_NOHASHDIR"] == "1"
    monkeypatch.setenv("FARM_COMPILER_CACHE", "off")
    env = child_env(tmp_path)
    assert "CCACHE_DIR" not in env and compiler_cache.masquerade_dir() not in env["PATH"].split(":")
