"""Placing, finding and stopping a farm service on Ray: the detached `farm-scheduler` actor in
namespace `farm` (its body: scheduler/service.py). The only module that makes Ray calls about
the service; the client (farm/client.py) reaches it through here and imports no torch.
"""
from __future__ import annotations

import time
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError
from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_put

from scheduler.errors import ServiceError
from scheduler.ray_session import NAMESPACE, SERVICE_STORE_KEY
from scheduler.service import FarmScheduler
from scheduler.service_config import CacheSecrets, ServiceConfig

SERVICE = "farm-scheduler"
START_S = 120.0  # a scheduler that has not answered by then is reported, and stopped
CALL_S = 60.0

# num_cpus=0: the scheduler takes no worker slot. max_restarts=-1: Ray brings it back after a crash
# or a node loss, and the new one resumes the jobs in the store's records. Threaded, so a client's
# `farm jobs` is answered while jobs are planned.
_RemoteScheduler = ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=64)(FarmScheduler)


def find_service() -> Any | None:
    """The running service's actor on the joined cluster, or None."""
    try:
        return ray.get_actor(SERVICE, namespace=NAMESPACE)
    except ValueError:
        return None


def call(actor: Any, method: str, *args: Any, timeout: float = CALL_S) -> Any:
    """A call on the service; a scheduler that is restarting is waited for up to `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get(getattr(actor, method).remote(*args), timeout=max(1.0, deadline - time.monotonic()))
        except GetTimeoutError as e:
            raise ServiceError(f"the farm service did not answer `{method}` within {timeout:g}s; "
                               f"`ray list actors --filter name={SERVICE}` shows its state") from e
        except ActorUnavailableError as e:  # restarting: Ray brings it back (max_restarts=-1)
            if time.monotonic() > deadline:
                raise ServiceError(f"the farm service is restarting and did not answer `{method}` within "
                                   f"{timeout:g}s; try again in a minute") from e
            time.sleep(0.5)
        except RayActorError as e:
            if e.actor_init_failed:  # as it started (its store unreachable, say): the error's last line says why
                lines = [line.strip() for line in str(e).splitlines() if line.strip()]
                raise ServiceError(f"the farm service could not start on the cluster: {lines[-1] if lines else e}") from e
            raise ServiceError(f"the farm service died during `{method}` ({type(e).__name__}); "
                               f"`farm serve` starts it again") from e


def start_service(store_uri: str, config: ServiceConfig, cache_secrets: CacheSecrets | None = None) -> dict[str, Any]:
    """Start the service and wait until it answers; what it says of itself. With a cache
    (config.cache), the actor is placed on this process's node, where `farm serve` said it listens."""
    found = find_service()
    if found is not None:
        running = call(found, "ping")
        raise ServiceError(f"a farm service already runs on this cluster (store {running['store']}, since "
                           f"{running['started_at']}); `farm serve --stop` ends it")
    try:
        here = {}
        if config.cache is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            here = {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                          soft=False)}
        actor = _RemoteScheduler.options(name=SERVICE, namespace=NAMESPACE, lifetime="detached", **here).remote(
            store_uri, config, cache_secrets)
    except ValueError as e:  # another `farm serve` won the name meanwhile
        raise ServiceError(f"a farm service was just started on this cluster by someone else ({e})") from e
    try:
        info = call(actor, "ping", timeout=START_S)
    except ServiceError:
        ray.kill(actor, no_restart=True)
        raise
    # where a client that names only the cluster finds the service's store (ray_session.service_store),
    # and hands a job over through its inbox without starting a Ray driver
    _internal_kv_put(SERVICE_STORE_KEY, info["store"].encode(), overwrite=True, namespace=NAMESPACE.encode())
    if info.get("cache_error"):
        stop_service()
        raise ServiceError(f"the farm service's remote cache could not start on {config.cache.host}:"
                           f"{config.cache.port} ({info['cache_error']}); the service was stopped: choose another "
                           f"--cache-port, or check --cache-tls-cert/--cache-tls-key")
    return info


def stop_service() -> dict[str, Any]:
    """Stop the service: what became of its jobs and units."""
    actor = find_service()
    if actor is None:
        raise ServiceError("no farm service runs on this cluster; `farm serve` starts one")
    try:
        said = call(actor, "stop")
    finally:
        _internal_kv_del(SERVICE_STORE_KEY, namespace=NAMESPACE.encode())
        ray.kill(actor, no_restart=True)
    return said
