"""One bad graph never stops a job: each ends as failed with a message naming the graph and
saying what to do, nothing is published for it, and the good graph still compiles."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from scheduler.spec import SpecError, parse_job
from scheduler.jobs import execute
from storage import store_from_uri
from storage.results import read_results
from tests.cli import farm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bad_job(zoo_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "notes.pt2").write_text("this is not an archive")
    good = (zoo_dir / "mlp.pt2").read_bytes()
    (d / "truncated.pt2").write_bytes(good[: len(good) // 2])
    # exported in a separate process, so this process has never registered the output type
    subprocess.run([sys.executable, "-c", f"from tests.fixtures.custom_output import export; export({str(d / 'custom.pt2')!r})"],
                   check=True, capture_output=True)
    store = store_from_uri(str(d / "store"))
    job = parse_job({
        "name": "bad",
        "graphs": ["missing.pt2", "notes.pt2", "truncated.pt2", "custom.pt2", str(zoo_dir / "mlp.pt2")],
        "targets": ["core-aten", "no-such-backend"],  # core-aten: bad input fails alike for every target
    }, "bad.yaml", base_dir=d)
    return store, execute(job, store), d


def _result(outcome, graph, target="core-aten"):
    return next(r for r in outcome.results if r.graph == graph and r.target == target)


@pytest.mark.parametrize("graph, says", [
    ("missing", "does not exist; check the path"),
    ("notes", "is not a .pt2 archive: save the program with torch.export.save"),
    ("truncated", "truncated or corrupt .pt2 archive"),
    ("custom", "is not registered. Add the module that registers this output type"),
])
def test_each_bad_graph_fails_with_a_message_naming_it(bad_job, graph, says):
    _, outcome, _ = bad_job
    r = _result(outcome, graph)
    assert r.status == "failed"
    assert f"graph {graph}" in r.error and says in r.error, r.error


def test_unknown_target_fails_its_units_and_lists_known_ones(bad_job):
    _, outcome, _ = bad_job
    r = _result(outcome, "mlp", "no-such-backend")
    assert r.status == "failed" and "unknown target 'no-such-backend'" in r.error and "aoti-cpu" in r.error


def test_good_graph_still_compiles_and_only_it_is_published(bad_job):
    store, outcome, _ = bad_job
    good = _result(outcome, "mlp")
    assert good.status == "compiled", good.error
    assert set(store.manifest_keys()) == {good.key}
    rows = read_results(store, outcome.job_id)
    assert len(rows) == 10 and sum(r["status"] == "failed" for r in rows) == 9
    # every failure keeps a log that says what happened, readable from the store alone
    for row in rows:
        if row["graph"] == "custom" and row["target"] == "core-aten":
            assert "not registered" in store.get_bytes(row["log_digest"]).decode()


def test_naming_the_module_fixes_the_unregistered_output(bad_job):
    store, _, d = bad_job
    job = parse_job({"graphs": ["custom.pt2"], "targets": ["core-aten"], "modules": ["tests.fixtures.custom_output"]},
                    "fixed.yaml", base_dir=d)
    r = execute(job, store).results[0]
    assert r.status == "compiled", r.error


def test_a_job_whose_results_cannot_be_written_ends_failed_and_says_why(tmp_path, monkeypatch):
    """A store that fills up as the job ends: the error reaches the caller, and the job's record
    says it failed instead of running for ever (`farm jobs`, `farm status`)."""
    import json

    from scheduler import jobs
    from storage import StoreUnwritable

    def full(store, job_id, rows):
        raise StoreUnwritable(f"write {store.uri}/jobs/{job_id}/results.parquet failed: No space left on device")

    monkeypatch.setattr(jobs, "write_results", full)
    store = store_from_uri(str(tmp_path / "store"))
    job = parse_job({"name": "full", "graphs": ["missing.pt2"], "targets": ["core-aten"]}, "full.yaml", base_dir=tmp_path)
    with pytest.raises(StoreUnwritable, match="No space left"):
        execute(job, store, job_id="full-1")
    status = json.loads(store.get_job_file("full-1", "status.json"))
    assert status["state"] == "failed" and "results were not written" in status["error"] and status["failed"] == 1


def test_a_job_that_breaks_in_its_process_ends_failed_with_the_error(tmp_path):
    """Not `running` for ever: whatever stops a job in the process running it is in its record."""
    import json

    def broken(units, store, events):
        raise RuntimeError("the runner broke")

    store = store_from_uri(str(tmp_path / "store"))
    job = parse_job({"name": "broken", "graphs": ["missing.pt2"], "targets": ["core-aten"]}, "broken.yaml",
                    base_dir=tmp_path)
    with pytest.raises(RuntimeError, match="the runner broke"):
        execute(job, store, runner=broken, job_id="broken-1")
    status = json.loads(store.get_job_file("broken-1", "status.json"))
    assert status["state"] == "failed" and status["error"] == "RuntimeError: the runner broke", status


def test_cli_reports_failures_with_nonzero_exit(zoo_dir, tmp_path):
    bad = tmp_path / "bad.pt2"
    bad.write_text("nope")
    proc = subprocess.run([sys.executable, "-m", "farm", "compile", str(bad), "--store", str(tmp_path / "s")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "not a .pt2 archive" in proc.stdout and "some units failed" in proc.stderr


def test_invalid_job_file_names_the_field(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent("""
        graphs: [a.pt2]
        targets: [aoti-cpu]
        verify: {atol: -1}
    """))
    proc = subprocess.run([sys.executable, "-m", "farm", "run", str(job)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"{job}: the job spec is invalid" in proc.stderr and "verify.atol" in proc.stderr


def test_a_misspelt_field_is_named_with_the_one_meant():
    with pytest.raises(SpecError) as e:
        parse_job({"graphs": ["a.pt2"], "target": ["aoti-cpu"], "limit": {"workers": 2}, "verify": {"atoll": 1},
                   "colour": "blue"}, "job.yaml")
    said = str(e.value)
    assert "target: Extra inputs are not permitted (did you mean `targets`?)" in said
    assert "limit: Extra inputs are not permitted (did you mean `limits`?)" in said
    assert "verify.atoll: Extra inputs are not permitted (did you mean `atol`?)" in said
    assert "colour: Extra inputs are not permitted\n" in said  # nothing close: no guess


def test_a_misspelt_target_is_named_with_the_one_meant():
    from workers.backends import LoweringError, get_backend

    with pytest.raises(LoweringError, match=r"unknown target 'aoti-cpux' \(did you mean 'aoti-cpu'\?\); known targets: "):
        get_backend("aoti-cpux")
    with pytest.raises(LoweringError) as nothing_close:
        get_backend("no-such-backend")
    assert "did you mean" not in str(nothing_close.value)


@pytest.mark.parametrize("options, says", [
    ({"cpp.cxx": [None, "/bin/false"]}, "cpp.cxx: may only be a number, a boolean or null"),
    ({"aot_inductor.output_path": "/tmp/torchinductor_nobody/x.so"}, "aot_inductor.output_path: may only be"),
    ({"aot_inductor.custom_op_libs": ["evil.so"]}, "aot_inductor.custom_op_libs: may only be"),
    ({"trace.debug_dir": "/tmp"}, "trace.debug_dir: may only be"),
    ({"aot_inductor.compile_wrapper_opt_level": "specs=evil"}, "must match 'O[0-3sgz]?|Ofast', got 'specs=evil'"),
    ({"cpp.simdlen": 512}, "cpp.simdlen: is set by the target's ISA"),
    ({"_fuse_ddp_communication_passes": 1}, "is not a public Inductor option"),
])
def test_options_that_name_programs_files_or_flags_are_refused_as_the_job_loads(options, says):
    """A job sets tuning knobs, never the compiler, a library to load or a path to write (into the
    node's Inductor cache, say, that later jobs' children build with): refused before anything runs."""
    spec = {"graphs": ["a.pt2"], "targets": [{"backend": "aoti-cpu", "options": options}]}
    with pytest.raises(SpecError) as refused:
        parse_job(spec, "job.yaml")
    assert "job.yaml: the job spec is invalid" in str(refused.value) and "targets.0.options" in str(refused.value)
    assert says in str(refused.value)
    candidate = {"graphs": ["a.pt2"], "targets": [{"backend": "aoti-cpu", "autotune": {
        "candidates": ["default", {"name": "mine", "options": options}]}}]}
    with pytest.raises(SpecError, match="targets.0.autotune.candidates.1.CandidateSpec.options"):
        parse_job(candidate, "job.yaml")


def test_tuning_options_and_the_farms_presets_still_load():
    spec = {"graphs": ["a.pt2"], "targets": [
        {"backend": "aoti-cpu", "options": {"max_autotune": True, "freezing": True, "cpp.threads": 1,
                                            "aot_inductor.compile_wrapper_opt_level": "O2"}},
        {"backend": "aoti-cpu", "autotune": {}},  # every CPU preset
        {"backend": "aoti-cuda", "options": {"max_autotune_gemm_backends": "ATEN,TRITON"}, "autotune": {}}]}
    job = parse_job(spec, "job.yaml")
    assert job.targets[0].options["cpp.threads"] == 1 and len(job.targets[1].space()) > 1


def test_every_preset_of_the_farms_autotune_spaces_passes_the_rule():
    """The worker holds merged options (target + candidate) to the rule: a preset that broke it
    would fail every unit that tried it."""
    from workers.autotune.space import PRESETS
    from workers.backends.option_policy import options_problems

    assert PRESETS and all(presets for presets in PRESETS.values())
    assert {(backend, name): options_problems(options) for backend, presets in PRESETS.items()
            for name, options in presets.items() if options_problems(options)} == {}


def test_the_cli_refuses_a_job_that_sets_the_compiler(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent("""
        graphs: [a.pt2]
        targets: [{backend: aoti-cpu, options: {cpp.cxx: /usr/bin/env}}]
    """))
    proc = subprocess.run([sys.executable, "-m", "farm", "submit", str(job), "--store", str(tmp_path / "s")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"{job}: the job spec is invalid" in proc.stderr and "targets.0.options" in proc.stderr
    assert "cpp.cxx" in proc.stderr and "CXX" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "s").exists() or not list(store_from_uri(str(tmp_path / "s")).manifest_keys())


@pytest.mark.parametrize("field", ["modules", "graphs.0.modules"])
def test_modules_are_module_names_never_paths(field):
    spec = {"graphs": ["a.pt2"], "targets": ["aoti-cpu"]}
    bad = ["tests.fixtures.custom_output", "../../tmp/evil"]
    if field == "modules":
        spec["modules"] = bad
    else:
        spec["graphs"] = [{"path": "a.pt2", "modules": bad}]
    with pytest.raises(SpecError) as refused:
        parse_job(spec, "job.yaml")
    assert f"{field}.1: Value error, '../../tmp/evil' is not a module name" in str(refused.value)
    assert f"{field}.0" not in str(refused.value)


def test_a_unit_made_without_the_spec_is_held_to_the_same_options_rule(zoo_dir, tmp_path):
    """A worker refuses such options too: a unit that reached it some other way than a parsed
    spec fails in its lowering with the rule's reason, and nothing is published."""
    from dataclasses import replace

    from scheduler.plan import plan
    from workers.pipeline import run_unit

    store = store_from_uri(str(tmp_path / "store"))
    (unit,) = plan(parse_job({"graphs": [str(zoo_dir / "mlp.pt2")], "targets": ["aoti-cpu"]}, "job.yaml"), store)
    unit = replace(unit, target=replace(unit.target, options=(("aot_inductor.output_path", "/tmp/elsewhere.so"),)))
    result = run_unit(unit, store)
    assert result.status == "failed" and result.failed_in == "lower" and not result.retryable
    assert "options refused: aot_inductor.output_path: may only be a number" in result.error
    assert list(store.manifest_keys()) == []


