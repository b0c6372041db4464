"""`farm`: compile exported programs into a store and read back what the farm made."""
from __future__ import annotations

import contextlib
import enum
import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from farm import client
from farm.cli_common import DEFAULT_STORE, StoreOpt, cannot_write, interrupted
from farm.cli_common import fail as _fail
from farm.cli_common import open_store as _open_store
from farm.cache_cli import register as register_cache_commands
from farm.service_cli import register as register_service_commands
from farm.store_cli import register as register_store_commands
from farm.zoo_cli import zoo_app
from scheduler.spec import JobSpec, SpecError, TargetSpec, VerifySpec, load_job, parse_job

# markdown: a docstring's lines are joined into one paragraph (rich mode kept its line breaks, ragged in `farm --help`)
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="markdown",
                  help="A compile farm for PyTorch 2 exported programs.")
app.add_typer(zoo_app, name="zoo")
register_store_commands(app)
register_service_commands(app)
register_cache_commands(app)


def _json(obj) -> None:
    """Machine-readable output on stdout (`--json`): one JSON document."""
    typer.echo(json.dumps(obj, indent=1, default=str))


def _run_job(start, store_uri: str) -> None:
    """Run a job through the Python API (`start(events)` → JobHandle) with a live bar, then the
    results table and what to do next."""
    from farm.console import SUMMARY_OVER, ProgressEvents, console, failure_logs, job_tables, out, stats_line
    from scheduler.errors import JobInterrupted, JoinFailed
    from storage import StoreError

    try:
        with ProgressEvents() as events:
            outcome = start(events).outcome
    except (StoreError, SpecError, JoinFailed) as e:
        raise _fail(str(e)) from e
    except JobInterrupted as e:
        raise interrupted(e.job_id, store_uri) from None
    rows = [r.to_row(outcome.job_id) for r in outcome.results]
    for table in job_tables(rows, f"job {outcome.job_id} · {outcome.wall_s:.1f} s"):
        out.print(table)
    if len(rows) > SUMMARY_OVER:
        out.print(f"Every unit's row: farm results {outcome.job_id} --store {store_uri}")
    out.print(
        f"{outcome.count('compiled')} compiled, {outcome.count('hit')} hits, {outcome.count('failed')} failed, "
        f"{outcome.retries} retries. "
        f"Artifacts and results are in {outcome.store_uri} (results: jobs/{outcome.job_id}/results.parquet)."
    )
    out.print(stats_line(outcome.stats))
    done = next((r for r in outcome.results if r.status in ("compiled", "hit")), None)
    if done:
        name = client.artifact_file_name(done.target)
        out.print(f"Fetch one (it prints how to load it): farm fetch {done.key[:16]} {name} --store {store_uri}")
    if outcome.count("compiled"):
        out.print(f"Why were there misses? farm explain --job {outcome.job_id} --store {store_uri}")
    if outcome.count("failed"):
        console.print("[red]some units failed[/red]; their errors are in the table, their logs:")
        for line in failure_logs(rows, store_uri):
            console.print(line)
        raise typer.Exit(1)


@app.command()
def compile(
    graphs: list[Path] = typer.Argument(..., help=".pt2 files written by torch.export.save"),
    target: list[str] = typer.Option(["aoti-cpu"], "--target", "-t", help="backend[:isa], e.g. aoti-cpu, aoti-cpu:avx512, aoti-cuda:sm_90"),
    store: str = StoreOpt,
    module: list[str] = typer.Option([], "--module", "-m", help="module to import before loading (output pytree types)"),
    atol: float = typer.Option(VerifySpec().atol, help="verification absolute tolerance"),
    rtol: float = typer.Option(VerifySpec().rtol, help="verification relative tolerance"),
    weights: str = typer.Option(JobSpec.model_fields["weights"].default,
                                help="values: an artifact per checkpoint; shapes: one per architecture"),
    mode: str = typer.Option(TargetSpec.model_fields["mode"].default,
                             help="inference, or train: forward and backward of a training step"),
) -> None:
    """Compile graphs for targets in this process and print a results table."""
    try:
        targets = [t if "+" in t else f"{t}+{mode}" for t in target]
        job = parse_job(
            {"name": "compile", "graphs": [str(g) for g in graphs], "targets": targets, "modules": module,
             "verify": {"atol": atol, "rtol": rtol}, "weights": weights},
            "command line", base_dir=Path.cwd(),
        )
    except SpecError as e:
        raise _fail(str(e)) from e
    _run_job(lambda events: client.run(job, _open_store(store), events=events), store)


