"""A training step under plain `torch.compile` (forward and backward), in a fresh process: what a
training script that never exports does. Prints the Inductor and AOTAutograd cache counters as
JSON on its last line. Its remote caches come from the environment alone
(TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE, TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE, TORCHINDUCTOR_REDIS_URL):
tests/test_remote_cache.py."""
from __future__ import annotations

import json

import torch
from torch._dynamo.utils import counters


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def main() -> None:
    torch.manual_seed(0)
    net = Net()
    step = torch.compile(lambda x: net(x).square().mean())
    step(torch.randn(8, 16)).backward()
    grads = sum(p.grad.abs().sum().item() for p in net.parameters())
    print(json.dumps({"inductor": dict(counters["inductor"]), "aot_autograd": dict(counters["aot_autograd"]),
                      "grads": grads}))


if __name__ == "__main__":
    main()
