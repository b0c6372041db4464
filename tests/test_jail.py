"""The sandbox's jail (issue 29): code of the test's own, run in a jailed child started by the
same function the sandbox starts its children with (workers/sandbox/jail.py `spawn`), finds no
credentials to read, no network, no worker to see and nowhere to write but its unit's dir; and a
real lowering's child, looked at through /proc while it compiles, runs as a non-root uid in
namespaces of its own."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from workers.sandbox import jail
from workers.sandbox.env import header_dir, jailed_env
from workers.sandbox.process import Sandbox

pytestmark = pytest.mark.skipif(jail.problem_here() is not None,
                                reason=f"no jail on this host: {jail.problem_here()} (./dev installs bubblewrap as root)")

# Runs jailed; prints what each attempt gave ("ok" or the error), as JSON.
PROBE = textwrap.dedent("""
    import ctypes, json, os, socket, sys
    tries = json.loads(sys.argv[1])
    libc = ctypes.CDLL(None, use_errno=True)

    def attempt(kind, arg):
        try:
            if kind == "read":
                open(arg).read()
            elif kind == "list":
                os.listdir(arg)
            elif kind == "write":
                open(arg, "w").write("x")
            elif kind == "connect":
                socket.create_connection((arg[0], arg[1]), timeout=2).close()
            elif kind == "resolve":
                socket.getaddrinfo(arg, 443)
            elif kind == "signal":
                os.kill(arg, 0)
            elif kind == "syscall":  # unshare(CLONE_NEWUSER), ptrace(PTRACE_TRACEME), mount
                rc = {"unshare": lambda: libc.unshare(0x10000000), "ptrace": lambda: libc.ptrace(0, 0, None, None),
                      "mount": lambda: libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)}[arg]()
                if rc != 0:
                    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
            return "ok"
        except Exception as e:
            return f"{type(e).__name__}: {e}"

    print(json.dumps({"uid": os.getuid(), "pid": os.getpid(), "devices": sorted(os.listdir("/dev")),
                      "tries": [attempt(k, a) for k, a in tries]}))
""")


def run_jailed(tries: list, tmp: Path, network: bool = False) -> dict:
    """PROBE in a jail like a sandbox child's: its unit's dir writable, nothing else."""
    unit = tmp / "unit"
    unit.mkdir()
    jail.make_writable(unit)
    proc = jail.spawn([sys.executable, "-c", PROBE, json.dumps(tries)], writable=[unit], home=unit, cwd=unit,
                      network=network, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()[-2000:]
    return json.loads(out.decode().strip().splitlines()[-1])


@pytest.fixture
def canaries(tmp_path):
    """A credentials file in the worker's home, a Ray token under ~/.ray and a signing key in
    the project's checkout, each with a secret in it; removed afterwards."""
    home, tag = Path.home(), uuid.uuid4().hex[:8]
    made = [home / f".farm-canary-{tag}" / "credentials", home / ".ray" / f"farm-canary-{tag}-auth_token",
            Path(__file__).resolve().parents[1] / f".farm-canary-{tag}-signing.pem"]
    for path in made:
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"secret-{tag}")
        path.chmod(0o644)  # readable to anyone on the host: only the jail keeps the child out
    yield made
    for path in made:
        path.unlink()
        if path.parent.name.startswith(".farm-canary-"):
            path.parent.rmdir()


def test_a_jailed_child_reads_no_credentials_and_writes_only_its_unit_dir(canaries, tmp_path):
    project = Path(__file__).resolve().parents[1]
    tries = [*[("read", str(p)) for p in canaries], ("list", str(canaries[0].parent)),
             ("read", str(project / ".git" / "config")),
             ("write", str(tmp_path / "outside")), ("write", str(project / "workers" / "planted.py")),
             ("write", str(Path.home() / "planted")), ("write", "/usr/lib/planted"),
             ("write", str(tmp_path / "unit" / "inside")), ("write", "/tmp/private")]
    got = run_jailed(tries, tmp_path)["tries"]
    *refused, inside, private = got
    assert not [(t, r) for t, r in zip(tries, refused) if r == "ok"], list(zip(tries, refused))
    assert inside == "ok" and (tmp_path / "unit" / "inside").read_text() == "x"  # the unit's dir is its own
    assert private == "ok" and not Path("/tmp/private").exists()  # its /tmp is its own
    assert not (tmp_path / "outside").exists() and not (project / "workers" / "planted.py").exists()


