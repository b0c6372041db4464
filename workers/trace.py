"""A trace per compile (issue 14): the structured log `TORCH_TRACE` writes, one per unit.

The sandbox child is warm across units, so torch read `TORCH_TRACE` once, long before this
unit: instead the child attaches torch's own trace handler (the one `TORCH_TRACE` sets up),
pointed at the unit's directory, for the lowering alone. The worker then gzips what it wrote
into a blob linked from the manifest and the results row, failed units included, so a failed
lowering can be read without reproducing it (`farm trace KEY` renders it with tlparse).
"""
from __future__ import annotations

import contextlib
import gzip
import logging
from pathlib import Path
from typing import Iterator

TRACE_DIR = "torch-trace"
MAX_TRACE_BYTES = 256 << 20  # raw log; a lowering that logs more keeps no trace (the unit log says so)


@contextlib.contextmanager
def torch_trace(workdir: Path) -> Iterator[None]:
    """In the sandbox child: torch's structured trace of what runs inside, into workdir/torch-trace."""
    from torch._logging import _internal as torch_logging

    handler = torch_logging.LazyTraceHandler(str(workdir / TRACE_DIR))
    handler.setFormatter(torch_logging.TorchLogsFormatter(trace=True))
    torch_logging.trace_log.setLevel(logging.DEBUG)
    torch_logging.trace_log.addHandler(handler)
    try:
        yield
    finally:
        torch_logging.trace_log.removeHandler(handler)
        handler.close()


def packed_trace(workdir: Path) -> tuple[bytes | None, str]:
    """On the worker: the unit's trace, gzipped, and a line for the unit log."""
    logs = sorted((workdir / TRACE_DIR).glob("*.log")) if (workdir / TRACE_DIR).is_dir() else []
    logs = [p for p in logs if p.is_file() and not p.is_symlink()]  # the child wrote them; trust no link
    if not logs:
        return None, "no torch trace was written"
    size = sum(p.stat().st_size for p in logs)
    if size > MAX_TRACE_BYTES:
        return None, f"torch trace not kept: {size} bytes is over {MAX_TRACE_BYTES}"
    data = gzip.compress(b"".join(p.read_bytes() for p in logs), compresslevel=6, mtime=0)
    return data, f"torch trace: {size} bytes ({len(data)} gzipped)"
