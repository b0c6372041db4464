"""The store a gang's processes meet through (c10d TCPStore): the gang actors' (workers/gang/rank.py)
and their sandboxes' (workers/gang/steps.py). Its own module, so a gang actor imports neither
the sandbox's steps nor what they need (sympy)."""
from __future__ import annotations

import datetime as dt
import ipaddress
import os
import socket

import torch.distributed as dist


def open_store(host: str, port: int, host_it: bool, timeout_s: float) -> dist.TCPStore:
    """A gang's store. Its host listens on `host` only (torch's own listener takes every
    interface), on a free port read back from `.port`; the others connect to it."""
    timeout = dt.timedelta(seconds=timeout_s)
    if ipaddress.ip_address(host).is_loopback:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's own connections stay on loopback too
    if not host_it:
        return dist.TCPStore(host, port, is_master=False, timeout=timeout)
    listener = socket.create_server((host, 0), backlog=1024)
    port = listener.getsockname()[1]
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout,
                         master_listen_fd=listener.detach())  # the store owns the socket from here