def test_ctrl_c_ends_an_in_process_job_as_cancelled_with_nothing_half_published(zoo_dir, tmp_path):
    """`farm compile` interrupted mid-unit: it says so and exits 130, the job's record says
    cancelled (not running for ever), and only units that finished have manifests."""
    import json
    import signal
    import time

    store_dir = tmp_path / "store"
    graphs = [str(zoo_dir / f"{name}.pt2") for name in ("gpt", "encoder_block", "cnn", "mlp")]
    # Ctrl-C as a terminal delivers it: a suite started in the background (`cmd &` in a script)
    # inherits SIGINT ignored, and Python then never installs its handler in the farm process
    proc = subprocess.Popen([sys.executable, "-m", "farm", "compile", *graphs, "--store", str(store_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline, running = time.monotonic() + 120, []
        while not running:  # a unit in flight, by the job's record
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            running = [p for p in store_dir.glob("jobs/*/status.json") if json.loads(p.read_text() or "{}").get("running_units")]
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        said = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    job_id = running[0].parent.name
    assert proc.returncode == 130 and f"interrupted: job {job_id} ends as cancelled" in said, said
    assert "Traceback" not in said, said
    doc = json.loads(running[0].read_text())
    store = store_from_uri(str(store_dir))
    assert doc["state"] == "cancelled" and doc["compiled"] < 4 and len(list(store.manifest_keys())) == doc["compiled"]
    said = farm("results", job_id, "--store", str(store_dir))
    assert f"job {job_id} has no results in file://{store_dir}: it ended cancelled (interrupted (Ctrl-C)" in said, said


def test_a_host_without_a_compiler_is_told_to_install_one(zoo_dir, tmp_path):
    """`farm resources` (a node's set-up) and a CPU unit on such a host: one line that says what to
    install, not Inductor's probe failing deep in a traceback."""
    env = {**os.environ, "CXX": str(tmp_path / "no-g++")}
    says = f"the C++ compiler CXX='{tmp_path / 'no-g++'}' is not installed here, or cannot be run"
    offered = subprocess.run([sys.executable, "-m", "farm", "resources"], env=env, capture_output=True, text=True,
                             timeout=300, stdin=subprocess.DEVNULL)
    assert offered.returncode == 2 and says in offered.stderr and "apt-get install g++" in offered.stderr, offered.stderr
    assert offered.stdout == "" and "Traceback" not in offered.stderr
    compiled = subprocess.run([sys.executable, "-m", "farm", "compile", str(zoo_dir / "mlp.pt2"), "--store",
                               str(tmp_path / "store")], env=env, capture_output=True, text=True, timeout=600,
                              stdin=subprocess.DEVNULL)
    assert compiled.returncode == 1 and "0 compiled" in compiled.stdout, compiled.stdout + compiled.stderr
    [job_dir] = (tmp_path / "store" / "jobs").iterdir()
    [row] = read_results(store_from_uri(str(tmp_path / "store")), job_dir.name)
    assert row["status"] == "failed" and says in row["error"], row


def test_a_job_whose_process_died_is_said_to_have_stopped_and_a_watch_ends(tmp_path, monkeypatch):
    """A running job's record is written every BEAT_S until it ends; one not written for SILENT_S
    (its process killed, its machine gone) reads as stopped, and `--watch` gives up on it."""
    import json
    import re
    import threading
    import time

    from scheduler import jobs

    store = store_from_uri(str(tmp_path / "store"))
    monkeypatch.setattr(jobs, "BEAT_S", 0.05)
    status = jobs.StatusFile(store, "beating-1", jobs.NoEvents())
    written = tmp_path / "store" / "jobs" / "beating-1" / "status.json"
    first, deadline = written.stat().st_mtime_ns, time.monotonic() + 30
    while written.stat().st_mtime_ns == first:  # beaten, with nothing new to say
        assert time.monotonic() < deadline, "the record was not written again"
        time.sleep(0.02)
    status.end(state="done")
    beating = lambda: [t for t in threading.enumerate() if t.name == "farm-status-beating-1"]  # noqa: E731
    while beating():  # the beat stops with the job
        assert time.monotonic() < deadline, "the record is still written after the job ended"
        time.sleep(0.02)
    assert json.loads(written.read_text())["state"] == "done"

    old = dt_iso(time.time() - 20 * 60)
    doc = {**jobs.empty_status("dead-1", "running"), "updated_at": old, "running": 1}
    store.put_job_file("dead-1", "status.json", json.dumps(doc).encode())
    said = farm("status", "dead-1", "--store", str(tmp_path / "store"))
    assert "silent_s" in json.loads(farm("status", "dead-1", "--json", "--store", str(tmp_path / "store")))
    # the 20 minutes planted above
    assert re.search(r"nothing heard from it for 2[01] min", said) and "the process running it has stopped" in said, said
    watched = subprocess.run([sys.executable, "-m", "farm", "status", "dead-1", "--watch", "--store",
                              str(tmp_path / "store")], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert watched.returncode == 1 and "has stopped" in watched.stdout, watched.stdout + watched.stderr
    listed = {r["job_id"]: r for r in json.loads(farm("jobs", "--store", str(tmp_path / "store"), "--json"))}
    assert listed["beating-1"]["state"] == "done"  # jobs that ran without a service are listed too
    assert listed["dead-1"]["state"] == "running" and "has stopped" in listed["dead-1"]["error"], listed
    assert jobs.silent_for({**doc, "updated_at": dt_iso(time.time())}) is None  # heard from lately
    assert jobs.silent_for({**doc, "state": "done"}) is None  # an ended job is never silent


def dt_iso(seconds: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(seconds, dt.timezone.utc).isoformat(timespec="seconds")


@pytest.mark.parametrize("args, option", [
    (["submit", "job.yaml", "--workers", "0"], "--workers"),
    (["submit", "job.yaml", "--retries", "-1"], "--retries"),
    (["submit", "job.yaml", "--timeout", "-5"], "--timeout"),
    (["resources", "--slots", "-3"], "--slots"),
    (["status", "some-job", "--watch", "--every", "0"], "--every"),
    (["serve", "--min-workers", "-1"], "--min-workers"),
    (["cache-serve", "--tokens", "t", "--port", "70000"], "--port"),
])
def test_numbers_out_of_range_are_refused_before_anything_runs(args, option):
    """Before, `--workers 0` meant the default, `--slots -3` offered Ray 0 slots, and `--every 0`
    read the store in a tight loop."""
    said = farm(*args)
    assert f"Invalid value for '{option}'" in said, said


@pytest.mark.parametrize("args", [["du"], ["gc"], ["pins"], ["cache-stats"], ["jobs"], ["cancel", "job-1"], ["zoo", "report"],
                                  ["status", "job-1"], ["results", "job-1"], ["log", "abc"], ["fetch", "abc", "out.bin"]])
def test_a_command_that_reads_a_local_store_that_is_not_there_says_so_and_makes_none(args, tmp_path):
    """Before, a mistyped --store was made an empty store, which answered `farm du` with nothing
    and `farm status` with an unknown job."""
    missing = tmp_path / "typo"
    said = farm(*args, "--store", str(missing))
    assert f"no store at {missing}: no such directory" in said and "--store or FARM_STORE" in said, said
    assert not missing.exists()


def test_the_client_reading_a_local_store_that_is_not_there_says_so_and_makes_none(tmp_path):
    from farm import client
    from storage import NoSuchStore

    missing = tmp_path / "typo"
    for read in (lambda: client.job("job-1", str(missing)), lambda: client.fetch("abc", tmp_path / "out", str(missing))):
        with pytest.raises(NoSuchStore, match=f"no store at {missing}"):
            read()
    assert not missing.exists()
