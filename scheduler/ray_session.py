"""Joining a Ray cluster, or starting the farm's own: the one place `ray.init` is called.

Two traps this file exists for (issue 14):
- `ray.init()` with no address joins a local cluster someone started with `ray start` (it reads
  /tmp/ray/ray_current_cluster), and then refuses the farm's resources. The embedded mode asks
  for `address="local"`: always a fresh instance of its own, whatever else runs on the machine.
- Joining with the wrong token, or an address nothing answers on, gives a bare
  `ConnectionError` naming another address than the one given (Ray replaces 127.0.0.1 with
  the host's IP), after two minutes of retries for an address nothing answers on. The farm
  probes the address first and says what it tried, where the token was looked for and what to
  run instead.
- A cluster that listens on loopback alone (`python -m scheduler.ray_loopback start …`, as the
  tests' cluster does) is out of stock Ray's reach by 127.0.0.1: Ray connects to the host's
  address instead, where nothing listens. The farm then joins it by 127.0.0.1 as given.
"""
from __future__ import annotations

import logging
import os
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import ray

from scheduler.errors import JoinFailed
from scheduler.gcs_kv import NAMESPACE, SERVICE_STORE_KEY, default_token_path, refused
from workers.backends import offered_resources

PROBE_S = 3.0
LOOPBACK = "127.0.0.1"  # the one loopback node IP that Ray 2.60 binds its gRPC servers to alone
_NODE_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # off: Ray's Python resolves loopback names to 127.0.0.1


@dataclass(frozen=True)
class RaySession:
    dashboard: str | None  # URL of the cluster's dashboard, when this process knows it
    embedded: bool  # this process started Ray: its workers share this Python environment
    address: str | None = None  # the GCS address workers and other drivers join


def _bootstrap(address: str) -> tuple[str, int] | None:
    """Where Ray will really connect for `address` (it replaces loopback names by the host's IP)."""
    from ray._private.services import canonicalize_bootstrap_address

    try:
        host, _, port = canonicalize_bootstrap_address(address).rpartition(":")
        return host.strip("[]"), int(port)
    except (ValueError, AttributeError):
        return None


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=PROBE_S):
            return True
    except OSError:
        return False


def service_store(address: str) -> tuple[str, str] | None:
    """The farm service's store URI, as the cluster at `address` keeps it in Ray's internal KV
    (SERVICE_STORE_KEY, left there by scheduler/ray_service.py), and the cluster's id; read with
    Ray's GCS client alone: a few milliseconds, where joining as a driver (`ray.init`) takes a
    second and more. None when the key is absent or the read fails: the caller then joins, and
    a failure to join says why; JoinFailed, as for a join, when nothing answers there or the
    cluster refuses this process's token."""
    from ray._raylet import GcsClient

    target = _joinable(address)
    if target is None:
        return None
    try:
        gcs = GcsClient(address=f"{target[0]}:{target[1]}")
        value = gcs.internal_kv_get(SERVICE_STORE_KEY, NAMESPACE.encode())
        cluster = gcs.cluster_id.hex()
    except Exception:  # Ray raises its own kinds (auth, RPC, timeouts), none of which this path needs to tell apart
        return None
    return (value.decode(), cluster) if isinstance(value, bytes) else None


def cluster_id() -> str | None:
    """The id of the cluster this process (a driver or an actor) is part of; None outside Ray."""
    if not ray.is_initialized():
        return None
    return ray._private.worker.global_worker.gcs_client.cluster_id.hex()


def _token_sources() -> str:
    """Where Ray looks for its auth token, and what it found (never the token itself)."""
    env = os.environ.get("RAY_AUTH_TOKEN")
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    default = default_token_path()
    parts = [f"RAY_AUTH_TOKEN is {'set' if env else 'not set'}"]
    if path:
        parts.append(f"RAY_AUTH_TOKEN_PATH={path} ({'exists' if Path(path).is_file() else 'missing'})")
    parts.append(f"{default} {'exists' if default.is_file() else 'is missing'}")
    mode = os.environ.get("RAY_AUTH_MODE", "(unset: no token is sent; set it to token)")
    return "; ".join(parts) + f"; RAY_AUTH_MODE={mode}"


def join_advice(address: str, target: tuple[str, int] | None, answered: bool, cause: str) -> str:
    """The error a user sees when joining fails: what was tried, why it probably failed, what to run."""
    where = f"{target[0]}:{target[1]}" if target else address
    lines = [f"could not join the Ray cluster at {address}: {cause}"]
    if target and where != address:
        lines.append(f"  Ray connects to {where} instead: it replaces 127.0.0.1 and localhost by this host's address")
    if not answered:
        lines.append(f"  nothing answers on {where}: is the head running? `ray status --address {where}` tells; "
                     f"`ray start --head --port PORT` starts one")
    else:
        lines.append(f"  something answers on {where}, so the likely cause is the auth token: this process and the "
                     f"cluster must hold the same one")
    lines.append(f"  token looked for in: {_token_sources()}")
    if answered and os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        lines.append(f"  this process sends no token, as RAY_AUTH_MODE is not `token`; `ray start` turns token auth on "
                     f"by itself where {default_token_path()} exists (any Ray started on that machine before, "
                     f"`./dev demo`'s included, wrote one): `export RAY_AUTH_MODE=token` and run again")
    lines.append("  on the head, `ray get-auth-token` prints the cluster's token; here, `export RAY_AUTH_TOKEN=<it>` "
                 "and run again")
    lines.append("  or leave out --address (and RAY_ADDRESS) to compile on an embedded Ray of this machine")
    return "\n".join(lines)


