"""Ray's own CLI with 127.0.0.1 kept as the node IP: `python -m scheduler.ray_loopback start --head
--node-ip-address 127.0.0.1 …`, then `… start --address 127.0.0.1:PORT --node-ip-address 127.0.0.1 …`
for more nodes on the same machine. Stock `ray start` replaces 127.0.0.1 by the host's address and
listens on every interface; this cluster listens on loopback alone (GCS, raylets, workers, agents;
give `--dashboard-host 127.0.0.1` too). For a cluster on one machine: tests, benchmarks, CI.
`farm submit --address 127.0.0.1:PORT` joins it as it is (scheduler/ray_session.py)."""
from __future__ import annotations

import os

from scheduler.ray_session import loopback_kept


def main() -> None:
    from ray.scripts.scripts import cli  # reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER now: this command may start any node

    # The node's own processes (dashboard agents, workers, a Ray Job's driver) join with
    # `ray.init(address="127.0.0.1:…")` too. With this off, Ray resolves a loopback name in them
    # to 127.0.0.1 itself instead of the host's address, where nothing listens; it changes nothing
    # else on Linux but refusing `ray start --address`, which the line above has already passed.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    with loopback_kept():
        cli(prog_name="ray")  # ends in SystemExit with Ray's own status


if __name__ == "__main__":
    main()
