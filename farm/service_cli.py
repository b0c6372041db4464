"""`farm serve`, `farm jobs`, `farm cancel`: running the farm as a service for a team, on Ray."""
from __future__ import annotations

import json
import os
from typing import Optional

import typer

from farm.cli_common import StoreOpt, fail, store_failed

AddressOpt = typer.Option(None, "--address", help="the Ray cluster (default: RAY_ADDRESS)")


def _address(address: str | None) -> str:
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise fail("a farm service runs on a Ray cluster: give --address HOST:PORT or set RAY_ADDRESS "
                   "(`ray start --head` starts one; README: Running a farm for a team)")
    return address


def _service(address: str | None):
    """The service on the cluster, or a clear error."""
    from farm.service_client import connect
    from scheduler.errors import JoinFailed, ServiceError

    address = _address(address)
    try:
        service = connect(address)
    except (JoinFailed, ServiceError) as e:
        raise fail(str(e)) from e
    if service is None:
        raise fail(f"no farm service runs on the Ray cluster at {address}; `farm serve --address {address}` starts one")
    return service


def serve(
    address: Optional[str] = AddressOpt,
    store: str = StoreOpt,
    stop: bool = typer.Option(False, "--stop", help="end the running service, and say what became of its units"),
    max_workers: Optional[int] = typer.Option(None, min=1, help="compile workers in all (default: every CPU the cluster offers)"),
    min_workers: int = typer.Option(0, min=0, help="workers kept up while idle"),
    retries: int = typer.Option(2, min=0, help="re-queues of a unit whose worker died"),
    cache_port: Optional[int] = typer.Option(None, "--cache-port", min=0, max=65535, help="also serve the store to PyTorch's own "
                                             "remote caches on this port (as `farm cache-serve`), from this node"),
    cache_tokens: Optional[str] = typer.Option(None, "--cache-tokens", help="its users: 'NAME ROLE TOKEN' lines"),
    cache_host: str = typer.Option("127.0.0.1", "--cache-host", help="its address (loopback unless --cache-tls-cert)"),
    cache_tls_cert: Optional[str] = typer.Option(None, "--cache-tls-cert", help="serve it with TLS (rediss://)"),
    cache_tls_key: Optional[str] = typer.Option(None, "--cache-tls-key", help="the certificate's private key"),
) -> None:
    """Start the farm as a long-lived service on a Ray cluster (a detached `farm-scheduler` actor,
    namespace `farm`) and return once it answers. Jobs submitted to the cluster then share its
    warm workers by priority."""
    from farm.console import console, out
    from farm.service_client import absolute_store
    from scheduler.errors import JoinFailed, ServiceError
    from scheduler.ray_service import start_service, stop_service
    from scheduler.ray_session import ray_session
    from scheduler.service_config import ServiceConfig, seconds_from_env

    address = _address(address)
    cache, secrets = _cache(cache_port, cache_tokens, cache_host, cache_tls_cert, cache_tls_key) if not stop else (None, None)
    try:
        config = ServiceConfig(max_workers=max_workers, min_workers=min_workers, retries=retries,
                               idle_s=seconds_from_env("FARM_IDLE_S", 300),
                               inbox_poll_s=seconds_from_env("FARM_INBOX_POLL_S", None), cache=cache)
        with ray_session(address, keep=True):
            if stop:
                said = stop_service()
                out.print(f"farm service stopped. Jobs it ran, recorded as cancelled: {', '.join(said['jobs']) or 'none'}; "
                          f"units failed (retryable, nothing half-published): {said['running']} running, "
                          f"{said['queued']} queued")
                return
            info = start_service(absolute_store(store), config, secrets)
            builders = _builders_missing(address)
    except (JoinFailed, ServiceError, ValueError) as e:
        raise fail(str(e)) from e
    resumed = f"; resumed jobs: {', '.join(info['resumed'])}" if info["resumed"] else ""
    out.print(f"farm service up on {address}: actor farm-scheduler (namespace farm), store {info['store']}, "
              f"idle workers stop after {config.idle_s:g}s (FARM_IDLE_S){resumed}")
    if info.get("cache"):
        out.print(f"PyTorch's remote caches: {info['cache']} (README: PyTorch's own remote caches)")
    out.print(f"submit with `farm submit JOB.yaml --store {info['store']}` (through the store: no Ray needed) or "
              f"`--address {address}`, [--priority interactive|batch|nightly]; `farm jobs --address {address}` lists jobs")
    if builders:
        console.print(builders)


