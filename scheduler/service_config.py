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
