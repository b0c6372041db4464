"""What an `inductor-cache` unit's sandbox leaves for the remote caches is hostile input (it lowered
a graph from anyone): the worker publishes it only when every entry is one of torch's FX graph or
AOTAutograd keys with its files inside the outbox and within bounds; otherwise nothing, and says why."""
from __future__ import annotations

import json
import os

import pytest

from storage import store_from_uri
from storage.remote_cache import CacheEntries
from workers.backends import jit_entries

FX = "pt2:fx-graph-v1::f" + "a" * 51 + ":c1"
AOT = "pt2:autograd-experimental::a" + "b" * 51 + ":c1"
KERNEL = "ab/c" + "b" * 51 + ".main.so"


def _outbox(tmp_path, entries, files=None):
    outbox = tmp_path / jit_entries.OUTBOX
    (outbox / "kernels" / "ab").mkdir(parents=True)
    for name, data in (files or {"0.value": b"{}", f"kernels/{KERNEL}": b"\x7fELF"}).items():
        (outbox / name).write_bytes(data)
    (outbox / jit_entries.INDEX).write_text(json.dumps(entries))
    return outbox


def test_a_well_formed_outbox_is_published_with_its_kernels(tmp_path):
    store = store_from_uri(str(tmp_path / "store"))
    parts = {"gm": ["abcd1234abcd", "<graph>"], "cpp.march": ["ffff0000", "x86-64-v3"]}
    outbox = _outbox(tmp_path, [{"key": FX, "value": "0.value", "files": [KERNEL], "facts": {"build_command": ["g++"]},
                                 "parts": parts}])
    assert jit_entries.published(store, outbox, "farm unit u1") == (1, None)
    raw, doc, value = CacheEntries(store).entry(FX.encode())
    assert value == b"{}" and doc["writer"] == "farm unit u1" and list(doc["files"]) == [KERNEL]
    assert doc["facts"] == {"build_command": ["g++"]}
    key, writer, noted = CacheEntries(store).graph("abcd1234abcd")  # what a miss explanation compares
    assert key == FX and writer == "farm unit u1" and json.loads(noted) == parts


def test_an_autograd_entry_is_published_beside_its_fx_graphs(tmp_path):
    store = store_from_uri(str(tmp_path / "store"))
    outbox = _outbox(tmp_path, [{"key": FX, "value": "0.value", "files": [KERNEL], "facts": {"build_command": ["g++"]}},
                                {"key": AOT, "value": "1.value"}],
                     {"0.value": b"{}", "1.value": b'{"data": ""}', f"kernels/{KERNEL}": b"\x7fELF"})
    assert jit_entries.published(store, outbox, "farm unit u1") == (2, None)
    raw, doc, value = CacheEntries(store).entry(AOT.encode())
    assert value == b'{"data": ""}' and doc["writer"] == "farm unit u1" and not doc.get("files")


@pytest.mark.parametrize("entry, problem", [
    ({"key": "pt2:autograd-experimental::x:c1", "value": "0.value"}, "not one of torch's FX graph or AOTAutograd keys"),
    ({"key": "pt2:autotune-best-config-v2::" + "c" * 40 + ":c1", "value": "0.value"}, "not one of torch's FX graph"),
    ({"key": AOT, "value": "0.value", "files": [KERNEL], "facts": {"build_command": ["g++"]}},
     "only FX graph entries carry them"),
    ({"key": FX, "value": "../../etc/passwd"}, "is not a file in the outbox"),
    ({"key": FX, "value": "link"}, "is not a file in the outbox"),
    ({"key": FX, "value": "0.value", "files": ["../../x.main.so"]}, "not Inductor kernels"),
    ({"key": FX, "value": "0.value", "files": [KERNEL]}, "without the command they were built with"),
    ({"key": FX, "value": "0.value", "parts": {"gm": ["../../units", "x"]}}, "names no graph hash"),
    ({"key": FX, "value": "0.value", "parts": {"gm": "abcd1234abcd"}}, "in another shape than torch's"),
])
def test_a_hostile_outbox_publishes_nothing_and_says_why(tmp_path, entry, problem):
    store = store_from_uri(str(tmp_path / "store"))
    outbox = _outbox(tmp_path, [entry])
    os.symlink("/etc/hostname", outbox / "link")
    fed, said = jit_entries.published(store, outbox, "farm unit u1")
    assert fed == 0 and problem in said, said
    assert list(store.backend.list("remote-cache/fx-graph-v1/")) == []


def test_entries_over_the_size_bound_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(jit_entries, "MAX_BYTES", 10)
    outbox = _outbox(tmp_path, [{"key": FX, "value": "0.value"}], {"0.value": b"x" * 11})
    fed, said = jit_entries.published(store_from_uri(str(tmp_path / "store")), outbox, "w")
    assert fed == 0 and "over 10 bytes" in said


def test_a_store_that_refuses_the_entries_leaves_the_unit_standing(tmp_path, monkeypatch):
    from storage.backend import StoreError

    store = store_from_uri(str(tmp_path / "store"))
    outbox = _outbox(tmp_path, [{"key": FX, "value": "0.value"}])

    def refuse(*args, **kwargs):
        raise StoreError("the bucket is read-only")

    monkeypatch.setattr(CacheEntries, "put", refuse)
    fed, said = jit_entries.published(store, outbox, "w")
    assert fed == 0 and "0 of its 1 remote-cache entries were published" in said and "read-only" in said
