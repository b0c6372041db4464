"""Errors the CLI and clients catch without importing Ray: `farm compile`, `farm run` and a
submit through a service's store inbox work on a host that has no Ray (the lent GPU machine
has none; a laptop need not)."""
from __future__ import annotations


class JoinFailed(RuntimeError):
    """This process could not join the Ray cluster it was pointed at; the message says why and what to do."""


class ServiceError(RuntimeError):
    """The farm service could not be started, reached or stopped; the message says what to do."""


class JobInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) reached the process running a job in process or on its own Ray: its record
    now says cancelled. What it published stays; the unit in flight published nothing."""

    def __init__(self, job_id: str):
        super().__init__(job_id)
        self.job_id = job_id