def _builders_missing(address: str) -> str | None:
    """What to do when no node of the joined cluster offers the farm's resources (a head started
    without `--resources "$(farm resources)"`): every unit would fail at once, naming it."""
    import ray

    if any(name.startswith("farm_") for name in ray.cluster_resources()):
        return None
    return (f"warning: no node of this cluster offers the farm's resources (farm_cpu_*, farm_gpu_*), so every unit "
            f"submitted will fail until one does; start nodes with `ray start --address {address} --resources "
            "\"$(farm resources)\"` (or start the head with it)")


def _cache(port: int | None, tokens: str | None, host: str, tls_cert: str | None, tls_key: str | None):
    """The cache's settings and secrets for `farm serve --cache-port`, checked here as
    `farm cache-serve` checks them."""
    from pathlib import Path

    from farm.cache_cli import checked_tls, refuse_plaintext
    from scheduler.service_config import CacheSecrets, CacheSettings
    from storage.cache_tokens import TokensError, read_tokens

    if port is None:
        if tokens or tls_cert or tls_key:
            raise fail("--cache-tokens and --cache-tls-* go with --cache-port: give it, or none of them")
        return None, None
    if tokens is None:
        raise fail("--cache-port needs --cache-tokens: a file of 'NAME ROLE TOKEN' lines (README: PyTorch's own remote caches)")
    try:
        users = read_tokens(tokens)
    except TokensError as e:
        raise fail(str(e)) from e
    refuse_plaintext(host, checked_tls(tls_cert, tls_key) is not None, "--cache-")
    pem = lambda path: Path(path).read_text() if path else None  # noqa: E731
    return CacheSettings(port=port, host=host), CacheSecrets(users.as_tuples(), pem(tls_cert), pem(tls_key))


def jobs(address: Optional[str] = AddressOpt,
         as_json: bool = typer.Option(False, "--json", help="print the jobs as a JSON list"),
         store: Optional[str] = typer.Option(None, "--store", help="read them from the service's store instead: "
                                                                   "no Ray needed (counts lag by about a second)")) -> None:
    """Queued, running and recently ended jobs of the farm service, with progress and priority;
    with --store, also the latest jobs that ran without one."""
    from rich.table import Table

    from farm.console import out

    if store is not None:
        from farm.service_client import jobs_in_store
        from storage import StoreError

        try:
            rows = jobs_in_store(store)
        except StoreError as e:
            raise store_failed(e) from e
    else:
        rows = _service(address).jobs()
    if as_json:
        typer.echo(json.dumps(rows, indent=1))
        return
    table = Table(title=f"jobs in {store} ({len(rows)})" if store is not None else f"farm service jobs ({len(rows)})")
    for col in ("job", "priority", "state", "progress", "queued", "running", "hit", "failed", "submitted"):
        table.add_column(col)
    for r in rows:
        ended = r["compiled"] + r["hit"] + r["failed"] + r["skipped"]
        table.add_row(r["job_id"], r["priority"], r["state"] + (f" ({r['error']})" if r.get("error") else ""),
                      f"{ended}/{r['total']}", str(r["queued"]), str(r["running"]), str(r["hit"]), str(r["failed"]),
                      r["submitted_at"])
    out.print(table)


def cancel(job_id: str = typer.Argument(..., help="the job's id"), address: Optional[str] = AddressOpt,
           store: Optional[str] = typer.Option(None, "--store", help="ask through the service's store instead: "
                                                                     "no Ray needed")) -> None:
    """Cancel a job of the farm service: its queued units are dropped, its running ones stopped
    (nothing half-published); units already done keep their artifacts."""
    from farm.console import out
    from farm.service_client import ServiceRefused, cancel_in_store
    from storage import StoreError

    try:
        said = cancel_in_store(store, job_id) if store is not None else _service(address).cancel(job_id)
    except (ServiceRefused, StoreError) as e:
        raise store_failed(e) from e
    out.print(f"job {said['job_id']} cancelled: {said['units_stopped']} units dropped or stopped")


def register(app: typer.Typer) -> None:
    app.command()(serve)
    app.command()(jobs)
    app.command()(cancel)

