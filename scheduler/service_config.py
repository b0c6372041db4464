"""A farm service's settings (`farm serve`), read where it is started and handed to its
scheduler (scheduler/shared_pool.py uses them); no Ray here, so the CLI reads them cheaply."""
from __future__ import annotations

import os
from dataclasses import dataclass


def seconds_from_env(name: str, default: float | None) -> float | None:
    """A non-negative number of seconds from the environment (FARM_IDLE_S, FARM_INBOX_POLL_S), or
    the default where it is unset."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    unset = f"unset it for {default:g}" if default is not None else "unset it for the default"
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds; {unset}") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r} is negative; give a number of seconds, or {unset}")
    return value


@dataclass(frozen=True)
class CacheSettings:
    """`farm serve --cache-port`: the service also serves its store to PyTorch's own remote
    caches (storage/cache_server.py). Its users and TLS key travel apart (`CacheSecrets`), never in
    what the service says of itself."""
    port: int = 6380  # 0: any free port (tests)
    host: str = "127.0.0.1"
    max_value_mb: float = 64.0


@dataclass(frozen=True)
class CacheSecrets:
    users: tuple[tuple[str, str, str], ...]  # (name, role, token), from the tokens file
    tls_cert: str | None = None  # PEM text
    tls_key: str | None = None

    def __repr__(self) -> str:  # never in a log or a traceback
        return f"CacheSecrets({len(self.users)} users, tls={'yes' if self.tls_cert else 'no'})"


@dataclass(frozen=True)
class ServiceConfig:
    max_workers: int | None = None  # in all; None: every CPU the cluster offers
    min_workers: int = 0  # kept up while idle
    idle_s: float = 300.0  # an idle worker beyond min_workers stops after this
    retries: int = 2
    start_attempts: int = 3
    # how often the store's inbox is listed (storage/service_jobs.py, ServiceInbox); None: every
    # 0.05 s on a local store, 0.5 s on S3 (where each listing is a billed request)
    inbox_poll_s: float | None = None
    burst_workers: int = 1  # per CPU class, for interactive units while the class is busy (see above)
    cache: CacheSettings | None = None  # serve PyTorch's remote caches too (`farm serve --cache-port`)
