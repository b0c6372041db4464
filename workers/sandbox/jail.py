"""The jail a sandbox child runs in: bubblewrap namespaces, an unprivileged uid and a syscall
filter, so that code a graph might one day smuggle into a lowering finds nothing to steal and
nowhere to go.

Inside, the child sees a read-only view of only what a lowering needs (the system's /usr and a
few files of /etc, the Python install, the project's packages), an empty HOME, a private /tmp,
its own PID, IPC and UTS namespaces, and no network (a gang's children keep the host network,
for their collectives: see `Isolation.network`). It may write in two places: its sandbox's
work root (the units' temp dirs and its HOME) and its own Inductor cache. Nothing of the
worker's home, cloud configuration, Ray session dirs, the store or the signing key is visible.

A worker running as root starts bubblewrap as root (the mounts need it) and the child drops to
uid/gid 65534 with `setpriv` before Python starts; as another user, bubblewrap makes a user
namespace and the child keeps that user's uid. Either way the child's uid on the host is not 0.
The seccomp filter (libseccomp, through pyseccomp) denies what a compile never does.

    FARM_SANDBOX=jail     children run jailed; a worker that cannot jail refuses to start
    FARM_SANDBOX=process  plain child processes (the limits and the clean environment only)
    unset                 jail where it works; otherwise process, said loudly once
"""
from __future__ import annotations

import errno
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence, Tuple, Union

log = logging.getLogger(__name__)

PROJECT = Path(__file__).resolve().parents[2]
NOBODY = 65534
# /etc is not bound whole: only what the loader, the compilers and Python's user lookups read.
ETC = ("alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "passwd", "group", "nsswitch.conf",
       "localtime", "hosts", "gai.conf")
SYSTEM_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")  # symlinks into /usr on merged-/usr systems
# Denied with EPERM: nothing a compile, a check or a benchmark calls.
DENIED = ("ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "chroot", "setns",
          "unshare", "bpf", "perf_event_open", "keyctl", "add_key", "request_key", "kexec_load", "kexec_file_load",
          "init_module", "finit_module", "delete_module", "reboot", "swapon", "swapoff", "acct", "quotactl",
          "settimeofday", "clock_settime", "adjtimex", "syslog", "iopl", "ioperm", "userfaultfd",
          "open_by_handle_at", "name_to_handle_at", "fsopen", "fsmount", "fsconfig", "fspick", "move_mount",
          "open_tree", "io_uring_setup", "io_uring_enter", "io_uring_register", "lookup_dcookie")
CLONE_NEWUSER = 0x10000000
MODES = ("jail", "process")
Writable = Union[Path, Tuple[Path, Path]]  # a dir bound at its own path, or (host dir, path inside)


class JailUnavailable(RuntimeError):
    """FARM_SANDBOX=jail on a host where a jail cannot start: the worker refuses to run."""


@dataclass(frozen=True)
class Isolation:
    """What a sandbox child was started under: recorded in every manifest and by `farm resources`."""
    mode: str  # "jail" or "process"
    uid: int  # the child's uid on the host
    network: str  # "none"; "host" (a gang's children, for their collectives; process mode)
    seccomp: bool
    why: str | None = None  # process mode: why no jail

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def describe(isolation: Isolation) -> str:
    if isolation.mode == "process":
        return f"not jailed: a plain child process ({isolation.why})"
    net = "no network" if isolation.network == "none" else "the host's network, for a gang's collectives"
    return f"jailed by bubblewrap (uid {isolation.uid}, {net}, seccomp {'on' if isolation.seccomp else 'off'})"


def asked() -> str | None:
    """FARM_SANDBOX, checked; None when unset."""
    value = os.environ.get("FARM_SANDBOX", "").strip().lower()
    if value and value not in MODES:
        raise ValueError(f"FARM_SANDBOX={value!r}: use 'jail' or 'process' (or leave it unset: jail where it works)")
    return value or None


def child_uid() -> int:
    return NOBODY if os.getuid() == 0 else os.getuid()


def isolation(network: bool = False) -> Isolation:
    """How this worker's children run (raises JailUnavailable under FARM_SANDBOX=jail where no jail starts)."""
    mode = asked()
    if mode == "process":
        return Isolation("process", os.getuid(), "host", False, "FARM_SANDBOX=process")
    problem = problem_here()
    if problem is None:
        return Isolation("jail", child_uid(), "host" if network else "none", True)
    message = (f"sandbox children cannot be jailed on this host: {problem}. Install bubblewrap (apt-get install "
               "bubblewrap) and allow user namespaces (see README, 'The jail'), or set FARM_SANDBOX=process to "
               "run them as plain processes")
    if mode == "jail":
        raise JailUnavailable(message)
    _say_once(message)
    return Isolation("process", os.getuid(), "host", False, problem)


