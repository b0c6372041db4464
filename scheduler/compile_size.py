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
import os
import re
import zipfile
from pathlib import Path
from typing import Callable

# the end of an archive read for its directory: first enough for a few hundred entries, then for
# tens of thousands (an LLM's weights, one entry each); an archive whose directory is larger still
# gets no estimate
TAILS = (64 << 10, 4 << 20)
GRAPH_ENTRY = re.compile(r"[^/]+/models/[^/]+\.json")


def graph_bytes(read_tail: Callable[[int], bytes | None], size: int) -> int | None:
    """The bytes its directory declares for the archive's serialized graphs, or None where the
    end read holds no directory (not a zip, or a directory larger than TAILS) or it names none.
    zipfile reads an archive's end alone as one with data before it (a self-extracting zip's):
    the directory is found from the end, and one that starts before the end read is refused."""
    for n in TAILS if size > 0 else ():
        tail = read_tail(min(n, size))
        if tail is None:
            return None
        try:
            with zipfile.ZipFile(io.BytesIO(tail)) as zf:
                declared = [i.file_size for i in zf.infolist() if GRAPH_ENTRY.fullmatch(i.filename)]
            return sum(declared) if declared else None
        except (zipfile.BadZipFile, ValueError, EOFError):
            if n >= size:
                return None  # the whole archive was read: not one
    return None


def file_graph_bytes(path: Path) -> int | None:
    """The same for a file at hand (a graph being ingested), so that nothing is read back from the
    store; None too where the file cannot be read."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)

            def tail(n: int) -> bytes:
                f.seek(size - n)
                return f.read(n)

            return graph_bytes(tail, size)
    except OSError:
        return None
