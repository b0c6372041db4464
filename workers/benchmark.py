"""Latency: median over repeated runs after warm-up, eager and compiled on the same inputs."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from workers.inputs import InputSet


def median_ms(fn: Callable, inputs: InputSet, warmup: int, repeat: int) -> float:
    with torch.inference_mode():
        for _ in range(warmup):
            fn(*inputs.args, **inputs.kwargs)
        times = []
        for _ in range(max(1, repeat)):
            start = time.perf_counter()
            fn(*inputs.args, **inputs.kwargs)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000.0