def test_a_jailed_child_has_no_network_sees_no_worker_and_no_gpu(tmp_path):
    server = socket.create_server(("127.0.0.1", 0))  # a port of the worker's, like the store's or Ray's
    try:
        tries = [("connect", ["127.0.0.1", server.getsockname()[1]]), ("connect", ["169.254.169.254", 80]),
                 ("connect", ["1.1.1.1", 443]), ("resolve", "s3.amazonaws.com"), ("signal", os.getpid()),
                 ("signal", os.getppid()), ("list", f"/proc/{os.getpid()}"),
                 ("syscall", "unshare"), ("syscall", "ptrace"), ("syscall", "mount")]
        got = run_jailed(tries, tmp_path)
    finally:
        server.close()
    assert not [(t, r) for t, r in zip(tries, got["tries"]) if r == "ok"], list(zip(tries, got["tries"]))
    assert "Operation not permitted" in got["tries"][7]  # the syscall filter (or no capability) says no
    assert got["uid"] != 0 and got["pid"] < 10  # not root; PIDs of its own
    assert not [d for d in got["devices"] if d.startswith(("nvidia", "dri"))]  # a CPU child sees no GPU


def test_a_jailed_child_sees_the_cpus_topology_and_no_more_of_sys(tmp_path):
    """torch's default thread count and Inductor's cache sizes come from /sys/devices/system/cpu;
    the rest of /sys is absent (ENOENT, which gloo's scan of /sys/bus tolerates; EACCES it does not)."""
    got = run_jailed([("list", "/sys/devices/system/cpu"), ("list", "/sys/bus/pci/devices"), ("list", "/sys/class/net")],
                     tmp_path)["tries"]
    assert got[0] == "ok" and all(r.startswith("FileNotFoundError") for r in got[1:]), got


def test_a_gangs_child_keeps_the_network_its_collectives_need(tmp_path):
    server = socket.create_server(("127.0.0.1", 0))
    try:
        got = run_jailed([("connect", ["127.0.0.1", server.getsockname()[1]]), ("read", str(Path.home() / ".bashrc"))],
                         tmp_path, network=True)
    finally:
        server.close()
    assert got["tries"][0] == "ok"  # its peers are reachable
    assert got["tries"][1] != "ok"  # the rest of the jail stands
    assert jail.isolation(network=True).network == "host"


def test_a_lowering_runs_jailed_and_its_manifest_says_so(zoo_dir, tmp_path, monkeypatch):
    """The issue's acceptance: while a compile lowers, its child is seen through /proc with a
    non-zero uid, in network and mount namespaces of its own; the manifest records it. Its
    Inductor cache dir is a fresh one, yet its kernels build with the node's precompiled headers."""
    from scheduler.jobs import execute, run_units_in
    from scheduler.spec import parse_job
    from storage import store_from_uri

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "fresh-cache"))
    store, seen, sandbox = store_from_uri(str(tmp_path / "store")), [], Sandbox()
    done = threading.Event()

    def watch() -> None:  # what an operator would look at, from the host
        while not done.is_set():
            pid = sandbox.pid
            try:
                status = Path(f"/proc/{pid}/status").read_text() if pid is not None else ""
                # once Python runs (before, bubblewrap's fork and setpriv are root for the moment they take
                # to drop to the child's uid)
                if status.startswith("Name:\tpython"):
                    uid = int(status.split("\nUid:")[1].split()[0])
                    ns = {n: os.readlink(f"/proc/{pid}/ns/{n}") for n in ("net", "mnt", "pid")}
                    seen.append((uid, ns))
            except (OSError, IndexError):
                pass  # between children
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        job = parse_job({"graphs": [str(zoo_dir / "mlp.pt2")], "targets": ["inductor-cache:avx2"]})
        (result,) = execute(job, store, lambda units, s, events: run_units_in(sandbox, units, s, events)).results
    finally:
        done.set()
        watcher.join()
        sandbox.close()
    assert result.status == "compiled", result.error
    ours = {n: os.readlink(f"/proc/self/ns/{n}") for n in ("net", "mnt", "pid")}
    assert seen and all(uid != 0 for uid, _ in seen)
    assert all(ns[n] != ours[n] for _, ns in seen for n in ours)
    isolation = store.get_manifest(result.key)["isolation"]
    assert isolation == {"mode": "jail", "uid": seen[0][0], "network": "none", "seccomp": True}
    # the headers are the node's, as an unjailed Inductor's are: a fresh cache dir builds no set of its own
    assert list((tmp_path / "fresh-cache").rglob("*.cpp")) and not list((tmp_path / "fresh-cache").rglob("*.gch"))
    assert list(header_dir().glob("*.h.gch"))


