"""Latency: median and spread over repeated runs after warm-up, eager and compiled on the
same inputs. The spread (interquartile range) is the noise a faster candidate must beat."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from workers.inputs import InputSet


@dataclass(frozen=True)
class Timing:
    median_ms: float
    spread_ms: float  # interquartile range of the runs


def measure(fn: Callable, inputs: InputSet, warmup: int, repeat: int) -> Timing:
    with torch.inference_mode():
        for _ in range(warmup):
            fn(*inputs.args, **inputs.kwargs)
        times = []
        for _ in range(max(1, repeat)):
            start = time.perf_counter()
            fn(*inputs.args, **inputs.kwargs)
            times.append((time.perf_counter() - start) * 1000.0)
    if len(times) < 4:
        return Timing(statistics.median(times), max(times) - min(times))
    q1, _, q3 = statistics.quantiles(times, n=4)
    return Timing(statistics.median(times), q3 - q1)