@app.command()
def run(job_file: Path = typer.Argument(..., help="job spec (YAML)"), store: str = StoreOpt) -> None:
    """Run a job spec in this process."""
    try:
        job = load_job(job_file)
    except SpecError as e:
        raise _fail(str(e)) from e
    _run_job(lambda events: client.run(job, _open_store(store), events=events), store)


class PriorityChoice(str, enum.Enum):
    interactive = "interactive"
    batch = "batch"
    nightly = "nightly"


@app.command()
def submit(
    job_file: Path = typer.Argument(..., help="job spec (YAML)"),
    store: str = StoreOpt,
    address: Optional[str] = typer.Option(None, help="Ray cluster to join (default: RAY_ADDRESS, else start a local Ray)"),
    workers: Optional[int] = typer.Option(None, min=1, help="workers per device class (default: the job's limits, else every slot)"),
    timeout: Optional[float] = typer.Option(None, min=1, help="seconds before a unit is failed as timeout (default: the job's)"),
    retries: Optional[int] = typer.Option(None, min=0, help="re-queues of a unit whose worker died (default: the job's)"),
    metrics_port: Optional[int] = typer.Option(None, min=1, max=65535, help="an embedded Ray's Prometheus endpoint (127.0.0.1:PORT/metrics)"),
    priority: Optional[PriorityChoice] = typer.Option(None, help="a farm service's share for the job (default: the spec's, else batch)"),
    detach: bool = typer.Option(False, "--detach", help="with a farm service: print the job id and return at once"),
) -> None:
    """Run a job on Ray: long-lived workers per device class, live progress, results in the store.
    Where a farm service runs on the cluster (`farm serve`), the job is handed to it."""
    from farm.console import console

    try:
        job = load_job(job_file)
    except SpecError as e:
        raise _fail(str(e)) from e
    update = {"timeout_s": timeout} if timeout else {}
    if retries is not None:
        update["retries"] = retries
    job = job.model_copy(update={"limits": job.limits.model_copy(update=update)})
    if priority is not None:
        job = job.model_copy(update={"priority": priority.value})
    if _submit_to_service(job, store, address, workers, detach):
        return
    if detach:
        raise _fail("--detach hands the job to a farm service, and none runs there: start one with `farm serve "
                    "--address HOST:PORT`, or leave out --detach")

    def joined(session, job_id: str) -> None:
        if session.dashboard:
            console.print(f"Ray dashboard: {session.dashboard} (token: `ray get-auth-token`)")
        console.print(f"job {job_id}: `farm status {job_id} --watch --store {store}` from any machine")

    _run_job(lambda events: client.submit(job, _open_store(store), address=address, workers=workers, events=events,
                                          metrics_port=metrics_port, on_session=joined), store)


