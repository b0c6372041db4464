"""Rank programs for gang tests, exported under torch's fake process group (as a user exports
each rank of a distributed model): data-parallel replicas, and tensor-parallel shards whose
forward all-reduces partial sums with functional collectives."""
from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.export import Dim


class Replica(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))

    def forward(self, x):
        return self.net(x)


class TensorParallelMLP(torch.nn.Module):
    """Megatron-style: a column-parallel layer, then a row-parallel one whose partial sums are
    all-reduced across the ranks (each rank holds its own shard of the weights)."""

    def __init__(self, extra_all_reduce: bool = False):
        super().__init__()
        self.up = torch.nn.Linear(16, 8)
        self.down = torch.nn.Linear(8, 16, bias=False)
        self.extra = extra_all_reduce

    def forward(self, x):
        y = funcol.all_reduce(self.down(torch.relu(self.up(x))), "sum", dist.group.WORLD)
        if self.extra:
            y = funcol.all_reduce(y, "sum", dist.group.WORLD)
        return y + x


@contextlib.contextmanager
def fake_group(rank: int, world_size: int) -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def replicas(out: Path, world_size: int, seed: int = 0) -> str:
    """One data-parallel model (its weights drawn with `seed`) saved once per rank (identical
    programs); returns the {rank} pattern."""
    torch.manual_seed(seed)
    ep = torch.export.export(Replica(), (torch.randn(4, 16),), dynamic_shapes={"x": {0: Dim("batch", min=2, max=64)}})
    torch.export.save(ep, out / "dp_rank0.pt2")
    for r in range(1, world_size):
        shutil.copy(out / "dp_rank0.pt2", out / f"dp_rank{r}.pt2")
    return str(out / "dp_rank{rank}.pt2")


def shards(out: Path, name: str, world_size: int, ranges: list[tuple[int, int]], examples: list[int],
           extra_on: int | None = None) -> list[str]:
    """Tensor-parallel rank programs, each with its own weights, batch range and example batch."""
    paths = []
    for r in range(world_size):
        torch.manual_seed(r)
        with fake_group(r, world_size):
            lo, hi = ranges[r]
            ep = torch.export.export(TensorParallelMLP(extra_all_reduce=r == extra_on), (torch.randn(examples[r], 16),),
                                     dynamic_shapes={"x": {0: Dim("batch", min=lo, max=hi)}})
        path = out / f"{name}_rank{r}.pt2"
        torch.export.save(ep, path)
        paths.append(str(path))
    return paths
