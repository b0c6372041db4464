"""The farm from Python: submit a job, follow it, read its results; fetch what it built.

    from farm.client import submit
    job = submit("job.yaml", store="s3://bucket/farm")      # or a dict, or a JobSpec
    job.results().to_pandas()                                # one row per unit
    job.stats()["hit_rate"]

`farm submit`, `status`, `results`, `fetch` and their `--json` output are a thin layer over
this module. Keys may be given as the unique prefixes tables print, job ids likewise.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from farm.stores import open_store
from farm.warm import WarmStartError, warm_start
from scheduler.fair import weight_of
from storage import Store, UnknownKey
from storage.service_jobs import JOB_ID, ServiceInbox, ServiceJobs

if TYPE_CHECKING:  # the job's side (pyarrow, the spec's and the scheduler's modules) is imported as it is used:
    import pyarrow as pa  # a training process that only wants use_farm_cache never pays for it

    from scheduler.jobs import Events, JobOutcome
    from scheduler.spec import JobSpec
    from scheduler.warm_workers import WarmWorkers

__all__ = ["FarmCache", "JobHandle", "UnknownJob", "WarmStartError", "fetch", "job", "load_compiled", "load_tuned",
           "resolve_job", "run", "submit", "use_farm_cache", "warm_start"]


def __getattr__(name: str):
    """load_compiled and load_tuned import torch, and use_farm_cache what a training process
    needs: only when asked for, so submitting to a farm service imports none of it."""
    if name in ("load_compiled", "load_tuned"):
        from farm import loading

        return getattr(loading, name)
    if name in ("FarmCache", "use_farm_cache"):
        from farm import jit_cache

        return getattr(jit_cache, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class UnknownJob(ValueError):
    """No job, or more than one, answers to the id (or prefix) asked for."""


def resolve_job(store: Store, text: str) -> str:
    """A job id, or a unique prefix of one. A job handed to a farm service through the store's
    inbox counts from then on: `farm submit --detach` prints its id before the service takes it."""
    ids = store.job_ids()
    if text in ids:
        return text
    # the service records a job before it removes the inbox's entry: asked in this order, no gap
    if JOB_ID.fullmatch(text) and (ServiceInbox(store).waiting(text) or ServiceJobs(store).get(text) is not None
                                   or text in store.job_ids()):
        return text
    found = [j for j in ids if j.startswith(text)]
    if len(found) != 1:
        raise UnknownJob(f"{'no job' if not found else f'{len(found)} jobs'} in {store.uri} "
                         f"{'is' if not found else 'start with'} {text!r}" +
                         ("" if not found else f" ({', '.join(found[:5])}); give more characters"))
    return found[0]


@dataclass
class JobHandle:
    """A job in a store: submitted from here (then `wait()` joins it), or found by id (`job()`)."""
    job_id: str
    store: Store
    _thread: threading.Thread | None = field(default=None, repr=False)
    _error: BaseException | None = field(default=None, repr=False)
    outcome: JobOutcome | None = None  # set when the job ran in this process and finished

    def status(self) -> dict[str, Any]:
        """How far the job got, from the store: state, total, queued, running, compiled, hit, failed, retries."""
        from scheduler.jobs import empty_status, read_status

        doc = read_status(self.store, self.job_id)
        if doc is not None:
            return doc
        record = ServiceJobs(self.store).get(self.job_id)  # a farm service's job it has not started yet
        if record is not None:
            return {**empty_status(self.job_id, record.state), "error": record.error}
        inbox = ServiceInbox(self.store)
        if inbox.waiting(self.job_id):  # handed over through the store, not taken yet
            waits = None if inbox.alive() else (f"no farm service watches {self.store.uri} now; the job waits in its "
                                                "inbox for one (`farm serve`)")
            return {**empty_status(self.job_id, "queued"), "error": waits}
        raise UnknownJob(f"no job {self.job_id} in {self.store.uri}")

    def done(self) -> bool:
        from scheduler.jobs import ENDED

        if self._thread is not None:
            return not self._thread.is_alive()
        return self.status()["state"] in ENDED

    def wait(self, timeout: float | None = None, every: float = 1.0) -> "JobHandle":
        """Wait for the job: one submitted from here (re-raising what stopped it: a bad spec, an
        unreachable store), or one a farm service runs (followed in the store)."""
        if self._thread is not None:
            self._thread.join(timeout)
        elif self.outcome is None:
            deadline = None if timeout is None else time.monotonic() + timeout
            while not self.done() and (deadline is None or time.monotonic() < deadline):
                time.sleep(every)
            if self.done():
                from scheduler.jobs import read_outcome

                self.outcome = read_outcome(self.store, self.job_id)
        if self._error is not None:
            raise self._error
        return self

    def results(self) -> pa.Table:
        """One row per unit (columns: storage.results.RESULTS_SCHEMA); `.to_pandas()` for a DataFrame."""
        from scheduler.jobs import ENDED
        from storage.results import read_results_table

        self.wait()
        table = read_results_table(self.store, self.job_id)
        if table is None:
            status = self.status()
            why = f" ({status['error']})" if status.get("error") else ""
            if status["state"] in ENDED:
                raise UnknownJob(f"job {self.job_id} has no results in {self.store.uri}: it ended {status['state']}{why}")
            raise UnknownJob(f"job {self.job_id} has no results in {self.store.uri} yet: it is {status['state']}")
        return table

    def stats(self) -> dict[str, Any]:
        """Hit rate, compile time saved and spent, bytes moved (storage.stats.JobStats)."""
        import json

        from storage.stats import STATS_FILE

        self.wait()
        data = self.store.get_job_file(self.job_id, STATS_FILE)
        if data is None:
            raise UnknownJob(f"job {self.job_id} has no stats in {self.store.uri} yet: it is {self.status()['state']}")
        return json.loads(data)


def job(job_id: str, store: str | Store | None = None) -> JobHandle:
    """A handle on a job already in the store (id or unique prefix), submitted from anywhere."""
    s = open_store(store, create=False)
    return JobHandle(resolve_job(s, job_id), s)


def _start(spec: JobSpec | dict | str | Path, store: str | Store | None, wait: bool, events: Events,
           run_job: Callable[[JobSpec, Store, str, Events], JobOutcome]) -> JobHandle:
    from farm.service_client import job_spec
    from scheduler.jobs import new_job_id

    spec, s = job_spec(spec), open_store(store)
    handle = JobHandle(new_job_id(spec.name), s)

    def go() -> None:
        try:
            handle.outcome = run_job(spec, s, handle.job_id, events)
        except BaseException as e:  # handed to whoever waits: the thread has no one else to tell
            handle._error = e

    if wait:
        handle.outcome = run_job(spec, s, handle.job_id, events)
    else:
        handle._thread = threading.Thread(target=go, name=f"farm job {handle.job_id}", daemon=True)
        handle._thread.start()
    return handle


def submit(spec: JobSpec | dict | str | Path, store: str | Store | None = None, address: str | None = None,
           wait: bool = True, workers: int | None = None, events: Events | None = None,
           metrics_port: int | None = None, on_session: Callable[[Any, str], None] | None = None,
           priority: str | None = None, warm: WarmWorkers | None = None) -> JobHandle:
    """Run a job on Ray: the cluster at `address` (or RAY_ADDRESS), else an embedded Ray of this
    process's own, kept up for the next submit (its Prometheus metrics on `metrics_port`). With
    `wait=False` it returns at once; the handle's `status()` follows it. `on_session(session,
    job_id)` is called once Ray is up (the CLI prints the dashboard's URL). `warm`, a
    scheduler.warm_workers.WarmWorkers, is for a caller that runs jobs one after another in one
    Ray session (`farm zoo run`): the job takes the workers the last one left idle, and leaves its
    own there; the caller stops them (scheduler.ray_pool.close_workers).

    Where a farm service runs on that cluster (`farm serve`), or watches the store, the job is
    handed to it (farm/service_client.py, `find`): it runs there at `priority` (default: the
    spec's) and goes on if this process ends; `store` must be the service's or None. `events` and
    `metrics_port` do not apply there."""
    from farm.service_client import find, job_spec
    from scheduler.jobs import NoEvents, execute

    service = find(address, store)
    if service is not None:
        s = service.store(store)
        handle = JobHandle(service.submit(spec, store, priority=priority, workers=workers), s)
        return handle.wait(every=0.25) if wait else handle
    if priority is not None:  # a job's own pool serves it alone: the priority is only recorded
        weight_of(priority)
        spec = job_spec(spec).model_copy(update={"priority": priority})
    from scheduler.ray_observe import RayObserver
    from scheduler.ray_pool import PoolConfig, RayCluster, RayRunner
    from scheduler.ray_session import ray_session

    def on_ray(job: JobSpec, s: Store, job_id: str, ev: Events) -> JobOutcome:
        import ray

        config = PoolConfig(workers=workers or job.limits.workers, retries=job.limits.retries)
        observer = RayObserver(ev, job.name, job_id, s.uri)
        with contextlib.ExitStack() as stack:
            joined: list = []

            def join() -> None:
                if not joined:
                    joined.append(stack.enter_context(ray_session(address, metrics_port=metrics_port, keep=True)))
                    if on_session is not None:
                        on_session(joined[0], job_id)

            # An embedded Ray of this process's own starts only once a unit needs a worker: a job of
            # hits (answered here, in a sandbox) needs none. A cluster is joined at once.
            embedded = not (address or os.environ.get("RAY_ADDRESS")) and not ray.is_initialized()
            if not embedded:
                join()
            lookup_first = embedded or joined[0].embedded
            runner = RayRunner(config, job_id=job_id, lookup_first=lookup_first, cluster=RayCluster(join), warm=warm)
            outcome = execute(job, s, runner, observer, job_id)
            observer.done(outcome)
            return outcome

    return _start(spec, store, wait, events or NoEvents(), on_ray)


def run(spec: JobSpec | dict | str | Path, store: str | Store | None = None, wait: bool = True,
        events: Events | None = None) -> JobHandle:
    """Run a job in this process, one unit at a time (no Ray)."""
    from scheduler.jobs import NoEvents, execute

    return _start(spec, store, wait, events or NoEvents(), lambda job, s, job_id, ev: execute(job, s, events=ev, job_id=job_id))


def artifact_file_name(target: str) -> str:
    """What a unit's artifact is called when no name is given: by what its target builds."""
    if target.startswith("executorch"):
        return "model.pte"
    return "artifact.tar" if target.endswith("+train") or target.startswith("aot-compile") else "model.pt2"


def fetch(key: str, dest: str | Path, store: str | Store | None = None) -> dict[str, Any]:
    """Download a unit's artifact (key or unique prefix) to dest (a file, or a directory to put it
    in under its usual name: artifact_file_name), checked against its digest; what it is and how
    to load it."""
    from storage.signing import describe

    s = open_store(store, create=False)
    full = s.resolve_key(key)
    manifest, incomplete = s.complete_manifest(full)  # signature checked when FARM_VERIFY_KEY is set
    if incomplete:
        raise UnknownKey(f"unit {full} in {s.uri} cannot be fetched: {incomplete}. Run its job again: the farm "
                         "compiles it again and replaces the manifest")
    if manifest is None:
        raise UnknownKey(f"no manifest for key {full} in {s.uri}; `farm results JOB` lists a job's keys")
    s.note_use(full, manifest)
    ref = manifest["blobs"]["artifact"]
    dest = Path(dest)
    path = s.fetch(ref["digest"], dest / artifact_file_name(manifest["target"]) if dest.is_dir() else dest)
    facts = manifest.get("artifact", {})
    return {"key": full, "graph": manifest["graph"], "target": manifest["target"], "path": str(path),
            "bytes": ref["size"], "sha256": ref["digest"], "signature": describe(manifest),
            "signatures_required": s.trust.required,
            **{how: facts[how].replace("PATH", repr(str(path))) for how in ("load", "load_other_weights") if facts.get(how)}}
