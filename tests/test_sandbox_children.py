"""A sandbox's children (issues 9 and 29): a child holds no credentials and works in its unit's
dir under its limits; each job gets a fresh child forked by one zygote, which imported torch once;
a child that met a bad input, or whose zygote initialized CUDA, is replaced; a start that stalls
says where; a child started ahead serves however late the next job comes, and one given up before
its fork is never forked; a zygote warms the lowering once its children lower. No Ray here
(crashing artifacts, on Ray too: tests/test_sandbox.py)."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from scheduler.jobs import execute
from scheduler.spec import parse_job
from storage import store_from_uri
from workers.sandbox.env import child_env
from workers.sandbox.process import Sandbox
from workers.unit import UnitLimits

pytestmark = pytest.mark.slow


def test_the_child_holds_no_credentials_and_works_in_the_unit_dir(monkeypatch, tmp_path, zoo_dir):
    secrets = {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": "s3cr3t", "AWS_SESSION_TOKEN": "tok",
               "RAY_AUTH_TOKEN": "raytoken", "FARM_SIGNING_KEY": "/keys/signing.pem", "GITHUB_TOKEN": "gh"}
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    assert not set(secrets) & set(child_env(tmp_path))
    from workers.unit import Target, Unit

    unit = Unit(graph="mlp", source="mlp.pt2", target=Target("aoti-cpu"), program=None)
    with Sandbox() as sandbox, sandbox.workdir() as workdir:
        reply = sandbox.call("identify", workdir, UnitLimits(), time.monotonic() + 120, unit=unit,
                             program=shutil.copy(zoo_dir / "mlp.pt2", workdir))
        assert len(reply["identity"]["program"]) == 64
        env = dict(line.split("=", 1) for line in
                   Path(f"/proc/{sandbox.pid}/environ").read_bytes().decode().split("\0") if "=" in line)
        cwd = os.readlink(f"/proc/{sandbox.pid}/cwd")
        assert Path(env["HOME"]) != Path.home() and not any(Path(env["HOME"]).iterdir())
    assert not [k for k in env if k.startswith("AWS") or k in secrets], env.keys()
    assert Path(cwd) == workdir


def test_limits_are_set_in_the_child(tmp_path, zoo_dir):
    """Its limits, and the niceness a farm service's nightly units run at (on every thread of the
    child, which what it starts inherits)."""
    from workers.unit import Target, Unit

    limits = UnitLimits(timeout_s=30, memory_gb=6, file_gb=1)
    unit = Unit(graph="mlp", source="mlp.pt2", target=Target("aoti-cpu"), program=None, limits=limits)
    with Sandbox() as sandbox, sandbox.workdir() as workdir:
        sandbox.yield_cpu(10)
        sandbox.call("identify", workdir, limits, time.monotonic() + 120, unit=unit,
                     program=shutil.copy(zoo_dir / "mlp.pt2", workdir))
        text = Path(f"/proc/{sandbox.pid}/limits").read_text()
        tasks = list(Path(f"/proc/{sandbox.pid}/task").iterdir())
        niceness = {int(t.joinpath("stat").read_text().rsplit(")", 1)[1].split()[16]) for t in tasks}
        autogroup = Path(f"/proc/{sandbox.pid}/autogroup")  # its session's share of the CPU, where Linux has them
        assert not autogroup.exists() or autogroup.read_text().split()[-1] == "10", autogroup.read_text()
        sandbox.renew()  # the next job's child starts at the default
        assert sandbox.niceness == 0
    assert tasks and niceness == {10}, niceness  # every thread (a forked child may have one; what it starts inherits)
    rows = {line[:26].strip(): line[26:].split() for line in text.splitlines()[1:]}
    assert rows["Max address space"][0] == str(6 << 30)
    assert rows["Max file size"][0] == str(1 << 30)
    assert rows["Max core file size"][0] == "0"
    assert int(rows["Max cpu time"][0]) <= 30 * (os.cpu_count() or 1) + 60  # this request's budget, not unlimited


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _stray_in_jail_of(pid: int) -> tuple[subprocess.Popen, int]:
    """A process in the jail's PID namespace, in no process group of the child's (nsenter, as root)."""
    stray = subprocess.Popen(["nsenter", "-t", str(pid), "-p", "--", "sleep", "300"], start_new_session=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        inside = Path(f"/proc/{stray.pid}/task/{stray.pid}/children").read_text().split()
        if inside:
            return stray, int(inside[0])
        time.sleep(0.05)
    raise AssertionError("nsenter started nothing in the jail")


def _state(pid: int) -> str:
    """R, S, T (stopped), Z (a zombie), ...; "" once gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def _gone(pid: int, wait_s: float = 10) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if _state(pid) in ("Z", ""):
            return True
        time.sleep(0.05)
    return False


