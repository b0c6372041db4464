"""Temp dirs the farm makes, named by the process that owns them, so that what a killed process
left behind is found and removed by the next farm process on the host (a SIGKILLed worker runs
no cleanup of its own).

    <tmp>/farm-<kind>-<pid>.<pid namespace>-<random>/

PIDs only mean something within their PID namespace: a farm process in another container (or
`unshare -p`) that shares this /tmp sees other PIDs, so it leaves the dirs of other namespaces alone.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)
_OWNED = re.compile(r"^farm-[a-z-]+?-(\d+)(?:\.(\d+))?-[^/]+$")


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no /proc: one namespace as far as we can tell
        return 0


def prefix(kind: str) -> str:
    """The name prefix of a temp dir of this kind owned by this process."""
    return f"farm-{kind}-{os.getpid()}.{_pid_namespace()}-"


def sweep_orphans(root: Path | None = None) -> int:
    """Remove farm temp dirs whose owning process is gone; how many were removed."""
    removed, here = 0, str(_pid_namespace())
    for path in Path(root or tempfile.gettempdir()).glob("farm-*"):
        match = _OWNED.match(path.name)
        if not match or not path.is_dir() or path.is_symlink() or match.group(2) not in (None, here):
            continue  # not ours to judge: another namespace's PIDs mean nothing here
        if _alive(int(match.group(1))):
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
