"""A child process for everything that touches untrusted input: loading a graph, lowering it,
loading, verifying and benchmarking an artifact (workers/sandbox/steps.py runs there).

The child holds no credentials (an allow-listed environment: no AWS, Ray or farm secrets, an
empty HOME), works in the unit's temp dir, and runs under limits on memory, file size and CPU
time, with a hard wall-clock timeout enforced from here. A crash, a hang or a blown limit ends
the unit as failed with the signal or limit named and the child's output in the unit log;
this process lives on and starts a fresh child for the next unit.

The child stays warm between units (torch's import and Inductor's set-up are paid once), and
is replaced after any failure, so a child that met a bad graph never serves another unit, and
after each job, so no child serves two jobs. Children are forked by the sandbox's zygote
(workers/sandbox/zygote.py), a jailed process that imported torch once and never touches input:
a fresh child for the next job costs a fork, not torch's import. A step that refused its input
ends only the child (the zygote never saw the input, and every other process in the jail goes
with the child); after a crash, a hang or a blown limit the zygote goes too, and the next child
comes from a new one.

A child runs for one device: a CPU child sees no GPU; a CUDA child sees the worker's GPU and
is limited by RLIMIT_DATA instead of RLIMIT_AS (CUDA reserves far more address space than it
uses, and fails under an address-space limit). After a CUDA child crashed or hung, the GPU is
checked (workers/backends/cuda.py) before another child may use it.

Requests go down as pickles (the child trusts us); replies come back as size-capped JSON on
their own pipe (we do not trust the child), and the child's stdout/stderr go to a file per
request that we read back even after a crash.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from workers.sandbox import jail, tempdirs
from workers.sandbox.env import child_env, jailed_env
from workers.sandbox.policing import exit_reason, renice
from workers.sandbox.replies import HEADER, SandboxFailed, read_reply
from workers.unit import UnitLimits

log = logging.getLogger(__name__)

STARTUP_S = 300.0  # a child that has not imported torch by then is broken


@dataclass
class SandboxCost:
    """What the sandbox costs on top of the work itself (bench/sandbox.py reports it)."""
    start_s: float = 0.0  # starting children (torch's import): once per worker, and after a failed unit
    warm_up_s: float = 0.0  # of which importing what the first step would import anyway (workers/sandbox/steps.py)
    calls: int = 0
    overhead_s: float = 0.0  # round trips minus the time the child spent in the steps

    def add(self, round_trip: float, step_s: Any) -> None:
        self.calls += 1
        if isinstance(step_s, (int, float)) and 0 <= step_s <= round_trip:
            self.overhead_s += round_trip - step_s


class Sandbox:
    """A warm child process that runs steps (workers/sandbox/steps.py) for one unit at a time,
    jailed (workers/sandbox/jail.py) unless FARM_SANDBOX says otherwise. `network=True` is for a
    gang's children, whose collectives need the host's network. `lowers=True`: its children will
    lower (a service's worker back after a gang lent its CPU), so its zygote warms the lowering
    before its first child, not only once a child has lowered. `imports`: modules its zygote imports
    before its first fork, for every child (a worker's Placement.warm_imports)."""

    zygote_module = "workers.sandbox.zygote"  # a test's own stands in for it (tests/poisoned_zygote.py)

    def __init__(self, network: bool = False, lowers: bool = False, imports: tuple[str, ...] = ()) -> None:
        self.network = network
        self._lowers = lowers
        self._imports = tuple(imports)
        self.isolation: jail.Isolation | None = None  # decided when the first child starts
        self._proc: subprocess.Popen | None = None  # the zygote (in a jail: bubblewrap)
        self._zygote_host_pid: int | None = None  # the zygote's own pid on the host, once looked up
        self._zygote: tuple[socket.socket, str, float] | None = None  # its control socket; its device and /tmp GiB
        self._zygote_log: Path | None = None
        self._requests: BinaryIO | None = None  # the current child's stdin
        self._replies: int | None = None  # and its reply pipe
        self._exits: list[int | None] = []  # the exit code of each child asked for, in order, once the zygote said
        self._forked: int | None = None  # the pid of the child last asked for, once the zygote said it forked it
        self._lowered = lowers  # a child of this zygote lowered: it warms the lowering for its next (zygote.py)
        self._started_for: tuple[UnitLimits, str] | None = None  # the limits and device of the running child
        self._env: dict[str, str] = {}  # the environment it inherited
        self._gpu_suspect = False  # a CUDA child crashed or hung: check the GPU before the next one
        self._spawned: float | None = None  # when the child was started, until it says it is ready
        self._startup_log: Path | None = None
        self._home: Path | None = None  # the current child's HOME, removed as it ends
        self._base: Path | None = None  # made when first needed: a plain hit never needs one
        self.starts = 0  # children started so far: one, unless units failed
        self.start_waited_s = 0.0  # how long the last call waited for its child to start
        self.cost = SandboxCost()
        self.niceness = 0  # the children's, until `renew` (see `yield_cpu`)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def pid(self) -> int | None:
        """The current child's pid on the host: the zygote's one child, once it has forked it."""
        if self._requests is None or self._proc is None or self._proc.poll() is not None:
            return None
        zygote = self._zygote_pid()
        return None if zygote is None else jail.first_child(zygote)

    @property
    def jailed(self) -> bool:
        """Whether its children run in the jail (known once the first has started)."""
        return self.isolation is not None and self.isolation.mode == "jail"

    def root(self) -> Path:
        """This sandbox's own dir: the children's HOMEs and the units' work dirs. A jailed child
        sees it (and its Inductor cache) and nothing else of the host's files it may write."""
        if self._base is None or not self._base.is_dir():  # made once; again if something swept it meanwhile
            self._base = Path(tempfile.mkdtemp(prefix=tempdirs.prefix("sandbox")))
            os.chmod(self._base, 0o711)  # a jailed child's uid passes through, and lists nothing
        return self._base

    @contextlib.contextmanager
    def workdir(self, kind: str = "unit") -> Iterator[Path]:
        """A temp dir for one unit's files, the only place its steps read inputs from and write
        to; removed afterwards."""
        with tempfile.TemporaryDirectory(prefix=f"{kind}-", dir=self.root()) as tmp:
            jail.make_writable(Path(tmp))
            yield Path(tmp)

    def call(self, step: str, cwd: Path, limits: UnitLimits, deadline: float, device: str = "cpu",
             **kwargs: Any) -> dict[str, Any]:
        """Run one step in the child for device ("cpu" or "cuda"), in the unit's temp dir cwd, until
        the monotonic deadline."""
        self.start_waited_s = 0.0
        self._lowered |= step == "lower"  # the zygote warms the lowering before it forks the next child
        if self._requests is not None and self._started_for and not _same_child(self._started_for, (limits, device)):
            self._end_child()  # set when the child started: another job's limits, or another device, need a fresh one
        if not self._child_alive():
            self.prestart(limits, device)
        if self.jailed:
            if not cwd.resolve().is_relative_to(self.root().resolve()):
                raise ValueError(f"{step}: {cwd} is not one of this sandbox's work dirs, which its jailed child cannot "
                                 "see; make it with Sandbox.workdir()")
            jail.hand_over(cwd)
        if self._spawned is not None:
            self.start_waited_s = self._wait_ready()
            deadline += self.start_waited_s  # the child's start (torch's import) is not the unit's time
        self._renice()
        log = cwd / f".sandbox-{step}.log"
        request = pickle.dumps({"step": step, "cwd": str(cwd), "log": str(log),
                                "cpu_s": limits.cpu_s, "kwargs": kwargs})
        try:
            sent = time.perf_counter()
            self._requests.write(HEADER.pack(len(request)) + request)
            self._requests.flush()
            reply = read_reply(self._replies, deadline)
            self.cost.add(time.perf_counter() - sent, reply.get("step_s"))
        except (SandboxFailed, BrokenPipeError, OSError) as e:
            message = str(e) if isinstance(e, SandboxFailed) else self._death(limits)
            self._gpu_suspect |= device == "cuda"
            self._kill()
            output = _read_text(log)
            raise SandboxFailed(f"{step}: {message}", output) from None
        output = _read_text(log)
        if reply.get("error"):
            self._gpu_suspect |= device == "cuda" and "CUDA error" in str(reply["error"])  # e.g. an illegal address
            self._end_child()  # a child that met a bad input never serves another unit; its zygote never saw it
            raise SandboxFailed(str(reply["error"])[:4000], output, retryable=bool(reply.get("retryable")))
        result = reply.get("result")
        if not isinstance(result, dict):
            self._kill()
            raise SandboxFailed(f"{step}: the sandbox answered with {type(result).__name__}, not a mapping", output)
        return {**result, "output": output}

    def prestart(self, limits: UnitLimits, device: str = "cpu") -> None:
        """Start a child now, without waiting for it: the zygote forks it, or, where there is no
        zygote for this device yet, imports torch first while the worker does other things."""
        if self._child_alive():
            return
        self._end_child()  # one that died while idle: its pipes
        if device == "cuda" and self._gpu_suspect:
            self._check_gpu()
        if (self._zygote is None or self._zygote[1:] != (device, max(self._zygote[2], limits.file_gb))
                or self._proc is None or self._proc.poll() is not None or self._zygote_stopped()):
            # none yet, or one for another device, or with a smaller /tmp than this job may fill, or
            # one a child stopped (same uid: SIGSTOP reaches it) that would never fork the next
            self._kill()
            self._start_zygote(device, limits.file_gb)
        self._spawned, self._forked = time.monotonic(), None
        home = self.root() / f"home-{self.starts}"
        home.mkdir()
        jail.make_writable(home)
        startup_log = home / ".startup.log"  # where the child's output goes until its first step
        requests, give_requests = os.pipe()
        read, write = os.pipe()
        request = {"limits": asdict(limits), "home": str(home), "log": str(startup_log), "warm_lowering": self._lowered,
                   "imports": list(self._imports)}
        try:
            socket.send_fds(self._zygote[0], [json.dumps(request).encode()], [requests, write])
        except OSError:  # the zygote is gone: _wait_ready says so, with its start-up log
            pass
        finally:
            os.close(requests)
            os.close(write)
        self._requests = os.fdopen(give_requests, "wb")
        self._replies = read
        self._exits = [code for code in self._exits if code is None] + [None]  # (children the zygote has yet to reap)
        self._started_for = (limits, device)
        self._startup_log, self._home = startup_log, home
        self.starts += 1

    def _start_zygote(self, device: str, file_gb: float) -> None:
        """The zygote for `device`: it imports torch, then forks a child per request."""
        self.isolation = self.isolation or jail.isolation(self.network)
        home = self.root() / f"zygote-{self.starts}"
        home.mkdir()
        jail.make_writable(home)
        env = child_env(home)
        self._env = {k: v for k, v in env.items() if k != "HOME"}
        if device != "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ""  # CPU work never touches (or breaks) the GPU
        else:  # torch's CUDA checks (FakeTensorMode's, on every lowering) ask NVML, which a fork survives:
            env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # the CUDA runtime's answer poisons the zygote's children
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # -P: `-m` would put its cwd (this HOME, which children may write) first on the import path
        # that every later child inherits, so one job's child could plant a module for the next's
        argv = [jail.interpreter(), "-P", "-m", self.zygote_module, str(theirs.fileno()), device]
        self._zygote_log = self.root() / f"zygote-{self.starts}.log"
        with open(self._zygote_log, "wb") as startup:
            how = dict(stdin=subprocess.DEVNULL, stdout=startup, stderr=startup, pass_fds=(theirs.fileno(),),
                       start_new_session=True)
            if self.jailed:
                env, binds = jailed_env(env)
                self._proc = jail.spawn(argv, writable=[self.root(), *binds], home=home, cwd=home, device=device,
                                        network=self.network, tmp_bytes=int(file_gb * (1 << 30)),
                                        env=env, **how)
            else:
                self._proc = subprocess.Popen(argv, cwd=home, env=env, close_fds=True, **how)
        theirs.close()
        self._zygote, self._exits, self._lowered = (ours, device, file_gb), [], self._lowers

    def _zygote_pid(self) -> int | None:
        """The zygote's host pid, looked up in /proc once per zygote (a job switch asks thrice)."""
        if self._zygote_host_pid is None and self._proc is not None:
            self._zygote_host_pid = jail.jailed_pid(self._proc.pid) if self.jailed else self._proc.pid
        return self._zygote_host_pid

    def _zygote_stopped(self) -> bool:
        pid = self._zygote_pid()
        return pid is None or jail.stopped_or_gone(pid)

    def _child_alive(self) -> bool:
        """Whether there is a current child that has not exited (as far as the zygote has said)."""
        if self._requests is None or self._proc is None or self._proc.poll() is not None:
            return False
        self._hear_zygote(0)
        return self._exits[-1] is None

    def _hear_zygote(self, wait_s: float) -> bool:
        """Read what the zygote said (children forked and exited), waiting up to wait_s for the
        first word; False if it said nothing, or is gone."""
        if self._zygote is None:
            return False
        heard = False
        control = self._zygote[0]
        while select.select([control], [], [], 0 if heard else wait_s)[0]:
            try:
                record = control.recv(4096)
            except OSError:
                return heard
            if not record:
                return heard
            said = json.loads(record)
            if "forked" in said:
                self._forked = int(said["forked"])
            if "exited" in said and None in self._exits:
                self._exits[self._exits.index(None)] = int(said["exited"])
            heard = True
        return heard

    def _end_child(self) -> None:
        """Stop the current child, and what it started (its process group), keeping the zygote; in
        a jail, every other process in it too (one the child started in a session of its own), so
        nothing of one job's child outlives it beside the next job's."""
        pid = self.pid
        if pid is not None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.jailed and self._proc is not None and self._proc.poll() is None:
            jail.sweep(self._zygote_pid())
        if self._requests is not None:
            with contextlib.suppress(OSError):
                self._requests.close()
        if self._replies is not None:
            os.close(self._replies)
        self._requests, self._replies, self._spawned = None, None, None
        if self._home is not None:  # its HOME goes with it: the next job's child (same jail) could open it by name
            shutil.rmtree(self._home, ignore_errors=True)
            self._home = None

    def _check_gpu(self) -> None:
        """After a CUDA child crashed or hung: is the GPU still usable? Refuse to start one on it if not."""
        from workers.backends import cuda

        cuda.forget()
        try:
            cuda.own_gpu()
        except cuda.GpuUnavailable as e:
            raise SandboxFailed(f"the GPU failed its check after a sandbox crashed or hung on it: {e}",
                                retryable=True) from None
        self._gpu_suspect = False

    def _wait_ready(self) -> float:
        """Wait for the child's first message (torch imported); how long this call waited."""
        waiting = time.monotonic()
        try:
            ready = read_reply(self._replies, self._spawned + STARTUP_S)
        except (SandboxFailed, OSError) as e:
            zygote = _read_text(self._zygote_log) if self._zygote_log else ""
            output = zygote + (_read_text(self._startup_log) if self._startup_log else "")
            stalled = self._where_the_start_stalled(zygote, closed=isinstance(e, OSError))
            self._kill()  # (which removes the child's HOME, its start-up log with it)
            raise SandboxFailed(f"the sandbox did not start ({e}{stalled})", output, retryable=True) from None
        now = time.monotonic()
        self.cost.start_s += now - self._spawned
        warm = ready.get("warm_up_s")
        self.cost.warm_up_s += float(warm) if isinstance(warm, (int, float)) and 0 <= warm <= now - self._spawned else 0.0
        self._spawned = None
        return now - waiting

    def _where_the_start_stalled(self, output: str, closed: bool) -> str:
        """Where the start of a child that never said it was ready stalled: the zygote's end, with
        its last words (bubblewrap's or Python's: the pipe closes as it exits), or whether it
        forked the child (it found read_exact's deadline read before the pipe)."""
        if self._proc is None:
            return ""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=2 if closed else 0)  # a closed pipe: the zygote may be exiting
        if self._proc.poll() is not None:
            last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "")
            said = f": {last[:300]}" if last else " (it wrote nothing)"
            return f"; its zygote exited with status {self._proc.returncode}{said}"
        self._hear_zygote(0)
        if self._forked is not None:
            return f"; its zygote forked it as pid {self._forked}, which never said it was ready"
        earlier = sum(code is None for code in self._exits[:-1])
        return "; its zygote had not forked it" + (f": {earlier} earlier child(ren) of it not yet exited" if earlier
                                                   else " (still importing torch, or stuck before its fork)")

    def _death(self, limits: UnitLimits) -> str:
        """Why the child died, once it has: as its zygote saw it, or, where the zygote went too, as
        the zygote ended."""
        deadline = time.monotonic() + 10
        while self._exits and self._exits[-1] is None and time.monotonic() < deadline:
            self._hear_zygote(deadline - time.monotonic())
            if self._proc.poll() is not None:
                break
        code = self._exits[-1] if self._exits else None
        if code is None:
            try:
                code = self._proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return "the sandbox stopped answering"
            if code > 128 and self.jailed:
                code = 128 - code  # bubblewrap exits with 128 + the signal that ended its child
        return exit_reason(code, limits)

    def _kill(self) -> None:
        """Stop the child and its zygote (in a jail, bubblewrap's whole PID namespace goes with it)."""
        self._end_child()
        if self._zygote is not None:
            self._zygote[0].close()
            self._zygote = None
        if self._proc is None:
            return
        if self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._proc = self._zygote_host_pid = None

    def interrupt(self) -> None:
        """From another thread: kill the child (and the compilers it started) now. The thread in
        `call` then fails with SandboxFailed and cleans up; the next call starts a fresh child."""
        pid, zygote = self.pid, self._proc
        if pid is None and zygote is not None and zygote.poll() is None:
            pid = zygote.pid  # no child forked yet: the zygote, which the waiting call then finds gone
        if pid is not None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def restart_if_environment_changed(self) -> None:
        """Between jobs: a child started under another environment than a fresh one would get now
        (a changed TORCHINDUCTOR_CACHE_DIR, CXX, ...) is stopped; the next call starts one. Never
        within a job: the parent's own Inductor sets TORCHINDUCTOR_CACHE_DIR to its default as it
        goes, which changes nothing the child sees."""
        if self._proc is not None and self._env != {k: v for k, v in child_env(Path()).items() if k != "HOME"}:
            self._kill()

    def yield_cpu(self, niceness: int) -> None:
        """Run this child's steps, and those of the children after it until `renew`, at this
        niceness: a farm service's nightly units yield the CPU to an interactive job's on the same
        node (scheduler/fair.py, NICENESS). Only ever raised for a child: an unprivileged process
        cannot lower it again, so `renew` (a fresh child) goes back to 0."""
        self.niceness = max(self.niceness, niceness)

    def _renice(self) -> None:
        """The child at the niceness `yield_cpu` set (workers/sandbox/policing.py says how)."""
        pid = self.pid
        if self.niceness and pid:
            renice(pid, self.niceness)

    def wait_started(self) -> None:
        """Wait for the child `prestart` began (its zygote importing torch), as a worker starts; a
        failed start is left for the next call, which starts another and says why if it fails too."""
        if self._spawned is not None:
            with contextlib.suppress(SandboxFailed):
                self._wait_ready()

    def renew(self) -> None:
        """After a job: its child never serves another job. A fresh one starts now, with the same
        limits, so the next job finds it warm."""
        self.niceness = 0
        if self._requests is not None and self._started_for is not None:
            self.retire(*self._started_for)

    def stop_child(self) -> None:
        """Stop the child and its zygote, starting none (nothing of torch stays in memory): the
        next call starts both afresh."""
        self.niceness = 0
        self._kill()

    def retire(self, limits: UnitLimits, device: str = "cpu") -> None:
        """Replace the child with a fresh one (forked now, warm by the next call)."""
        self._end_child()
        self.prestart(limits, device)

    def close(self) -> None:
        self._kill()
        if self._base is not None:
            shutil.rmtree(self._base, ignore_errors=True)


def _same_child(a: tuple[UnitLimits, str], b: tuple[UnitLimits, str]) -> bool:
    """Whether a child started for a's limits and device serves b (the limits set as it starts)."""
    return (a[0].memory_gb, a[0].file_gb, a[1]) == (b[0].memory_gb, b[0].file_gb, b[1])


def _read_text(path: Path, limit: int = 1 << 20) -> str:
    """The child's output for one step (the tail, if it wrote more than limit bytes)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            text = f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""
    return text if size <= limit else f"[... {size - limit} bytes cut ...]\n{text}"
