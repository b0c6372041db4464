"""`farm`: compile exported programs into a store and read back what the farm made."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from farm.cli_common import StoreOpt, fail as _fail, open_store as _open_store
from farm.zoo_cli import zoo_app
from scheduler.spec import JobSpec, SpecError, VerifySpec, load_job, parse_job

app = typer.Typer(add_completion=False, no_args_is_help=True, help="A compile farm for PyTorch 2 exported programs.")
app.add_typer(zoo_app, name="zoo")


def _run_job(job, store_uri: str, runner=None, job_id: str | None = None) -> None:
    from farm.console import ProgressEvents, console, failure_logs, out, results_table, stats_line
    from scheduler.jobs import execute, run_in_process
    from storage import StoreError

    store = _open_store(store_uri)
    try:
        with ProgressEvents() as events:
            outcome = execute(job, store, runner or run_in_process, events=events, job_id=job_id)
    except (StoreError, SpecError) as e:
        raise _fail(str(e)) from e
    rows = [r.to_row(outcome.job_id) for r in outcome.results]
    out.print(results_table(rows, f"job {outcome.job_id} · {outcome.wall_s:.1f} s"))
    out.print(
        f"{outcome.count('compiled')} compiled, {outcome.count('hit')} hits, {outcome.count('failed')} failed, "
        f"{outcome.retries} retries. "
        f"Artifacts and results are in {store.uri} (results: jobs/{outcome.job_id}/results.parquet)."
    )
    out.print(stats_line(outcome.stats))
    key = next((r.key for r in outcome.results if r.status in ("compiled", "hit")), None)
    if key:
        out.print(f"Fetch one (it prints how to load it): farm fetch {key} model.pt2 --store {store_uri}")
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
) -> None:
    """Compile graphs for targets in this process and print a results table."""
    try:
        job = parse_job(
            {"name": "compile", "graphs": [str(g) for g in graphs], "targets": target, "modules": module,
             "verify": {"atol": atol, "rtol": rtol}, "weights": weights},
            "command line", base_dir=Path.cwd(),
        )
    except SpecError as e:
        raise _fail(str(e)) from e
    _run_job(job, store)


@app.command()
def run(job_file: Path = typer.Argument(..., help="job spec (YAML)"), store: str = StoreOpt) -> None:
    """Run a job spec in this process."""
    try:
        job = load_job(job_file)
    except SpecError as e:
        raise _fail(str(e)) from e
    _run_job(job, store)


@app.command()
def submit(
    job_file: Path = typer.Argument(..., help="job spec (YAML)"),
    store: str = StoreOpt,
    address: Optional[str] = typer.Option(None, help="Ray cluster to join (default: RAY_ADDRESS, else start a local Ray)"),
    workers: Optional[int] = typer.Option(None, help="workers per device class (default: the job's limits, else every slot)"),
    timeout: Optional[float] = typer.Option(None, help="seconds before a unit is failed as timeout (default: the job's)"),
    retries: Optional[int] = typer.Option(None, help="re-queues of a unit whose worker died (default: the job's)"),
) -> None:
    """Run a job on Ray: long-lived workers per device class, live progress, results in the store."""
    from farm.console import console
    from scheduler.jobs import new_job_id
    from scheduler.ray_pool import PoolConfig, RayRunner, ray_session

    try:
        job = load_job(job_file)
    except SpecError as e:
        raise _fail(str(e)) from e
    if timeout:
        job = job.model_copy(update={"limits": job.limits.model_copy(update={"timeout_s": timeout})})
    limits = job.limits
    config = PoolConfig(workers=workers or limits.workers, retries=limits.retries if retries is None else retries)
    job_id = new_job_id(job.name)
    with ray_session(address) as session:
        if session.dashboard:
            console.print(f"Ray dashboard: {session.dashboard} (token: `ray get-auth-token`)")
        console.print(f"job {job_id}: `farm status {job_id} --store {store}` from any machine")
        _run_job(job, store, RayRunner(config, job_id=job_id, lookup_first=session.embedded), job_id=job_id)


@app.command()
def resources(slots: Optional[int] = typer.Option(None, help="CPU compile workers on this node (default: its cores)")) -> None:
    """The Ray resources this host offers the farm, as JSON: ray start --resources "$(farm resources)"."""
    import json

    from workers.backends import offered_resources

    typer.echo(json.dumps(offered_resources(slots or os.cpu_count() or 1)))


@app.command()
def status(job_id: str, store: str = StoreOpt) -> None:
    """How far a job got (queued, running, compiled, hits, failed, retries), read from the store."""
    from farm.console import out
    from scheduler.jobs import read_status

    doc = read_status(_open_store(store), job_id)
    if doc is None:
        raise _fail(f"no job {job_id} in {store}")
    counts = " · ".join(f"{k} {doc[k]}" for k in ("total", "queued", "running", "compiled", "hit", "failed", "retries"))
    out.print(f"{job_id}: {doc['state']} · {counts} · updated {doc.get('updated_at')}")


@app.command()
def fetch(key: str, dest: Path, store: str = StoreOpt) -> None:
    """Download the artifact of a unit KEY to DEST, verified against its digest."""
    from rich.markup import escape

    from farm.console import out
    from storage import StoreError
    from storage.signing import describe

    s = _open_store(store)
    try:
        manifest = s.get_manifest(key)
        if manifest is None:
            raise _fail(f"no manifest for key {key} in {s.uri}; `farm results JOB` lists the keys of a job")
        ref = manifest["blobs"]["artifact"]
        s.fetch(ref["digest"], dest)
    except (StoreError, ValueError) as e:
        raise _fail(str(e)) from e
    facts = manifest.get("artifact", {})
    out.print(escape(f"{dest}: {manifest['graph']} for {manifest['target']}") + f" ({ref['size']} bytes, sha256 {ref['digest'][:12]}… verified)")
    signed = describe(manifest)
    out.print(f"manifest {signed}" + ("" if s.trust.required else
              " (not checked: set FARM_VERIFY_KEY to the farm's verify.pem to require signatures)"
              if signed != "unsigned" else "; set FARM_VERIFY_KEY to refuse unsigned manifests"))
    for how in ("load", "load_other_weights"):
        if facts.get(how):
            out.print(escape(f"{'load with' if how == 'load' else 'with another checkpoint'}: "
                             f"{facts[how].replace('PATH', repr(str(dest)))}"))


@app.command()
def keygen(folder: Path = typer.Argument(..., help="where to write signing.pem and verify.pem")) -> None:
    """Make an Ed25519 key pair for signed manifests: FARM_SIGNING_KEY=signing.pem on workers,
    FARM_VERIFY_KEY=verify.pem wherever artifacts are consumed."""
    from farm.console import out
    from storage.signing import keygen as make_keys

    try:
        private, public = make_keys(folder)
    except FileExistsError as e:
        raise _fail(f"{folder}/signing.pem exists; pick an empty folder (never overwrite a signing key)") from e
    out.print(f"wrote {private} (private: keep it on workers only, as FARM_SIGNING_KEY) and {public} "
              f"(FARM_VERIFY_KEY for every consumer)")


@app.command()
def results(job_id: str, store: str = StoreOpt) -> None:
    """Print the results table of a job from the store."""
    from farm.console import failure_logs, out, results_table, stats_line
    from storage.results import read_results
    from storage.stats import JobStats

    rows = read_results(_open_store(store), job_id)
    if rows is None:
        raise _fail(f"no results for job {job_id} in {store}")
    out.print(results_table(rows, f"job {job_id}"))
    out.print(stats_line(JobStats.from_rows(rows)))
    for line in failure_logs(rows, store):
        out.print(line)


@app.command()
def explain(
    keys: list[str] = typer.Argument(None, help="two keys (or unique prefixes) to diff"),
    job: Optional[str] = typer.Option(None, "--job", help="explain every miss of this job"),
    store: str = StoreOpt,
) -> None:
    """Why did a unit not hit? Diff two keys, or explain every miss of a job against the closest key in the store."""
    from farm.console import diff_table, out
    from rich.markup import escape

    from farm.explain import ExplainError, explain_job, explain_keys
    from storage import StoreError

    if (job is None) == (len(keys or []) != 2):
        raise _fail("give two keys (farm explain KEY_A KEY_B) or a job (farm explain --job JOB)")
    s = _open_store(store)
    try:
        if job is None:
            a, b, diffs = explain_keys(s, *keys)
            out.print(diff_table(diffs, a, b) if diffs else f"{a[:16]}… and {b[:16]}… have the same components")
            return
        misses = explain_job(s, job)
    except (ExplainError, StoreError) as e:
        raise _fail(str(e)) from e
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
def log(digest_or_key: str, store: str = StoreOpt) -> None:
    """Print a unit's log, by log digest (results' log_digest) or by unit key."""
    from storage import StoreError

    s = _open_store(store)
    try:
        manifest = s.get_manifest(digest_or_key) if len(digest_or_key) == 64 else None
        digest = manifest["blobs"]["log"]["digest"] if manifest else digest_or_key
        typer.echo(s.get_bytes(digest).decode(errors="replace"))
    except (StoreError, ValueError) as e:
        raise _fail(str(e)) from e