def _submit_to_service(job: JobSpec, store: str, address: str | None, workers: int | None, detach: bool) -> bool:
    """Hand the job to the farm service that watches the store or runs on the cluster, if one does;
    follow it unless detached."""
    from farm.console import console, watch_status
    from farm.service_client import ServiceRefused, find
    from scheduler.errors import JoinFailed, ServiceError
    from storage import StoreError

    named = None if store == DEFAULT_STORE and "FARM_STORE" not in os.environ else store
    try:
        service = find(address, named if address or os.environ.get("RAY_ADDRESS") else store)
        if service is None:
            return False
        job_id = service.submit(job, named, workers=workers)
    except (JoinFailed, ServiceError, ServiceRefused, SpecError, StoreError) as e:
        raise _fail(str(e)) from e
    where = f"--store {service.store_uri}"
    console.print(f"job {job_id} handed to the farm service through {service.via} ({job.priority}); "
                  f"`farm status {job_id} --watch {where}` "
                  f"follows it from any machine, `farm cancel {job_id}` cancels it")
    if detach:
        typer.echo(job_id)
        return True
    handle = client.JobHandle(job_id, service.store())
    try:
        doc = watch_status(handle.status, 0.25)
    except KeyboardInterrupt:
        console.print(f"stopped following; job {job_id} keeps running on the farm service "
                      f"(`farm status {job_id} --watch {where}`, `farm cancel {job_id}`)")
        raise typer.Exit(130) from None
    if doc["state"] != "done":
        from scheduler.jobs import silence_note

        why = doc.get("error") or silence_note(doc)
        raise _fail(f"job {job_id} {doc['state']}" + (f": {why}" if why else ""), code=1)
    if any(r["status"] == "failed" for r in _print_results(handle, service.store_uri)):
        raise typer.Exit(1)
    return True


@app.command()
def resources(slots: Optional[int] = typer.Option(None, min=1, help="CPU compile workers on this node (default: its cores)")) -> None:
    """The Ray resources this host offers the farm, as JSON: ray start --resources "$(farm resources)"."""
    import json

    from workers.backends import LoweringError, offered_resources
    from workers.sandbox import jail

    try:
        isolation = jail.isolation()
    except (jail.JailUnavailable, ValueError) as e:
        raise _fail(str(e)) from e
    typer.echo(f"sandbox: {jail.describe(isolation)}", err=True)  # stdout stays the resources, for ray start
    _say_unusable_bytecode()
    try:
        offered = offered_resources(slots or os.cpu_count() or 1)
    except LoweringError as e:  # what this host lacks to build: a compiler
        raise _fail(str(e)) from e
    typer.echo(json.dumps(offered))


def _say_unusable_bytecode() -> None:
    """On stderr: torch's modules have no bytecode here that a process can use, so every sandbox
    child (which never writes bytecode) compiles their sources again as it starts (seconds)."""
    from workers.torch_files import torch_dir, unusable_bytecode

    where = torch_dir()
    missing = unusable_bytecode(where) if where else []
    if missing:
        typer.echo(f"python: torch's modules have no bytecode here ({where}: {', '.join(missing)}), so every "
                   f"sandbox child, which never writes it, compiles their sources as it starts (10.5 s a "
                   f"process on a GPU host seen so); compile them once, as the install's owner: "
                   f"{sys.executable} -m compileall -q -j 0 {where}", err=True)


def _job_handle(job_id: str, store: str) -> "client.JobHandle":
    try:
        return client.job(job_id, _open_store(store, create=False))
    except client.UnknownJob as e:
        raise _fail(f"{e}; `farm submit` and `farm run` print the ids of their jobs") from e


@app.command()
def status(
    job_id: str = typer.Argument(..., help="job id (or a unique prefix)"),
    store: str = StoreOpt,
    watch: bool = typer.Option(False, "--watch", "-w", help="follow the job until it ends: a live table on a terminal, a line per change in a log"),
    every: float = typer.Option(2.0, min=0.1, help="seconds between reads of the store, with --watch"),
    as_json: bool = typer.Option(False, "--json", help="print the status document as JSON"),
) -> None:
    """How far a job got (queued, running, compiled, hits, failed, retries), read from the store."""
    from farm.console import console, out, status_line, watch_status
    from scheduler.jobs import ENDED, silent_for

    handle = _job_handle(job_id, store)
    if watch:
        doc = watch_status(handle.status, every, to=console if as_json else out)  # stdout: the JSON alone
    else:
        doc = handle.status()
    if as_json:
        if doc["state"] == "done":
            with contextlib.suppress(client.UnknownJob):  # a job cut off before its stats were written has none
                doc = {**doc, "stats": handle.stats()}
        silent = silent_for(doc)
        _json({**doc, "silent_s": round(silent)} if silent is not None else doc)  # its process stopped
    elif not watch:
        out.print(status_line(doc), soft_wrap=True)
    if watch and doc["state"] not in ENDED:  # its process stopped without ending it: said in its status line
        raise typer.Exit(1)


