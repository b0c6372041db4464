"""A model whose output is a dataclass of its own, registered with torch.export as Hugging Face's
output types are: a process that reads its program must import this module first."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Output:
    logits: torch.Tensor


torch.export.register_dataclass(Output, serialized_type_name="tests.custom_output.Output")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x):
        return Output(self.lin(x))