# Names a program in a jailed sandbox of its own: what every unit does first.
IDENTIFY = textwrap.dedent("""
    import json, shutil, sys, time
    from workers.sandbox.process import Sandbox
    from workers.unit import Target, Unit, UnitLimits
    unit = Unit(graph="mlp", source="mlp.pt2", target=Target("aoti-cpu"), program=None)
    with Sandbox() as sandbox, sandbox.workdir() as workdir:
        reply = sandbox.call("identify", workdir, UnitLimits(), time.monotonic() + 120, unit=unit,
                             program=shutil.copy(sys.argv[1], workdir))
        print(json.dumps({"jailed": sandbox.jailed, "program": len(reply["identity"]["program"])}))
""")


def test_a_venv_reached_through_a_link_runs_jailed_sandboxes(zoo_dir, tmp_path):
    """A `.venv` that is a link to another dir (an environment shared between checkouts): the jail
    binds where the link leads, and the sandbox starts Python by that path. (Bubblewrap found no
    Python at the link's path, and every unit failed: 'the sandbox closed its reply pipe'.)"""
    linked = tmp_path / "venv-link"
    linked.symlink_to(Path(sys.prefix).resolve(), target_is_directory=True)
    python = linked / "bin" / Path(sys.executable).name
    root = Path(__file__).parents[1]
    out = subprocess.run([str(python), "-c", IDENTIFY, str(zoo_dir / "mlp.pt2")], cwd=root, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == {"jailed": True, "program": 64}


def test_a_bench_can_give_each_side_a_node_of_its_own(tmp_path, monkeypatch):
    """FARM_NODE_CACHE, for a bench's cold sides: a jailed child's headers and host records go there
    instead, and the child is told where it finds the records."""
    monkeypatch.setenv("FARM_NODE_CACHE", str(tmp_path / "node"))
    env, binds = jailed_env({"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")})
    inside = Path("/tmp") / f"torchinductor_{env['USER']}"
    for name in ("precompiled_headers", "farm-host-checks"):
        (source,) = [src for src, dest in binds if dest == inside / name]
        assert source.is_relative_to(tmp_path / "node") and source.is_dir()
    assert header_dir().is_relative_to(tmp_path / "node") and env["FARM_SHARED_CACHE"] == str(inside)


def test_a_host_that_cannot_jail_refuses_under_jail_and_says_so_loudly_otherwise(monkeypatch, tmp_path, capfd):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap, no setpriv
    jail.problem_here.cache_clear()
    jail._say_once.cache_clear()
    try:
        monkeypatch.setenv("FARM_SANDBOX", "jail")
        with pytest.raises(jail.JailUnavailable, match="bwrap.*not found.*apt-get install bubblewrap"):
            jail.isolation()
        monkeypatch.delenv("FARM_SANDBOX")
        isolation = jail.isolation()
        assert isolation.mode == "process" and "not found" in isolation.why
        assert "WARNING" in capfd.readouterr().err  # once, on stderr, with what to install
        monkeypatch.setenv("FARM_SANDBOX", "prison")
        with pytest.raises(ValueError, match="FARM_SANDBOX='prison': use 'jail' or 'process'"):
            jail.isolation()
    finally:
        jail.problem_here.cache_clear()
        jail._say_once.cache_clear()


