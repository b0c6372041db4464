"""This host's NVIDIA GPUs, as CUDA targets need to know them: their architecture (for keys
and routing), their fingerprint (for shared autotuning), whether they still work, and one
lock per GPU so benchmarks of the workers sharing it never overlap.

The worker process never initialises CUDA itself: a short-lived child answers (`probe`), so
a wedged GPU or a driver fault can only hang or kill that child. The child also runs a tiny
kernel and checks its result, which is how a worker tells, after a sandbox crashed on the
GPU, whether the GPU is still usable before it runs the next unit there.

A process that trains or serves on its GPU (`warm_start`) asks its own CUDA instead
(`asked_in_this_process`): a child would import torch again, 5-10 s on a GPU host, before
every first step.
"""
from __future__ import annotations

import contextlib
import contextvars
import fcntl
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from workers.sandbox import tempdirs
from workers.sandbox.env import child_env

ARCH = re.compile(r"sm_\d{2,3}")  # sm_80, sm_90, sm_100: what Gpu.arch says
ANY_GPU = "farm_cuda"  # offered by every GPU node: targets with no `:sm_XX` go to any of them


def _workers_per_gpu() -> int:
    raw = os.environ.get("FARM_WORKERS_PER_GPU", "4")
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"FARM_WORKERS_PER_GPU={raw!r}: give the number of lowering workers per GPU, e.g. 4")
    return int(raw)


# Lowering workers per GPU: lowering is mostly CPU work (Triton, the C++ compiler), so several
# share a GPU; each holds 1/N of it in Ray, and the node offers N slots per GPU.
WORKERS_PER_GPU = _workers_per_gpu()
PROBE_TIMEOUT_S = 180.0
LOCKS = Path(tempfile.gettempdir()) / "farm-gpu-locks"

PROBE = r"""
import json, sys
import torch
if not torch.cuda.is_available():
    why = "torch was built without CUDA" if torch.version.cuda is None else "no GPU is visible"
    print(json.dumps({"error": f"no CUDA GPU ({why}; torch {torch.__version__}, "
                               f"CUDA_VISIBLE_DEVICES={__import__('os').environ.get('CUDA_VISIBLE_DEVICES')!r})"}))
    sys.exit(0)
gpus = []
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    x = torch.arange(1024, dtype=torch.float32, device=i)
    total = float((x * 2).sum())  # a kernel ran, and gave the right answer
    torch.cuda.synchronize(i)
    if total != 1047552.0:
        print(json.dumps({"error": f"GPU {i} ({p.name}) computed {total} for a known sum (1047552)"}))
        sys.exit(0)
    gpus.append({"name": p.name, "major": p.major, "minor": p.minor, "memory_bytes": p.total_memory,
                 "multiprocessors": p.multi_processor_count, "uuid": str(getattr(p, "uuid", ""))})
print(json.dumps({"gpus": gpus}))
"""


class GpuUnavailable(Exception):
    """No usable GPU here; the message says why."""


@dataclass(frozen=True)
class Gpu:
    name: str
    major: int
    minor: int
    memory_bytes: int
    multiprocessors: int
    uuid: str

    @property
    def arch(self) -> str:
        return f"sm_{self.major}{self.minor}"

    @property
    def fingerprint(self) -> dict[str, object]:
        """What decides kernel timings: shared autotune results are kept per fingerprint."""
        return {"device": "cuda", "gpu": self.name, "arch": self.arch, "memory_gb": round(self.memory_bytes / 2**30),
                "multiprocessors": self.multiprocessors}


def arch_resource(arch: str | None) -> str:
    """`sm_90` → `farm_cuda_sm90`; None (any architecture) → `farm_cuda`."""
    return ANY_GPU if arch is None else f"{ANY_GPU}_{arch.replace('_', '')}"


def probe(timeout_s: float = PROBE_TIMEOUT_S) -> list[Gpu]:
    """Ask a fresh child for the visible GPUs, after running a kernel on each; raise GpuUnavailable."""
    with tempfile.TemporaryDirectory(prefix=tempdirs.prefix("gpu-probe")) as home:
        try:
            done = subprocess.run([sys.executable, "-c", PROBE], env=child_env(Path(home)), cwd=home,
                                  capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise GpuUnavailable(f"the GPU check did not finish in {timeout_s:g}s (a hung GPU?)") from None
    lines = done.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except ValueError:
        answer = {}
    answer = answer if isinstance(answer, dict) else {}
    if done.returncode != 0 or "gpus" not in answer:
        raise GpuUnavailable(answer.get("error") or f"the GPU check failed (exit status {done.returncode}): "
                                                    f"{done.stderr.strip()[-500:]}")
    if not answer["gpus"]:
        raise GpuUnavailable("no CUDA GPU is visible")
    return [Gpu(**g) for g in answer["gpus"]]


@functools.cache
def _this_process() -> Gpu | GpuUnavailable:
    import torch

    if not torch.cuda.is_available():
        return GpuUnavailable(f"this process sees no CUDA GPU (torch {torch.__version__}, "
                              f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    return Gpu(name=p.name, major=p.major, minor=p.minor, memory_bytes=p.total_memory,
               multiprocessors=p.multi_processor_count, uuid=str(getattr(p, "uuid", "")))


@functools.cache
def _own() -> Gpu | GpuUnavailable:
    try:
        return probe()[0]  # Ray makes a worker's GPU its first visible one
    except GpuUnavailable as e:
        return e


_THIS_PROCESS = contextvars.ContextVar("farm_gpu_this_process", default=False)


@contextlib.contextmanager
def asked_in_this_process() -> Iterator[None]:
    """Inside, `own_gpu` is the GPU this process uses, asked of its own CUDA (which it initialises),
    not of a fresh child: for a process that imported torch to run on the GPU anyway. Never in a
    sandbox's zygote, whose forked children could then not use CUDA."""
    token = _THIS_PROCESS.set(True)
    try:
        yield
    finally:
        _THIS_PROCESS.reset(token)


def own_gpu() -> Gpu:
    """This worker's GPU (probed once, and again after `forget`); raise GpuUnavailable. Inside
    `asked_in_this_process`, this process's current CUDA device."""
    found = _this_process() if _THIS_PROCESS.get() else _own()
    if isinstance(found, GpuUnavailable):
        raise found
    return found


def forget() -> None:
    """Probe again next time: a sandbox crashed on the GPU, which may no longer work."""
    _own.cache_clear()


def host_resources() -> dict[str, float]:
    """What this host offers for CUDA targets: WORKERS_PER_GPU slots per GPU, by architecture and
    for any architecture. Nothing, quickly, on a CPU-only torch or host."""
    import torch

    if torch.version.cuda is None or torch.cuda.device_count() == 0:  # device_count does not create a context
        return {}
    try:
        gpus = probe()
    except GpuUnavailable:
        return {}
    offers: dict[str, float] = {ANY_GPU: float(len(gpus) * WORKERS_PER_GPU)}
    for gpu in gpus:
        offers[arch_resource(gpu.arch)] = offers.get(arch_resource(gpu.arch), 0.0) + WORKERS_PER_GPU
    return offers


@contextlib.contextmanager
def exclusive_gpu() -> Iterator[None]:
    """Hold this process's GPU alone among the farm's workers on this host (for benchmarks).
    A lock file per GPU UUID: the kernel releases it if the holder dies."""
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    LOCKS.mkdir(parents=True, exist_ok=True)
    with open(LOCKS / f"{getattr(props, 'uuid', 'gpu')}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)

