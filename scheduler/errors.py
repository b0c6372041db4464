"""Errors the CLI and clients catch without importing Ray: `farm compile` and `farm run` work
on a host that has no Ray (the lent GPU machine has none)."""
from __future__ import annotations


class JoinFailed(RuntimeError):
    """This process could not join the Ray cluster it was pointed at; the message says why and what to do."""
