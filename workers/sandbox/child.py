"""The sandbox child's loop (see workers/sandbox/process.py): run one step per request, each in
its unit's temp dir with its output in that request's log file, and answer in JSON. A child is
forked by its sandbox's zygote (workers/sandbox/zygote.py), which has imported torch, and sets
its own limits before it reads any input.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import resource
import shutil
import signal
import sys
import time
import traceback
import warnings
from typing import Any, BinaryIO

from workers.errors import summary
from workers.frozen_heap import heap_frozen_after
from workers.unit import UnitLimits

HEADER_BYTES = 8
GiB = 1 << 30


def _apply_limits(limits: UnitLimits, device: str) -> None:
    memory = int(limits.memory_gb * GiB)
    # CUDA reserves tens of GiB of address space it never touches, so an address-space limit
    # breaks it ("CUDA error: out of memory" at the first tensor); RLIMIT_DATA bounds the heap.
    resource.setrlimit(resource.RLIMIT_DATA if device == "cuda" else resource.RLIMIT_AS, (memory, memory))
    size = int(limits.file_gb * GiB)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash must not leave gigabytes of core behind


def _cpu_budget(seconds: float) -> None:
    """RLIMIT_CPU counts the whole life of the process: allow this request `seconds` more."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    spent = used.ru_utime + used.ru_stime
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(spent + seconds) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _read(stream: BinaryIO, n: int) -> bytes | None:
    data = stream.read(n)
    return data if data and len(data) == n else None


def _send(out: BinaryIO, reply: dict[str, Any]) -> None:
    data = json.dumps(reply, default=str).encode()
    out.write(len(data).to_bytes(HEADER_BYTES, "big") + data)
    out.flush()


def _redirect_output(path: str) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _log_to_stderr() -> None:
    """Inductor's INFO log and Python warnings go to fd 2, i.e. the current request's log."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    for name in ("torch._inductor", "py.warnings"):
        lg = logging.getLogger(name)
        lg.handlers = [handler]
        lg.setLevel(logging.INFO)
        lg.propagate = False
    logging.captureWarnings(True)
    warnings.simplefilter("always")


def _wipe_private_tmp() -> None:
    """A jailed child's /tmp is its own tmpfs (FARM_JAIL_TMP): what one unit left there goes
    before the next unit. The dirs bound into it (its sandbox's, its caches) are mount points
    and stay."""
    tmp = os.environ.get("FARM_JAIL_TMP")
    if not tmp:
        return
    with open("/proc/self/mountinfo") as f:
        mounts = {line.split()[4] for line in f}
    for entry in os.scandir(tmp):
        if any(m == entry.path or m.startswith(entry.path + "/") for m in mounts):
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        except OSError as e:  # not ours to remove: the next unit's log says so
            print(f"sandbox: could not clear {entry.path} from the private /tmp: {e}", file=sys.stderr)


def _die_with_parent() -> None:
    """A worker killed by Ray (a gang stopped, a stuck unit) must not leave its child running,
    blocked in a collective or a hung artifact: the kernel kills us when the worker goes."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1 and not os.environ.get("FARM_JAIL_TMP"):  # the worker died before we asked
        os._exit(1)  # (in a jail, pid 1 is the namespace's init, our parent, which bubblewrap ties to the worker)


def warm_up_imports() -> None:
    with heap_frozen_after():
        from workers.sandbox.steps import warm_up  # torch's import, paid once per zygote

        warm_up()


def serve(reply_fd: int, limits: UnitLimits, device: str, warmed_s: float) -> None:
    """Say ready, then run one step per request on stdin until it closes (limits already applied)."""
    from workers.sandbox.steps import USER_ERRORS, Steps

    replies = os.fdopen(reply_fd, "wb")
    requests = sys.stdin.buffer
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    _log_to_stderr()
    steps = Steps()
    _send(replies, {"ready": True, "warm_up_s": warmed_s})
    unit_dir = None
    while (header := _read(requests, HEADER_BYTES)) is not None:
        body = _read(requests, int.from_bytes(header, "big"))
        if body is None:
            return
        request = pickle.loads(body)  # from the worker that started us
        if request["cwd"] != unit_dir:  # another unit
            _wipe_private_tmp()
            unit_dir = request["cwd"]
        _redirect_output(request["log"])
        os.chdir(request["cwd"])
        _cpu_budget(request["cpu_s"])
        began = time.perf_counter()
        try:
            reply = {"result": getattr(steps, request["step"])(**request["kwargs"])}
        except USER_ERRORS as e:
            traceback.print_exc()
            reply = {"error": str(e), "retryable": bool(getattr(e, "retryable", False))}
        except MemoryError:
            traceback.print_exc()
            reply = {"error": f"{request['step']}: ran out of memory (the sandbox may use {limits.memory_gb:g} GiB; "
                              f"raise limits.memory_gb for bigger models)"}
        except Exception as e:  # a library blew up: still an answer, with the traceback in the unit log
            traceback.print_exc()
            reply = {"error": f"{request['step']} failed: {type(e).__name__}: {summary(e)}"}
            if "allocate memory" in str(e):
                reply["error"] += f" (the sandbox may use {limits.memory_gb:g} GiB: raise limits.memory_gb)"
        sys.stdout.flush()
        sys.stderr.flush()
        reply["step_s"] = time.perf_counter() - began
        _send(replies, reply)


def main() -> None:
    """A child started as a fresh Python, by a zygote's forked child that cannot use CUDA
    (zygote._start_fresh): its limits, session, stdin and output are the forked child's.

        python -m workers.sandbox.child REPLY_FD DEVICE LIMITS_JSON
    """
    reply_fd, device, limits = int(sys.argv[1]), sys.argv[2], UnitLimits(**json.loads(sys.argv[3]))
    _die_with_parent()
    began = time.perf_counter()
    warm_up_imports()
    serve(reply_fd, limits, device, time.perf_counter() - began)


if __name__ == "__main__":
    main()