@app.command()
def fetch(
    key: str = typer.Argument(..., help="unit key (or the unique prefix tables print)"),
    dest: Path = typer.Argument(..., help="where to write the artifact"),
    store: str = StoreOpt,
    as_json: bool = typer.Option(False, "--json", help="print what was fetched as JSON"),
) -> None:
    """Download the artifact of a unit KEY to DEST, verified against its digest."""
    from rich.markup import escape

    from farm.console import out
    from storage import StoreError

    try:
        facts = client.fetch(key, dest, _open_store(store, create=False))
    except (StoreError, ValueError) as e:
        raise _fail(str(e)) from e
    except OSError as e:  # where it was asked to write
        raise cannot_write(dest, e) from e
    if as_json:
        _json(facts)
        return
    out.print(escape(f"{facts['path']}: {facts['graph']} for {facts['target']}") +
              f" ({facts['bytes']} bytes, sha256 {facts['sha256'][:12]}… verified)")
    signed = facts["signature"]
    out.print(f"manifest {signed}" + ("" if facts["signatures_required"] else
              " (not checked: set FARM_VERIFY_KEY to the farm's verify.pem to require signatures)"
              if signed != "unsigned" else "; set FARM_VERIFY_KEY to refuse unsigned manifests"))
    for how, label in (("load", "load with"), ("load_other_weights", "with another checkpoint")):
        if facts.get(how):
            out.print(escape(f"{label}: {facts[how]}"))


@app.command()
def trace(
    key: str = typer.Argument(..., help="unit key (or the unique prefix tables print), compiled or failed"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="report folder (default: ./trace-KEY16)"),
    job: Optional[str] = typer.Option(None, "--job", help="look only in this job's results (id or unique prefix)"),
    raw: bool = typer.Option(False, "--raw", help="write the raw trace log only, without tlparse"),
    store: str = StoreOpt,
) -> None:
    """Fetch a unit's torch trace (TORCH_TRACE of its lowering) and render it with tlparse into an
    HTML report that opens offline."""
    from rich.markup import escape

    from farm.console import out as stdout
    from farm.trace import TraceError, fetch_trace, find_trace, render
    from storage import StoreError

    s = _open_store(store, create=False)
    try:
        found = find_trace(s, key, _job_handle(job, store).job_id if job else None)
        out = out or Path(f"trace-{found.key[:16]}")
        out.mkdir(parents=True, exist_ok=True)
        log_file = fetch_trace(s, found, out)
        index = log_file if raw else render(log_file, out / "report")
    except (TraceError, StoreError, ValueError) as e:
        raise _fail(str(e)) from e
    except OSError as e:  # where it was asked to write
        raise cannot_write(out, e) from e
    stdout.print(escape(f"{found.graph}@{found.target} ({found.status}, key {found.key[:16]}…): {index}"))


@app.command()
def keygen(folder: Path = typer.Argument(..., help="where to write signing.pem and verify.pem")) -> None:
    """Make an Ed25519 key pair for signed manifests: FARM_SIGNING_KEY=signing.pem on workers,
    FARM_VERIFY_KEY=verify.pem wherever artifacts are consumed."""
    from farm.console import out
    from storage.signing import keygen as make_keys

    try:
        private, public = make_keys(folder)
    except OSError as e:
        if (folder / "signing.pem").exists():
            raise _fail(f"{folder}/signing.pem exists; pick an empty folder (never overwrite a signing key)") from e
        why = "it is a file" if folder.is_file() else e.strerror or e
        raise _fail(f"cannot write keys into {folder}: {why}; pick a folder you can write") from e
    out.print(f"wrote {private} (private: keep it on workers only, as FARM_SIGNING_KEY) and {public} "
              f"(FARM_VERIFY_KEY for every consumer)")