def _answering(address: str) -> tuple[str, int] | None:
    """Where Ray will connect for `address` (None if it cannot tell): Ray's replacement for a
    loopback name, or 127.0.0.1 itself where only that answers (a loopback-only cluster); JoinFailed,
    saying what to do, when nothing answers (Ray would retry for minutes before saying so)."""
    target = _bootstrap(address)
    if target and not _answers(*target):
        loopback = (LOOPBACK, target[1])
        if address.rpartition(":")[0] in ("127.0.0.1", "localhost") and _answers(*loopback):
            return loopback
        raise JoinFailed(join_advice(address, target, False, "no answer"))
    return target


def _joinable(address: str) -> tuple[str, int] | None:
    """_answering(address), and JoinFailed at once where the cluster there refuses this process's
    token (or its lack of one), not after Ray's client has retried for 20 s."""
    target = _answering(address)
    why = target and refused(f"{target[0]}:{target[1]}")
    if why:
        raise JoinFailed(join_advice(address, target, True, f"the cluster refused this process: {why}"))
    return target


def join(address: str, **init):
    """`ray.init` joining the cluster at `address`, by 127.0.0.1 itself where the cluster listens
    on loopback alone; JoinFailed saying what to do when that fails. Ray's INFO lines ("Connecting
    to existing Ray cluster…") are not shown: a command's own output says what it joined."""
    init.setdefault("logging_level", logging.WARNING)
    target = _joinable(address)
    try:
        if target and target[0] == LOOPBACK:
            with loopback_kept():
                return ray.init(address=f"{LOOPBACK}:{target[1]}", **init)
        return ray.init(address=address, **init)
    except (ConnectionError, ValueError) as e:
        raise JoinFailed(join_advice(address, target, True, str(e).strip().splitlines()[0][:300])) from e


@contextmanager
def loopback_kept() -> Iterator[None]:
    """Ray on loopback only. Ray replaces a node IP of 127.0.0.1 by this host's address
    (`services.resolve_ip_for_localhost`: 192.0.2.2 on the CI machines), and then its GCS, raylet,
    workers and agents listen on every interface (Ray 2.60 binds gRPC to 127.0.0.1 only when the
    node IP is exactly that). Kept as 127.0.0.1 while `ray.init` (the embedded Ray) or `ray start`
    (scheduler/ray_loopback.py) starts a node, every one of them listens on loopback alone, and no
    other machine can join; a driver joining such a cluster keeps it too, or Ray would look for the
    GCS at the host's address.

    The node's own processes (dashboard agents, workers, a Ray Job's driver) join it by
    `ray.init(address="127.0.0.1:…")` as well, in processes of their own: they inherit
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, with which Ray resolves a loopback name to 127.0.0.1
    itself. On Linux it changes nothing else but refusing `ray start --address`, and Ray reads it
    at import: this process, which has imported Ray already, is not refused."""
    from ray._private import services

    replace, inherited = services.resolve_ip_for_localhost, os.environ.get(_NODE_LOOPBACK_ENV)
    services.resolve_ip_for_localhost = lambda host: host if host == LOOPBACK else replace(host)
    os.environ[_NODE_LOOPBACK_ENV] = "0"
    try:
        yield
    finally:
        services.resolve_ip_for_localhost = replace
        if inherited is None:
            os.environ.pop(_NODE_LOOPBACK_ENV, None)
        else:
            os.environ[_NODE_LOOPBACK_ENV] = inherited


AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


@contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Logger `name` says only errors inside."""
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(before)


_CURRENT: list[RaySession] = []  # the session this process opened, while Ray is up


@contextmanager
def ray_session(address: str | None, slots: int | None = None, metrics_port: int | None = None,
                keep: bool = False) -> Iterator[RaySession]:
    """Join a cluster (address, or RAY_ADDRESS; token auth from RAY_AUTH_TOKEN or ~/.ray/auth_token)
    or start an embedded Ray of this process's own on loopback, its metrics on `metrics_port`.
    With `keep`, an embedded Ray stays up for the next session of this process (a notebook's
    next job); Ray stops it when the process exits."""
    if ray.is_initialized():
        yield _CURRENT[0] if _CURRENT else RaySession(None, embedded=False)
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ctx = join(address, namespace=NAMESPACE, log_to_driver=False)
    else:
        slots = slots or os.cpu_count() or 1
        # Ray turns token auth on for a new local cluster when RAY_AUTH_MODE is unset, and warns that
        # RAY_AUTH_MODE=disabled opts out, which reads as advice: that one warning is not shown. Its
        # INFO lines neither: the CLI prints the dashboard's address itself.
        with loopback_kept(), _quiet(AUTH_LOGGER):
            ctx = ray.init(address="local", num_cpus=slots, resources=offered_resources(slots), namespace=NAMESPACE,
                           include_dashboard=True, dashboard_host="127.0.0.1", _node_ip_address="127.0.0.1",
                           log_to_driver=False, _metrics_export_port=metrics_port, logging_level=logging.WARNING)
    url = ctx.dashboard_url
    session = RaySession(f"http://{url}" if url and not url.startswith("http") else url, embedded=not address,
                         address=ctx.address_info.get("gcs_address"))
    _CURRENT[:] = [session]
    try:
        yield session
    finally:
        if session.embedded and not keep:
            ray.shutdown()
            _CURRENT.clear()
