"""The sandbox steps of a gang (workers/gang/rank.py): what a rank's program says about its
collectives and shapes, and the process group its artifact runs in to be verified.

The sandbox children of a gang's ranks form their own process group (gloo on CPU, NCCL on
GPU), through a store that rank 0's child hosts: the artifacts under test issue collectives,
so they run where those collectives meet the other ranks' artifacts, never in a process that
holds credentials."""
from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

import torch
import torch.distributed as dist
from torch.export import ExportedProgram

from workers.check.inputs import input_sets
from workers.gang.collectives import collective_ops, dim_ranges, regroup
from workers.gang.rendezvous import open_store
from workers.unit import Unit


def gang_facts(ep: ExportedProgram) -> dict[str, Any]:
    """What the gang's compiler collectives compare, as plain values."""
    ranges, examples = dim_ranges(ep)
    observed: dict[str, set[int]] = {}
    for inputs in input_sets(ep):  # the sizes a torch.compile lowering calls the program at
        flat = torch.utils._pytree.tree_leaves((inputs.args, inputs.kwargs))
        for name, value in zip(ep.graph_signature.user_inputs, flat):
            if isinstance(value, torch.Tensor):
                for i, n in enumerate(value.shape):
                    observed.setdefault(f"{name}.{i}", set()).add(int(n))
    return {"collectives": [dataclasses.asdict(op) for op in collective_ops(ep)],
            "ranges": {w: list(r) for w, r in ranges.items()}, "examples": examples,
            "observed": {w: sorted(s) for w, s in observed.items()}}


class GangSteps:
    """Mixed into workers.sandbox.steps.Steps."""
    _gang_store: Any = None
    _reference_group: Any = None

    def eager_reference(self, ep: ExportedProgram) -> torch.fx.GraphModule:
        """The program to run eagerly against an artifact. In a gang it issues its collectives on a
        group of its own (the same ranks): gloo's worker thread drops a finished work under its
        queue lock, and dropping an eager tensor needs the GIL, which a running AOTInductor model
        holds while it waits on that queue; sharing WORLD hung verification (torch 2.13)."""
        module = ep.module()
        if self._reference_group is None:
            return module
        return regroup(module, {dist.group.WORLD.group_name: self._reference_group.group_name})

    def gang_host(self, unit: Unit, host: str, timeout_s: float) -> dict[str, Any]:
        """Rank 0: host the store the gang's sandboxes meet through, on a free port."""
        self._gang_store = open_store(host, 0, True, timeout_s)
        return {"port": self._gang_store.port}

    def gang_join(self, unit: Unit, host: str, port: int, rank: int, world_size: int, timeout_s: float,
                  on: str) -> dict[str, Any]:
        """Form the gang's process group: WORLD here is the group (name "0") the artifacts were built for."""
        import torch.distributed._functional_collectives  # noqa: F401  (as in a child that lowered)

        timeout = dt.timedelta(seconds=timeout_s)
        if self._gang_store is None:
            self._gang_store = open_store(host, port, False, timeout_s)
        if on == "cuda":
            torch.cuda.set_device(0)  # the one GPU this sandbox sees
        dist.init_process_group("nccl" if on == "cuda" else "gloo", store=self._gang_store, rank=rank,
                                world_size=world_size, timeout=timeout)
        self._reference_group = dist.new_group(list(range(world_size)), timeout=timeout)
        return {"group": dist.group.WORLD.group_name, "reference_group": self._reference_group.group_name}

    def gang_stand_in(self, unit: Unit, rank: int, world_size: int) -> dict[str, Any]:
        """Lowering a graph with collectives resolves its group by name ("0"), but the other ranks
        are not there to form one yet: torch's fake process group stands in (nothing is sent)."""
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        return {}
