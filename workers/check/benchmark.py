"""Latency: median and spread over repeated runs after warm-up, eager and compiled on the
same inputs. The spread (interquartile range) is the noise a faster candidate must beat.

On a GPU each run is timed with CUDA events recorded on the stream around it and waited for,
so a run's time is the device's, not how long the host took to queue its kernels."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from workers.check.inputs import InputSet


@dataclass(frozen=True)
class Timing:
    median_ms: float
    spread_ms: float  # interquartile range of the runs


def _time_cpu(fn: Callable, inputs: InputSet) -> float:
    start = time.perf_counter()
    fn(*inputs.args, **inputs.kwargs)
    return (time.perf_counter() - start) * 1000.0


def _time_cuda(fn: Callable, inputs: InputSet) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(*inputs.args, **inputs.kwargs)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def measure(fn: Callable, inputs: InputSet, warmup: int, repeat: int, device: str = "cpu",
            grad: bool = False) -> Timing:
    """grad: fn is a training step (forward and backward), timed with autograd on."""
    once = _time_cuda if device == "cuda" else _time_cpu
    with torch.enable_grad() if grad else torch.inference_mode():
        for _ in range(warmup):
            fn(*inputs.args, **inputs.kwargs)
        if device == "cuda":
            torch.cuda.synchronize()  # warm-up work queued on the device is not the first run's
        times = [once(fn, inputs) for _ in range(max(1, repeat))]
    if len(times) < 4:
        return Timing(statistics.median(times), max(times) - min(times))
    q1, _, q3 = statistics.quantiles(times, n=4)
    return Timing(statistics.median(times), q3 - q1)
