"""How the worker polices a sandbox child from outside (workers/sandbox/process.py): what the
way it ended says to a user, and the share of the CPU it gets."""
from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

from workers.unit import UnitLimits

log = logging.getLogger(__name__)

SIGNALS = {signal.SIGXCPU: "the CPU time limit", signal.SIGXFSZ: "the file size limit",
           signal.SIGKILL: "SIGKILL (killed: out of memory, or by an operator)"}


def exit_reason(code: int, limits: UnitLimits) -> str:
    """A child's exit status (negative: the signal that ended it), told against its limits."""
    if code >= 0:
        return f"the sandbox exited with status {code}"
    sig = signal.Signals(-code)
    what = SIGNALS.get(sig, f"{sig.name} ({signal.strsignal(sig) or 'signal'})")
    if sig == signal.SIGKILL:
        return f"the sandbox was killed by {what}; its memory limit is {limits.memory_gb:g} GiB"
    if sig in (signal.SIGXCPU, signal.SIGXFSZ):
        return f"the sandbox hit {what} ({limits.cpu_s:g} s CPU, {limits.file_gb:g} GiB per file)"
    if sig == signal.SIGABRT:
        return (f"the sandbox crashed with {what}; a native allocation failing under its "
                f"{limits.memory_gb:g} GiB memory limit also ends this way")
    return f"the sandbox crashed with {what}"


def renice(pid: int, niceness: int) -> None:
    """Every thread of the child and of what it started (g++, Inductor's compile workers) is in
    its process group; PRIO_PGRP sets them all (PRIO_PROCESS would set one thread). The child
    is also its own session (as is a gang's waiting rank: scheduler/gang_actor.py), which
    Linux's autogroup scheduling (on by default, /proc/sys/kernel/sched_autogroup_enabled) makes
    a group that shares the CPU with other sessions by the group's niceness alone: a thread's
    own niceness weighs only against the threads of its session. So the session's is set too,
    or a nightly's children would take as much CPU as an interactive job's, each in a session
    of its own."""
    try:
        os.setpriority(os.PRIO_PGRP, os.getpgid(pid), niceness)
        autogroup = Path(f"/proc/{pid}/autogroup")
        if autogroup.exists():
            autogroup.write_text(str(niceness))
    except OSError as e:  # ran on, at the default priority
        log.warning("process %d not reniced to %d: %s", pid, niceness, e)