def test_farm_resources_says_how_children_are_isolated(monkeypatch):
    from typer.testing import CliRunner

    from farm.cli import app

    got = CliRunner().invoke(app, ["resources", "--slots", "2"])
    assert got.exit_code == 0, got.output
    assert "jailed by bubblewrap" in got.stderr and json.loads(got.stdout)
    monkeypatch.setenv("FARM_SANDBOX", "process")
    assert "not jailed: a plain child process (FARM_SANDBOX=process)" in CliRunner().invoke(app, ["resources"]).stderr


def test_farm_resources_says_when_torch_has_no_bytecode_a_process_can_use(tmp_path, monkeypatch):
    """A torch installed without bytecode has its sources compiled by every sandbox child as it
    starts, since children never write bytecode (10.5 s a process on a lent GPU host): the node's
    set-up says so, with the command that fixes it; with bytecode that matches, nothing."""
    import py_compile

    from typer.testing import CliRunner

    from farm.cli import app
    from workers import torch_files

    fake = tmp_path / "torch"
    for name in torch_files.BYTECODE_SAMPLE:
        (fake / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / name).write_text("X = 1\n")
    monkeypatch.setattr(torch_files, "torch_dir", lambda: fake)
    said = CliRunner().invoke(app, ["resources"]).stderr
    assert "torch's modules have no bytecode here" in said and f"-m compileall -q -j 0 {fake}" in said
    for name in torch_files.BYTECODE_SAMPLE:
        py_compile.compile(str(fake / name), doraise=True)
    assert torch_files.unusable_bytecode() == [] and "bytecode" not in CliRunner().invoke(app, ["resources"]).stderr
    (fake / "__init__.py").write_text("X = 2  # changed since it was compiled\n")
    assert torch_files.unusable_bytecode() == ["__init__.py"]


def test_a_warm_child_serves_one_job_and_its_tmp_is_wiped_between_units(zoo_dir, tmp_path):
    """A new job gets a fresh child (started when the last job ended); within a job, what a unit
    left in the child's private /tmp is gone before the next unit (looked at from the host,
    through /proc/PID/root)."""
    import shutil

    from scheduler import jobs, kept_sandbox
    from scheduler.spec import parse_job
    from storage import store_from_uri
    from workers.unit import Target, Unit, UnitLimits

    class Served(jobs.NoEvents):
        def __init__(self) -> None:
            self.pids: set[int | None] = set()

        def finished(self, unit, result) -> None:
            self.pids.add(kept_sandbox.KEPT.pid)

    served = [Served(), Served()]
    for n, events in enumerate(served):  # one program, two stores: both jobs lower it
        # core-aten: which target is beside the point here, and it builds no C++
        job = parse_job({"graphs": [str(zoo_dir / "mlp.pt2")], "targets": ["core-aten"]})
        assert jobs.execute(job, store_from_uri(str(tmp_path / f"store-{n}")), events=events).results[0].status == "compiled"
    assert len(served[0].pids) == 1 and served[0].pids.isdisjoint(served[1].pids)

    unit = Unit(graph="mlp", source="mlp.pt2", target=Target("aoti-cpu"), program=None)
    with Sandbox() as sandbox, sandbox.workdir() as first, sandbox.workdir() as second:
        for n, workdir in enumerate((first, second)):
            sandbox.call("identify", workdir, UnitLimits(), time.monotonic() + 120, unit=unit,
                         program=shutil.copy(zoo_dir / "mlp.pt2", workdir))
            tmp = Path(f"/proc/{sandbox.pid}/root/tmp")
            if n == 0:
                (tmp / "left-by-the-first-unit").write_text("x")
                os.chown(tmp / "left-by-the-first-unit", jail.child_uid(), jail.child_uid())  # as the unit would
        assert not (tmp / "left-by-the-first-unit").exists()
        assert list(tmp.glob("torchinductor_*"))  # its Inductor cache (bound in) stays
