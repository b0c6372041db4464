"""A sandbox's zygote: a jailed process that imports torch once and forks a fresh child per job.

    python -m workers.sandbox.zygote CONTROL_FD DEVICE

No child serves two jobs, and a child that met a bad input never serves another unit; a fresh
child used to mean a fresh Python importing torch (about 2 CPU-s), paid on every job switch of a
farm service's worker and after every in-process job. The zygote pays it once per sandbox. It
never reads a request or touches a graph: it only forks, so every child starts from the same
clean state, in a process of its own, as if just started. What stays shared between children of
one zygote is what the jail already shared between the units of one child (the sandbox's own
dir and the private /tmp, which a child wipes before its first unit's first step). In a jail the
zygote is not dumpable, so a child (same uid, same jail) cannot read or write its memory, and
ptrace is refused by the jail's seccomp filter; as a job's child ends, the worker kills every
other process in the jail but the zygote (process.Sandbox._end_child), so nothing a child left
running meets the next job's.

The worker asks over CONTROL_FD (a SOCK_SEQPACKET socket: one record per message) with a JSON
record carrying the child's limits, HOME and start-up log, and two descriptors: the read end of
its request pipe and the write end of its reply pipe. The zygote answers {"forked": PID} (its PID
inside the jail), waits for that child, and answers {"exited": CODE} (negative: the signal that
ended it) before it takes the next request; a request the worker gave up before its fork (its
reply pipe has no reader) is answered {"exited": 0} alone, and nothing is forked. It exits when
the worker closes the socket, and dies with the worker. A record with "warm_lowering" (a child of
this zygote has lowered) has it first do, once, what a process's first lowering does beyond the
imports (steps.warm_up_lowering), so that its later children lower their first unit as fast as
their next; one with "imports" (the worker's Placement.warm_imports) has it import those, once.

A CUDA zygote must not initialize CUDA, or no child forked from it can use it: its environment
has torch ask NVML instead (process.Sandbox._start_zygote), and a child that finds CUDA unusable
anyway starts a fresh Python in its place (_start_fresh).
"""
from __future__ import annotations

import gc
import json
import os
import select
import socket
import sys
import time
import traceback
from typing import Callable

MAX_RECORD = 1 << 16


def _not_dumpable(on: bool) -> None:
    import ctypes

    PR_SET_DUMPABLE = 4
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0 if on else 1)


def _say(control: socket.socket, message: dict) -> None:
    control.send(json.dumps(message).encode())


def _child(request: dict, fds: list[int], device: str, warmed_s: float) -> None:
    """In the forked child: its own session and process group (the worker renices and kills it
    by group, and sets the session's CPU share: process.Sandbox._renice), its pipes on stdin and
    the reply fd, its limits, then the step loop."""
    from workers.sandbox import child
    from workers.unit import UnitLimits

    os.setsid()
    if os.environ.get("FARM_JAIL_TMP"):
        _not_dumpable(False)  # as a freshly started process is (the worker reads its /proc files)
    os.dup2(fds[0], 0)
    os.close(fds[0])
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ["HOME"] = request["home"]
    os.chdir(request["home"])
    child._die_with_parent()  # the zygote
    limits = UnitLimits(**request["limits"])
    child._apply_limits(limits, device)
    if device == "cuda" and _cuda_fork_poisoned():
        _start_fresh(fds[1], request["limits"], device)
    child.serve(fds[1], limits, device, warmed_s)


def _cuda_fork_poisoned() -> bool:
    """Did this zygote initialize CUDA before forking us? A forked child cannot use CUDA then
    ("Cannot re-initialize CUDA in forked subprocess"). The sandbox has the zygote's checks ask
    NVML (process.Sandbox._start_zygote), but a torch version or a host where NVML fails could
    still reach the CUDA runtime."""
    import torch

    return torch.cuda._is_in_bad_fork()


def _start_fresh(reply_fd: int, limits: dict, device: str) -> None:
    """This job's child becomes a fresh Python (workers.sandbox.child), which imports torch again
    and may use CUDA: slower to start, never a failed unit. Its limits, session and pipes stay."""
    print("sandbox child: the zygote had initialized CUDA, which a forked process cannot use; "
          "this child starts a fresh Python", file=sys.stderr, flush=True)
    os.set_inheritable(reply_fd, True)
    os.execv(sys.executable, [sys.executable, "-P", "-m", "workers.sandbox.child", str(reply_fd), device,
                              json.dumps(limits)])


def _abandoned(reply_fd: int) -> bool:
    """Did the worker give this child up before we forked it (its job ended, or it was retired,
    while we imported torch)? Then nobody reads its replies: a pipe's write end polls as an error
    once its read end is closed. Forked anyway, it found its HOME removed and died at start."""
    poller = select.poll()
    poller.register(reply_fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _warm_lowering() -> None:
    """Once a child of ours has lowered, this zygote will likely fork more that lower (a worker's
    next jobs): what a process's first lowering does beyond the imports (steps.warm_up_lowering)
    is done here, once, for all of them. A zygote whose children only name programs never pays it."""
    from workers.sandbox.steps import warm_up_lowering

    _ahead(warm_up_lowering, "warmed the lowering for the next children")


def _import_ahead(modules: list[str]) -> None:
    """The modules the worker's placement names (Placement.warm_imports: ExecuTorch's, on a worker
    that builds only .pte files), once, before the first fork: every child then starts with them."""
    from workers.sandbox.steps import import_ahead

    _ahead(lambda: import_ahead(modules), f"imported {', '.join(modules)} for its children")


def _ahead(work: Callable[[], None], done: str) -> None:
    """Work done for the children to come, with its heap frozen after (workers/frozen_heap.py)."""
    from workers.frozen_heap import heap_frozen_after

    began = time.perf_counter()
    with heap_frozen_after():
        work()
    print(f"sandbox zygote: {done} in {time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)


def main() -> None:
    control, device = socket.socket(fileno=int(sys.argv[1])), sys.argv[2]
    from workers.sandbox import child

    child._die_with_parent()
    if os.environ.get("FARM_JAIL_TMP"):
        _not_dumpable(True)  # its children (same uid, same jail) cannot read or write its memory: /proc/PID/mem
    began = time.perf_counter()
    child.warm_up_imports()
    warmed_s = time.perf_counter() - began
    print(f"sandbox zygote: imported what a step needs in {warmed_s:.1f} s; its {gc.get_freeze_count():,} objects "
          "are frozen, so no collection of its children walks them", file=sys.stderr, flush=True)
    lowering_warmed = imported = False
    while True:
        try:
            record, fds, _, _ = socket.recv_fds(control, MAX_RECORD, 2)
        except OSError:
            return
        if not record:
            return  # the worker closed the socket
        request = json.loads(record)
        if request.get("warm_lowering") and not lowering_warmed:
            _warm_lowering()
            lowering_warmed = True
        if request.get("imports") and not imported:
            _import_ahead(list(request["imports"]))
            imported = True
        if _abandoned(fds[1]):
            for fd in fds:
                os.close(fd)
            print("sandbox zygote: skipped a child its worker gave up before it was forked", file=sys.stderr, flush=True)
            _say(control, {"exited": 0})  # (the worker counts one exit per child it asked for)
            continue
        pid = os.fork()
        if pid == 0:
            status = 0
            try:
                control.close()
                _child(request, fds, device, warmed_s)
            except BaseException:  # the child's own failure, in its start-up log; never back into this loop
                traceback.print_exc()
                status = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        for fd in fds:
            os.close(fd)
        _say(control, {"forked": pid})
        _, status = os.waitpid(pid, 0)
        _say(control, {"exited": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    main()