@functools.cache
def _say_once(message: str) -> None:
    log.warning("UNJAILED: %s; running them unjailed (FARM_SANDBOX is unset)", message)
    print(f"farm: WARNING: {message}; running them unjailed (FARM_SANDBOX is unset)", file=sys.stderr, flush=True)


@functools.cache
def problem_here() -> str | None:
    """Why a jail cannot start on this host, or None: found by starting one (`true` inside)."""
    if not sys.platform.startswith("linux"):
        return f"jails need Linux namespaces (this is {sys.platform})"
    missing = [tool for tool in ("bwrap", "setpriv" if os.getuid() == 0 else "") if tool and not shutil.which(tool)]
    if missing:
        return f"{' and '.join(missing)} not found on PATH"
    try:
        filter_bpf()
    except (OSError, ImportError, RuntimeError, ValueError) as e:
        return f"no seccomp filter ({type(e).__name__}: {e}); libseccomp2 and pyseccomp are needed"
    with tempfile.TemporaryDirectory(prefix="farm-jail-probe-") as root:
        make_writable(Path(root))
        try:
            proc = spawn(["/bin/true"], writable=[Path(root)], home=Path(root), cwd=Path(root),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            out, _ = proc.communicate(timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"bubblewrap did not start ({e})"
    if proc.returncode != 0:
        return f"bubblewrap failed: {out.decode(errors='replace').strip()[-500:] or f'exit status {proc.returncode}'}"
    return None


@functools.cache
def filter_bpf() -> bytes:
    """The seccomp program (BPF) bubblewrap installs before the child's first instruction."""
    import pyseccomp as sc

    f = sc.SyscallFilter(defaction=sc.ALLOW)
    for name in DENIED:
        try:
            f.add_rule(sc.ERRNO(errno.EPERM), name)
        except (RuntimeError, ValueError):  # not a syscall on this architecture
            pass
    f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER))
    # clone3 passes its flags in memory, out of a filter's reach: ENOSYS makes libc use clone
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read()


def make_writable(path: Path) -> None:
    """A dir the jailed child may write in (it runs as another uid when the worker is root)."""
    if os.getuid() == 0:
        os.chown(path, NOBODY, NOBODY)


def hand_over(workdir: Path) -> None:
    """Let a child of another uid read what the worker put in its work dir (the store's fetches
    are private to their owner)."""
    if child_uid() == os.getuid():
        return
    for dirpath, dirnames, filenames in os.walk(workdir):
        for name in filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if st.st_uid == os.getuid() and not os.path.islink(p):
                os.chmod(p, st.st_mode | 0o044)
        dirnames[:] = [d for d in dirnames if os.lstat(os.path.join(dirpath, d)).st_uid == os.getuid()]
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), 0o755)


def _dirs(path: Path) -> list[str]:
    """bubblewrap makes missing mount points 0700, which the child's uid could not pass through."""
    return [a for p in reversed(path.parents) if str(p) != "/" for a in ("--perms", "0755", "--dir", str(p))]


def interpreter() -> str:
    """This Python by a path the jail has: its bin dir with symlinks resolved, as the jail binds
    sys.prefix (a `.venv` that is a link to another dir failed every sandbox: bubblewrap found no
    `.venv/bin/python` to run), its own name kept (a venv's `python` links to the base interpreter,
    which finds the venv only when started by the venv's path)."""
    exe = Path(sys.executable)
    return str(exe.parent.resolve() / exe.name)


def _read_only() -> list[str]:
    args: list[str] = ["--ro-bind", "/usr", "/usr"]
    for name in SYSTEM_LINKS:
        p = Path("/") / name
        if p.is_symlink():
            args += ["--symlink", os.readlink(p), str(p)]
        elif p.is_dir():
            args += ["--ro-bind", str(p), str(p)]
    args += [a for name in ETC if (Path("/etc") / name).exists() for a in ("--ro-bind", f"/etc/{name}", f"/etc/{name}")]
    trees = {Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve(), Path(sys.executable).resolve().parent}
    # of the checkout, its Python packages only (not .git, keys or local stores); a job's `modules`
    # may live on PYTHONPATH too
    trees |= {p for p in PROJECT.iterdir() if (p / "__init__.py").is_file()}
    trees |= {Path(p).resolve() for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
              if p and Path(p).is_dir() and Path(p).resolve() != PROJECT}
    for tree in sorted(trees, key=lambda p: len(p.parts)):
        if not any(tree.is_relative_to(t) for t in trees if t != tree) and not tree.is_relative_to("/usr"):
            args += [*_dirs(tree), "--ro-bind", str(tree), str(tree)]
    return args


