"""A training step under plain `torch.compile` (forward and backward), in a fresh process: what a
training script that never exports does. Prints the Inductor and AOTAutograd cache counters as
JSON on its last line. Its remote caches come from the environment alone
(TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE, TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE, TORCHINDUCTOR_REDIS_URL):
tests/test_remote_cache.py. With FARM_CACHE_STORE or FARM_CACHE_URL set, they are the farm's, through
`use_farm_cache` (FARM_CACHE_WRITE=0: it only reads), and its counts are printed too; kernel
builds are counted either way (workers/backends/kernels.py, counting_builds). FARM_STEP_DEVICE=cuda
runs it on the GPU (bench/gpu_zoo.sh). It prints the seconds of its imports, of use_farm_cache, of the step, and from its first line to its
last (the rest of a timed process is the interpreter's start and exit; FARM_STEP_EXIT_TRACE=FILE
writes every thread's stack there each 0.5 s after that last line, to show where an exit waits)."""
from __future__ import annotations

import json
import os
import time

BEGAN = time.perf_counter()  # what the process spends outside the step shows on a GPU host (bench/gpu_zoo.sh)

import torch  # noqa: E402
from torch._dynamo.utils import counters


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def main() -> None:
    from workers.backends.kernels import counting_builds

    imported = time.perf_counter()
    farm = None
    if os.environ.get("FARM_CACHE_STORE") or os.environ.get("FARM_CACHE_URL"):
        from farm.client import use_farm_cache

        farm = use_farm_cache(store=os.environ.get("FARM_CACHE_STORE"), url=os.environ.get("FARM_CACHE_URL"),
                              write=os.environ.get("FARM_CACHE_WRITE", "1") == "1", isa=os.environ.get("FARM_CACHE_ISA"))
    device = os.environ.get("FARM_STEP_DEVICE", "cpu")
    setup_s = time.perf_counter() - imported
    torch.manual_seed(0)
    net = Net().to(device)
    step = torch.compile(lambda x: net(x).square().mean())
    start = time.perf_counter()
    with counting_builds() as built:
        step(torch.randn(8, 16, device=device)).backward()
    seconds = time.perf_counter() - start
    grads = sum(p.grad.abs().sum().item() for p in net.parameters())
    print(json.dumps({"inductor": dict(counters["inductor"]), "aot_autograd": dict(counters["aot_autograd"]),
                      "grads": grads, "kernels_built": len(built), "seconds": round(seconds, 2),
                      "import_s": round(imported - BEGAN, 2), "farm_setup_s": round(setup_s, 2),
                      "farm_steps_s": farm.setup_s if farm else None, "farm": farm.stats() if farm else None,
                      "until_here_s": round(time.perf_counter() - BEGAN, 2)}))
    if os.environ.get("FARM_STEP_EXIT_TRACE"):  # where a process's exit goes (bench/gpu_zoo.sh)
        import faulthandler

        trace = open(os.environ["FARM_STEP_EXIT_TRACE"], "w")  # noqa: SIM115 (open until the process ends)
        faulthandler.dump_traceback_later(0.5, repeat=True, file=trace)


if __name__ == "__main__":
    main()
