"""Temp dirs the farm makes, named by the process that owns them, so that what a killed process
left behind is found and removed by the next farm process on the host (a SIGKILLed worker runs
no cleanup of its own).

    <tmp>/farm-<kind>-<pid>-<random>/
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)
_OWNED = re.compile(r"^farm-[a-z-]+?-(\d+)-[^/]+$")


def prefix(kind: str) -> str:
    """The name prefix of a temp dir of this kind owned by this process."""
    return f"farm-{kind}-{os.getpid()}-"


def sweep_orphans(root: Path | None = None) -> int:
    """Remove farm temp dirs whose owning process is gone; how many were removed."""
    removed = 0
    for path in Path(root or tempfile.gettempdir()).glob("farm-*"):
        match = _OWNED.match(path.name)
        if not match or not path.is_dir() or path.is_symlink() or _alive(int(match.group(1))):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed += not path.exists()
    if removed:
        log.info("removed %d temp dirs left by farm processes that died", removed)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and not ours to clean
        return True
    return True