def _devices(device: str) -> list[str]:
    if device != "cuda":
        # the CPU's topology only: torch's default thread count and the cache sizes that
        # Inductor's CPU GEMM templates block for are read there; without it, the child's code and
        # timings would differ from what the host itself runs
        # (its parents 0755: a 0700 /sys would make gloo's scan of /sys/bus fail with EACCES, not ENOENT)
        cpu = "/sys/devices/system/cpu"
        return [*_dirs(Path(cpu)), "--ro-bind", cpu, cpu] if os.path.isdir(cpu) else []
    # the driver's nodes only: /dev/nvidia0.., nvidiactl, nvidia-uvm(-tools), nvidia-caps
    return [a for p in sorted(Path("/dev").glob("nvidia*")) for a in ("--dev-bind", str(p), str(p))] + \
        ["--ro-bind", "/sys", "/sys"]


def command(argv: Sequence[str], *, writable: Sequence[Writable], home: Path, device: str = "cpu",
            network: bool = False, tmp_bytes: int = 1 << 30, seccomp_fd: int | None = None) -> list[str]:
    """The bubblewrap command line that runs argv jailed (see the module's docstring)."""
    # /tmp first: the project or its venv may live under it (a clone in /tmp), bound in after
    args = ["bwrap", "--size", str(tmp_bytes), "--perms", "1777", "--tmpfs", "/tmp", *_read_only(), "--dev", "/dev",
            *_devices(device), "--proc", "/proc"]
    for path in writable:
        source, inside = path if isinstance(path, tuple) else (path, path)
        args += [*_dirs(inside), "--bind", str(source), str(inside)]
    args += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent",
             "--new-session", "--setenv", "HOME", str(home), "--setenv", "TMPDIR", "/tmp",
             "--setenv", "FARM_JAIL_TMP", "/tmp", "--chdir", str(home)]
    if not network:
        args.append("--unshare-net")
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    if os.getuid() == 0:  # mounts need root; the child does not
        args += ["--", "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all",
                 "--bounding-set=-all", "--no-new-privs"]
    else:
        args += ["--unshare-user", "--cap-drop", "ALL", "--disable-userns"]
    return [*args, "--", *argv]


def spawn(argv: Sequence[str], *, writable: Sequence[Writable], home: Path, cwd: Path, device: str = "cpu",
          network: bool = False, tmp_bytes: int = 1 << 30, env: dict[str, str] | None = None,
          pass_fds: Sequence[int] = (), **popen: Any) -> subprocess.Popen:
    """Start argv jailed: the one way the farm starts a jailed process (the sandbox's children,
    and the tests that prove the walls)."""
    seccomp = os.memfd_create("farm-seccomp", 0)
    try:
        os.write(seccomp, filter_bpf())
        os.lseek(seccomp, 0, os.SEEK_SET)
        cmd = command(argv, writable=writable, home=home, device=device, network=network, tmp_bytes=tmp_bytes,
                      seccomp_fd=seccomp)
        return subprocess.Popen(cmd, cwd=cwd, env=env, pass_fds=(*pass_fds, seccomp), **popen)
    finally:
        os.close(seccomp)


def first_child(pid: int) -> int | None:
    """The first child of pid (a host pid), or None: it has none, or is gone."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def proc_stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command's name (state, parent pid, ...); [] once gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def stopped_or_gone(pid: int) -> bool:
    """Whether pid (a host pid) is stopped by a signal, traced or gone: such a zygote forks
    nothing, and the worker's next call would wait out its start-up limit."""
    return proc_stat(pid)[:1] in (["T"], ["t"], [])


def sweep(zygote: int | None) -> None:
    """SIGKILL every process in the zygote's PID namespace but the zygote and the namespace's init
    (workers/sandbox/zygote.py: nothing a job's child left running meets the next job's)."""
    if zygote is None:
        return
    try:
        namespace = os.readlink(f"/proc/{zygote}/ns/pid")
        keep = {zygote, int(proc_stat(zygote)[1])}
    except (OSError, ValueError, IndexError):
        return
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) in keep:
            continue
        try:
            if os.readlink(f"/proc/{entry.name}/ns/pid") == namespace:
                os.kill(int(entry.name), signal.SIGKILL)
        except OSError:  # gone meanwhile, or not ours to look at
            pass


def jailed_pid(bwrap_pid: int, wait_s: float = 2.0) -> int | None:
    """The host pid of the jailed command: bubblewrap's child is the new PID namespace's init,
    whose child is the command (setpriv execs it in place). Waits the moment bubblewrap takes to
    get there; None if bubblewrap is gone."""
    deadline = time.monotonic() + wait_s
    while True:
        pid: int | None = bwrap_pid
        for _ in range(2):
            if not Path(f"/proc/{pid}").exists():
                return None
            pid = first_child(pid)
            if pid is None:
                break
        if pid is not None or time.monotonic() > deadline:
            return pid
        time.sleep(0.01)