def test_each_job_gets_a_fresh_child_forked_by_the_same_zygote(tmp_path, zoo_dir):
    """No child serves two jobs: `renew` (a job ended) gives a new process, forked by the zygote
    that imported torch once; a stopped sandbox keeps nothing of torch running."""
    from workers.unit import Target, Unit

    unit = Unit(graph="mlp", source="mlp.pt2", target=Target("aoti-cpu"), program=None)
    with Sandbox() as sandbox, sandbox.workdir() as workdir:
        children, strays = [], []
        for job in range(2):
            reply = sandbox.call("identify", workdir, UnitLimits(), time.monotonic() + 120, unit=unit,
                                 program=shutil.copy(zoo_dir / "mlp.pt2", workdir))
            assert len(reply["identity"]["program"]) == 64
            children.append((sandbox.pid, _parent(sandbox.pid)))
            if sandbox.jailed and os.getuid() == 0 and shutil.which("nsenter"):
                strays.append(_stray_in_jail_of(sandbox.pid))  # as if the child had left one running
            sandbox.renew()
            for stray, pid in strays:  # gone with the job's child: nothing of it meets the next job's
                assert _gone(pid), f"process {pid}, left in the jail, outlived its job's child"
                stray.wait(timeout=30)
            # and so is its HOME, which the next job's child (same jail, same uid) could open by name
            assert [h.name for h in sandbox.root().glob("home-*")] == [f"home-{sandbox.starts - 1}"]
        sandbox.call("identify", workdir, UnitLimits(), time.monotonic() + 120, unit=unit,
                     program=shutil.copy(zoo_dir / "mlp.pt2", workdir))  # a third job
        zygote = _parent(sandbox.pid)
        assert len({children[0][0], children[1][0], sandbox.pid}) == 3 and sandbox.starts == 3
        log = sandbox._zygote_log.read_text()
        assert "warmed the lowering" not in log  # no child lowered: nothing paid for it
        frozen = re.search(r"its ([\d,]+) objects are frozen", log)  # torch's heap, which children's collections skip
        assert frozen and int(frozen[1].replace(",", "")) > 100_000, log
        assert children[0][1] == children[1][1] == zygote and not Path(f"/proc/{children[0][0]}").exists()
        os.kill(zygote, signal.SIGSTOP)  # as a child could (same uid): a stopped zygote would fork nothing
        deadline = time.monotonic() + 10
        while _state(zygote) != "T" and time.monotonic() < deadline:  # the signal takes effect as it is scheduled
            time.sleep(0.05)
        sandbox.renew()
        sandbox.call("identify", workdir, UnitLimits(), time.monotonic() + 120, unit=unit,
                     program=shutil.copy(zoo_dir / "mlp.pt2", workdir))  # at once, from a new zygote
        assert _gone(zygote), "the stopped zygote was left in place"
        zygote = _parent(sandbox.pid)
        sandbox.stop_child()
        assert sandbox.pid is None
        deadline = time.monotonic() + 10
        while Path(f"/proc/{zygote}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not Path(f"/proc/{zygote}").exists()


def test_a_refused_input_ends_its_child_and_the_next_is_forked_by_the_same_zygote(zoo_dir):
    """A bad graph in a nightly costs the next unit a fork, not torch's import: the zygote never
    saw the input. The child that met it never serves another unit."""
    from workers.sandbox.process import SandboxFailed
    from workers.unit import Target, Unit

    unit = Unit(graph="mlp", source="mlp.pt2", target=Target("aoti-cpu"), program=None)
    with Sandbox() as sandbox, sandbox.workdir() as workdir:
        sandbox.call("identify", workdir, UnitLimits(), time.monotonic() + 120, unit=unit,
                     program=shutil.copy(zoo_dir / "mlp.pt2", workdir))
        child, zygote = sandbox.pid, _parent(sandbox.pid)
        (workdir / "junk.pt2").write_bytes(b"not a program")
        with pytest.raises(SandboxFailed, match="junk|archive|zip"):
            sandbox.call("identify", workdir, UnitLimits(), time.monotonic() + 120,
                         unit=Unit(graph="junk", source="junk.pt2", target=Target("aoti-cpu"), program=None),
                         program=str(workdir / "junk.pt2"))
        assert sandbox.pid is None and _gone(child)
        sandbox.call("identify", workdir, UnitLimits(), time.monotonic() + 120, unit=unit,
                     program=shutil.copy(zoo_dir / "mlp.pt2", workdir))
        assert sandbox.pid != child and _parent(sandbox.pid) == zygote and sandbox.starts == 2


class _PoisonedZygoteSandbox(Sandbox):
    zygote_module = "tests.poisoned_zygote"


def test_a_cuda_child_whose_zygote_initialized_cuda_starts_a_fresh_python(zoo_dir):
    """A child forked from a process that had initialized CUDA cannot use it ('Cannot re-initialize
    CUDA in forked subprocess': every aoti-cuda unit failed so on a lent H100). A CUDA zygote's
    own checks ask NVML, which a fork survives; should it reach the CUDA runtime anyway (another
    torch, no NVML on the host), the job's child becomes a fresh Python, still in its place."""
    from workers.unit import Target, Unit

    unit = Unit(graph="mlp", source="mlp.pt2", target=Target("aoti-cuda"), program=None)
    with _PoisonedZygoteSandbox() as sandbox, sandbox.workdir() as workdir:
        started = []
        for job in range(2):
            reply = sandbox.call("identify", workdir, UnitLimits(), time.monotonic() + 120, device="cuda",
                                 unit=unit, program=shutil.copy(zoo_dir / "mlp.pt2", workdir))
            assert len(reply["identity"]["program"]) == 64
            zygote = _parent(sandbox.pid)
            assert "workers.sandbox.child" in Path(f"/proc/{sandbox.pid}/cmdline").read_text()
            started += [log.read_text() for log in sandbox.root().glob("home-*/.startup.log")]  # this job's child's
            sandbox.renew()
        environ = Path(f"/proc/{sandbox._zygote_pid()}/environ").read_bytes().split(b"\0")
        assert b"PYTORCH_NVML_BASED_CUDA_CHECK=1" in environ and sandbox._zygote_pid() == zygote
        assert len(started) == 2 and all("starts a fresh Python" in text for text in started), started


class _SilentZygoteSandbox(Sandbox):
    zygote_module = "tests.silent_zygote"


class _UnforkingZygoteSandbox(Sandbox):
    zygote_module = "tests.unforking_zygote"


class _MissingZygoteSandbox(Sandbox):
    zygote_module = "tests.no_such_zygote"


@pytest.mark.parametrize("kind, says", [(_SilentZygoteSandbox, r"its zygote forked it as pid \d+, which never said"),
                                        (_UnforkingZygoteSandbox, "its zygote had not forked it"),
                                        (_MissingZygoteSandbox, "its zygote exited with status 1: .*"
                                                                "No module named tests.no_such_zygote")])
def test_a_child_that_never_starts_fails_the_unit_saying_where_its_start_stalled(kind, says, monkeypatch):
    """A start that stalls (seen once under CI's load: 300 s without a word) fails the unit,
    retryable, saying whether the zygote had forked the child: the cause a next one must show. A
    zygote that exits at once says why in the message, not only in the unit's log (a jail that
    could not exec the venv's Python said only 'the sandbox closed its reply pipe')."""
    from workers.sandbox import process
    from workers.sandbox.process import SandboxFailed
    from workers.unit import UnitLimits

    with kind() as sandbox, sandbox.workdir() as workdir:
        sandbox.prestart(UnitLimits())
        deadline = time.monotonic() + 120  # the zygote imports torch, then forks (or not)
        while kind is _SilentZygoteSandbox and sandbox._forked is None and time.monotonic() < deadline:
            sandbox._hear_zygote(1.0)
        monkeypatch.setattr(process, "STARTUP_S", 3.0)
        with pytest.raises(SandboxFailed, match=f"the sandbox did not start .*{says}") as failed:
            sandbox.call("identify", workdir, UnitLimits(), time.monotonic() + 60, unit=None, program="x.pt2")
        assert failed.value.retryable and sandbox._proc is None  # its zygote stopped: the next call starts one


def test_a_child_started_ahead_serves_a_call_that_comes_after_its_start_limit(zoo_dir, monkeypatch):
    """After a job the next child starts at once (`renew`), and the next job may come much later:
    its first call finds the child's 'ready' waiting, however long ago the start began. (On CI
    every first unit of a job that came over STARTUP_S after the last one failed: 'the sandbox
    did not start (timeout…)' at once.)"""
    import select

    from workers.sandbox import process
    from workers.unit import Target, Unit, UnitLimits

    unit = Unit(graph="mlp", source="mlp.pt2", target=Target("aoti-cpu"), program=None)
    with Sandbox() as sandbox, sandbox.workdir() as workdir:
        sandbox.prestart(UnitLimits())
        assert select.select([sandbox._replies], [], [], 120)[0], "the child said nothing in 120 s"
        monkeypatch.setattr(process, "STARTUP_S", 0.0)  # its start began longer ago than the limit
        reply = sandbox.call("identify", workdir, UnitLimits(), time.monotonic() + 120, unit=unit,
                             program=shutil.copy(zoo_dir / "mlp.pt2", workdir))
        assert len(reply["identity"]["program"]) == 64 and sandbox.starts == 1


def test_a_child_given_up_before_its_zygote_forked_it_is_never_forked(zoo_dir):
    """A job that ends (or a worker that retires its child) while the zygote still imports torch
    gives that child up: the zygote forks only the next one, which serves. (It used to fork the
    given-up child too, which died at once on its removed HOME, a traceback in the zygote's log.)"""
    from workers.unit import Target, Unit

    unit = Unit(graph="mlp", source="mlp.pt2", target=Target("aoti-cpu"), program=None)
    with Sandbox() as sandbox, sandbox.workdir() as workdir:
        sandbox.prestart(UnitLimits())
        sandbox.retire(UnitLimits())  # at once: the zygote is still importing torch
        reply = sandbox.call("identify", workdir, UnitLimits(), time.monotonic() + 120, unit=unit,
                             program=shutil.copy(zoo_dir / "mlp.pt2", workdir))
        assert len(reply["identity"]["program"]) == 64 and sandbox.starts == 2
        log = sandbox._zygote_log.read_text()
        assert "skipped a child its worker gave up" in log and "Traceback" not in log, log


def test_a_child_waited_for_as_its_worker_starts_serves_the_first_step_at_once(zoo_dir):
    """A pool counts a worker as started once its child is up (CompileWorker.warm): its first unit
    then waits for no torch import."""
    from workers.unit import Target, Unit

    unit = Unit(graph="mlp", source="mlp.pt2", target=Target("aoti-cpu"), program=None)
    with Sandbox() as sandbox, sandbox.workdir() as workdir:
        sandbox.prestart(UnitLimits())
        sandbox.wait_started()
        assert sandbox.cost.start_s > 0
        sandbox.call("identify", workdir, UnitLimits(), time.monotonic() + 120, unit=unit,
                     program=shutil.copy(zoo_dir / "mlp.pt2", workdir))
        assert sandbox.start_waited_s == 0 and sandbox.starts == 1


def test_a_sandbox_that_will_lower_has_its_zygote_warm_the_lowering_before_its_first_child(zoo_dir):
    """A service's worker back after a gang lowered before it left: its first child is already
    forked with the lowering warm (scheduler/shared_pool.py starts it with lowers=True)."""
    from workers.unit import Target, Unit

    unit = Unit(graph="mlp", source="mlp.pt2", target=Target("aoti-cpu"), program=None)
    with Sandbox(lowers=True) as sandbox, sandbox.workdir() as workdir:
        sandbox.call("identify", workdir, UnitLimits(), time.monotonic() + 120, unit=unit,
                     program=shutil.copy(zoo_dir / "mlp.pt2", workdir))
        assert "warmed the lowering" in sandbox._zygote_log.read_text()


def test_once_a_child_has_lowered_its_zygote_warms_the_lowering_for_the_next_jobs(zoo_dir, tmp_path):
    """A worker's next jobs fork their children from a zygote that has done what a first lowering
    does beyond the imports; a zygote whose children never lowered (a worker that only met hits)
    never paid for it. See test_worker_start.py for what that warm-up covers."""
    from scheduler.jobs import run_units_in
    from workers.unit import Target, Unit

    job = parse_job({"name": "warm", "graphs": [str(zoo_dir / "mlp.pt2")], "targets": ["aoti-cpu"]})
    with Sandbox() as sandbox:
        outcome = execute(job, store_from_uri(str(tmp_path / "store")),
                          lambda units, store, events: run_units_in(sandbox, units, store, events))
        assert [r.status for r in outcome.results] == ["compiled"]
        zygote, log = _parent(sandbox.pid), sandbox._zygote_log
        assert "warmed the lowering" not in log.read_text()  # the first job's child lowered as any process
        sandbox.renew()  # the job ended: the next job's child is forked now
        with sandbox.workdir() as workdir:
            unit = Unit(graph="mlp", source="mlp.pt2", target=Target("aoti-cpu"), program=None)
            sandbox.call("identify", workdir, UnitLimits(), time.monotonic() + 120, unit=unit,
                         program=shutil.copy(zoo_dir / "mlp.pt2", workdir))
        assert _parent(sandbox.pid) == zygote and "warmed the lowering" in log.read_text()


def test_a_workers_placement_imports_name_what_its_zygote_imports_before_every_child(zoo_dir, tmp_path):
    """An ExecuTorch worker's children start with ExecuTorch's compiler and runtime imported by
    their zygote (Placement.warm_imports), and lower .pte files there as any child does; a plain
    sandbox's children start without them."""
    pytest.importorskip("executorch")
    from scheduler.jobs import run_units_in
    from workers.backends import resolve
    from workers.unit import Target

    imports = resolve(Target("executorch", "portable")).placement(Target("executorch", "portable")).warm_imports
    assert "executorch.runtime" in imports
    job = parse_job({"name": "pte", "graphs": [str(zoo_dir / "mlp.pt2")], "targets": ["executorch:portable"]})
    with Sandbox(imports=imports) as warm, Sandbox() as plain:
        for sandbox in (warm, plain):
            sandbox.prestart(UnitLimits())
            sandbox.wait_started()
        mapped = {s: "executorch" in Path(f"/proc/{s.pid}/maps").read_text() for s in (warm, plain)}
        assert mapped == {warm: True, plain: False}  # the runtime's native library, before any step
        assert "imported executorch.exir" in warm._zygote_log.read_text()
        outcome = execute(job, store_from_uri(str(tmp_path / "store")),
                          lambda units, store, events: run_units_in(warm, units, store, events))
        assert [r.status for r in outcome.results] == ["compiled"], [r.error for r in outcome.results]


def test_an_unjailed_childs_precompiled_headers_go_to_its_nodes_dir(monkeypatch, tmp_path, zoo_dir):
    """Inductor keeps its precompiled headers in its default dir (the host's /tmp) whatever
    TORCHINDUCTOR_CACHE_DIR says. A jailed child's default dir is the node's, bound in; an unjailed
    child keeps them in the node's dir too, which FARM_NODE_CACHE names where it is set (a pod's
    cache volume, so a restarted pod builds none again; a bench's fresh node per side)."""
    from scheduler.jobs import run_units_in
    from workers.sandbox.env import HOST_RECORDS, node_dir

    hosts = node_dir() / HOST_RECORDS  # this host's records of Inductor's ISA probes, where made: not this test's subject
    monkeypatch.setenv("FARM_SANDBOX", "process")
    monkeypatch.setenv("FARM_NODE_CACHE", str(tmp_path / "node"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    if hosts.is_dir():
        shutil.copytree(hosts, node_dir() / HOST_RECORDS, ignore=shutil.ignore_patterns("*.lock"))
    job = parse_job({"name": "headers", "graphs": [str(zoo_dir / "mlp.pt2")], "targets": ["aoti-cpu:x86-64"]})
    with Sandbox() as sandbox:
        outcome = execute(job, store_from_uri(str(tmp_path / "store")),
                          lambda units, store, events: run_units_in(sandbox, units, store, events))
        assert sandbox.isolation is not None and not sandbox.jailed
    assert [r.status for r in outcome.results] == ["compiled"], [r.error for r in outcome.results]
    headers = [h for h in (tmp_path / "node").rglob("precompiled_headers/*.h.gch") if h.stat().st_size > 0]
    assert headers, f"no precompiled header under {tmp_path / 'node'}: the child built them elsewhere"
