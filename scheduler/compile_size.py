"""How long a graph's compile may take, roughly, for the pools' longest-first order, read from the
end of its .pt2 (a zip, whose directory sits there) without loading it: nothing of the archive is
run, decompressed or trusted, and one bad archive only loses its hint.

The estimate is the bytes of its serialized graphs (`<root>/models/*.json`): a compile's cost
follows its graph's nodes and kernels, not its weights. The whole archive's size, which the pools
went by before, put the smoke zoo's mlp (the largest archive after gpt's, from its weights) before
its cnn and encoder, whose graphs are larger and lower slower; the pool's last unit was then a
slow one while the other worker idled (bench/fanout.py --units)."""
from __future__ import annotations

import io
import re
import zipfile
from typing import Callable

# the end of an archive read for its directory: first enough for a few hundred entries, then for
# tens of thousands (an LLM's weights, one entry each); an archive whose directory is larger still
# gets no estimate
TAILS = (64 << 10, 4 << 20)
GRAPH_ENTRY = re.compile(r"[^/]+/models/[^/]+\.json")


def graph_bytes(read_tail: Callable[[int], bytes | None], size: int) -> int | None:
    """The bytes its directory declares for the archive's serialized graphs, or None where the
    end read holds no directory (not a zip, or a directory larger than TAILS) or it names none."""
    for n in TAILS if size > 0 else ():
        tail = read_tail(min(n, size))
        if tail is None:
            return None
        try:
            with zipfile.ZipFile(_Tail(tail, size)) as zf:
                declared = [i.file_size for i in zf.infolist() if GRAPH_ENTRY.fullmatch(i.filename)]
            return sum(declared) if declared else None
        except (zipfile.BadZipFile, OSError, ValueError, EOFError):
            if n >= size:
                return None  # the whole archive was read: not one
    return None


class _Tail(io.RawIOBase):
    """A file of `size` bytes of which only the last len(tail) are at hand: enough for zipfile to
    read the directory at the end; a read before them fails (OSError: no estimate)."""

    def __init__(self, tail: bytes, size: int):
        super().__init__()
        self._tail, self._size, self._at = tail, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        at = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._size}[whence] + offset
        if at < 0:
            raise OSError("seek before the start of the archive")
        self._at = at
        return at

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def, override]
        start = self._at - (self._size - len(self._tail))
        if start < 0:
            raise OSError("a read before the part of the archive at hand")
        data = self._tail[start:start + len(buffer)]
        buffer[:len(data)] = data
        self._at += len(data)
        return len(data)
