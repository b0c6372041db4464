"""Ray's own CLI with 127.0.0.1 kept as the node IP: `python -m scheduler.ray_loopback start --head
--node-ip-address 127.0.0.1 …`, then `… start --address 127.0.0.1:PORT --node-ip-address 127.0.0.1 …`
for more nodes on the same machine. Stock `ray start` replaces 127.0.0.1 by the host's address and
listens on every interface; this cluster listens on loopback alone (GCS, raylets, workers, agents;
give `--dashboard-host 127.0.0.1` too). For a cluster on one machine: tests, benchmarks, CI.
`farm submit --address 127.0.0.1:PORT` joins it as it is (scheduler/ray_session.py)."""
from __future__ import annotations

from scheduler.ray_session import loopback_kept


def main() -> None:
    from ray.scripts.scripts import cli

    with loopback_kept():
        cli(prog_name="ray")  # ends in SystemExit with Ray's own status


if __name__ == "__main__":
    main()