@app.command()
def results(
    job_id: str = typer.Argument(..., help="job id (or a unique prefix)"),
    store: str = StoreOpt,
    as_json: bool = typer.Option(False, "--json", help="print the rows (storage.results.RESULTS_SCHEMA) as a JSON list"),
) -> None:
    """Print the results table of a job from the store."""
    handle = _job_handle(job_id, store)
    if as_json:
        try:
            _json(handle.results().to_pylist())
        except client.UnknownJob as e:
            raise _fail(str(e)) from e
        return
    _print_results(handle, store)


def _print_results(handle: "client.JobHandle", store: str) -> list[dict]:
    """A job's results table, stats and failure logs, from the store; its rows."""
    from farm.console import failure_logs, out, results_table, stats_line
    from storage.stats import JobStats

    try:
        rows = handle.results().to_pylist()
    except client.UnknownJob as e:
        raise _fail(str(e)) from e
    out.print(results_table(rows, f"job {handle.job_id}"))
    out.print(stats_line(JobStats.from_rows(rows)))
    for line in failure_logs(rows, store):
        out.print(line)
    return rows


@app.command()
def explain(
    keys: list[str] = typer.Argument(None, help="two keys (or unique prefixes) to diff"),
    job: Optional[str] = typer.Option(None, "--job", help="explain every miss of this job (id or unique prefix)"),
    store: str = StoreOpt,
    as_json: bool = typer.Option(False, "--json", help="print the differences (or the job's misses) as JSON"),
) -> None:
    """Why did a unit not hit? Diff two keys, or explain every miss of a job against the closest key in the store."""
    from dataclasses import asdict

    from rich.markup import escape

    from farm.console import diff_table, out
    from farm.explain import ExplainError, explain_job, explain_keys
    from storage import StoreError

    if (job is None) == (len(keys or []) != 2):
        raise _fail("give two keys (farm explain KEY_A KEY_B) or a job (farm explain --job JOB)")
    s = _open_store(store, create=False)
    try:
        if job is None:
            a, b, diffs = explain_keys(s, *keys)
            if as_json:
                _json({"a": a, "b": b, "diffs": [{"component": p, "a": va, "b": vb} for p, va, vb in diffs]})
            else:
                out.print(diff_table(diffs, a, b) if diffs else f"{a[:16]}… and {b[:16]}… have the same components")
            return
        job = _job_handle(job, store).job_id
        misses = explain_job(s, job)
    except (ExplainError, StoreError) as e:
        raise _fail(str(e)) from e
    if as_json:
        _json([{**asdict(m), "diffs": [{"component": p, "this": va, "closest": vb} for p, va, vb in m.diffs]}
               for m in misses])
        return
    if not misses:
        out.print(f"job {job}: every unit was a hit")
    for m in misses:
        head = f"[bold]{escape(m.graph)}@{escape(m.target)}[/bold] {m.status}" + (f", key {m.key[:16]}…" if m.key else "")
        if m.key is None:
            out.print(f"{head}: failed before it had a key: {escape(m.error or '')}")
            continue
        if m.note or m.error:
            out.print(f"{head}: {escape(m.note or m.error or '')}")
        if m.status == "hit":
            continue
        if m.closest is None:
            out.print(f"{head}: the store holds no other key to compare with; this was a first compile")
        else:
            out.print(f"{head}: closest key {m.closest[:16]}… ({escape(m.closest_label or '')}) differs in:")
            out.print(diff_table(m.diffs, "this unit", "closest"))


@app.command()
def log(digest_or_key: str = typer.Argument(..., help="a log digest (results' log_digest), or a unit key or its unique prefix"),
        store: str = StoreOpt) -> None:
    """Print a unit's log, by log digest or by unit key."""
    from storage import StoreError

    s = _open_store(store, create=False)
    try:
        manifest = s.get_manifest(s.resolve_key(digest_or_key))
        digest = manifest["blobs"]["log"]["digest"] if manifest else digest_or_key
        typer.echo(s.get_bytes(digest).decode(errors="replace"))
    except (StoreError, ValueError) as e:
        raise _fail(str(e)) from e
