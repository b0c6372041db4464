"""Short jobs on the cluster as Ray tasks (a zoo suite's exports): `run_tasks` runs a module-level
function once per call and gives back each result, or why there is none, in the calls' order.

Where a farm service runs, its warm workers hold every CPU of Ray's while they live, busy or
idle: tasks of one CPU each would wait for them to stop. `beside=True` runs the tasks as ones
that take none of Ray's CPUs, as the service's burst workers do, each pinned to a node that
offers a farm device class (not a head kept for scheduling), at most as many at once on a node
as it has CPUs: as many as Ray would run there of one-CPU tasks, so a suite of many models does
not start them all at once."""
from __future__ import annotations

import functools
import importlib
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from workers.errors import summary
from workers.frozen_heap import heap_frozen_after


@dataclass(frozen=True)
class TaskFailed:
    """A task of run_tasks that did not return: why."""
    error: str


def run_tasks(fn: Callable[..., Any], calls: list[tuple], name: str, timeout_s: float,
              beside: bool = False) -> list[Any]:
    """fn(*call) for every call, as named Ray tasks of one CPU each, spread over the cluster (with
    `beside`, see the module's doc; where no node offers a farm device class, as without it);
    the results in order, a call that raised, died or ran past timeout_s as a TaskFailed. fn is
    a module-level function: the task imports it by name."""
    if "<" in fn.__qualname__:
        raise ValueError(f"run_tasks imports fn by name on the worker; {fn.__module__}.{fn.__qualname__} "
                         "is a lambda or a local function: define it at a module's top level")
    remote = ray.remote(num_cpus=1, max_retries=1)(_imported_then_called)
    named = f"{fn.__module__}:{fn.__qualname__}"
    start = lambda i, **where: remote.options(name=f"{name} {i + 1}/{len(calls)}", **where).remote(  # noqa: E731
        named, *calls[i])
    deadline = time.monotonic() + timeout_s
    places = _beside_farm_nodes() if beside else []
    if not places:
        refs = [start(i) for i in range(len(calls))]
        return [_result(ref, deadline, timeout_s) for ref in refs]
    results: dict[int, Any] = {}
    waiting, running = list(range(len(calls))), {}
    while waiting or running:
        while waiting and places:
            where = places.pop(0)
            i = waiting.pop(0)
            running[start(i, **where)] = (i, where)
        done, _ = ray.wait(list(running), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:  # past the deadline: what runs is stopped, what waits never starts
            for ref, (i, _) in running.items():
                ray.cancel(ref, force=True)
                results[i] = TaskFailed(f"GetTimeoutError: the task ran past {timeout_s:g}s")
            results.update((i, TaskFailed(f"the task did not start within {timeout_s:g}s")) for i in waiting)
            break
        i, where = running.pop(done[0])
        places.append(where)
        results[i] = _result(done[0], deadline, timeout_s)
    return [results[i] for i in range(len(calls))]


def _beside_farm_nodes() -> list[dict[str, Any]]:
    """Ray options for a task beside a farm node's workers, one per CPU of each such node, the
    nodes taken in turn (a suite's first exports spread over them)."""
    nodes = [(n["NodeID"], max(1, int(n["Resources"].get("CPU", 1)))) for n in ray.nodes()
             if n["Alive"] and any(r.startswith("farm_") for r in n["Resources"])]
    return [{"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}
            for k in range(max((cpus for _, cpus in nodes), default=0)) for node, cpus in nodes if k < cpus]


def _result(ref: Any, deadline: float, timeout_s: float) -> Any:
    try:
        return ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
    except RayTaskError as e:  # what the task raised, its traceback kept by Ray
        cause = e.cause if isinstance(getattr(e, "cause", None), BaseException) else e
        return TaskFailed(f"{type(cause).__name__}: {summary(cause)}")
    except (RayActorError, GetTimeoutError) as e:
        ray.cancel(ref, force=True)
        return TaskFailed(f"{type(e).__name__}: the task died or ran past {timeout_s:g}s")


def _imported_then_called(ref: str, *call: Any) -> Any:
    """On the task's worker: `module:function` imported by name, the first time with its heap
    frozen after (a zoo suite imports torch there: workers/frozen_heap.py), then called. Ray would
    import fn's module as it unpickled fn, before any code of ours could run."""
    module, _, qualname = ref.partition(":")
    if module not in sys.modules:
        with heap_frozen_after():
            importlib.import_module(module)
    return functools.reduce(getattr, qualname.split("."), sys.modules[module])(*call)
