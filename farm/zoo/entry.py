"""What a zoo entry is: how to build the model, its example inputs and dynamic dimensions, the
targets it is compiled for and the tolerances it is verified at."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn
from torch.export import Dim

from workers.unit import VerifyPolicy


def BATCH() -> Dim:
    return Dim("batch", min=1, max=64)


def SEQ() -> Dim:
    return Dim("seq", min=2, max=64)


@dataclass(frozen=True)
class ZooModel:
    name: str
    family: str  # what kind of model, for the report (mlp, cnn, transformer, moe, …)
    build: Callable[[], nn.Module]  # random weights from torch.manual_seed(0): nothing is downloaded
    example: Callable[[], tuple[tuple, dict[str, Any]]]  # (args, kwargs)
    dynamic: Callable[[], dict[str, Any]]  # dynamic_shapes for torch.export, by input name
    targets: tuple[str, ...] = ("aoti-cpu",)
    atol: float = VerifyPolicy.atol
    rtol: float = VerifyPolicy.rtol
    needs: tuple[str, ...] = ()  # optional packages (extras) the entry needs to be built and loaded
    modules: tuple[str, ...] = ()  # modules the program's output types live in, imported before loading it

    def missing(self) -> list[str]:
        """The packages this entry needs that are not installed."""
        return [n for n in self.needs if importlib.util.find_spec(n) is None]
