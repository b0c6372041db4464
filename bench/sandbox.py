"""What the sandbox costs per unit: the zoo job through the real sandbox (a warm child
process) against the same steps run in this process, in one run.

Both sides run the same code (workers/sandbox/steps.py, archive checks included); only the process
boundary differs. The in-process side exists only here: the farm never loads a graph outside
its sandbox. Each side gets a fresh store and a fresh Inductor cache for its cold run, then
runs the job again for the warm run (all hits). The precompiled header in /tmp is built first
by a throwaway process; the in-process side runs first, in this fresh process, and the
sandbox side in fresh children, so each pays a process's first compile the same way.

    .venv/bin/python bench/sandbox.py

Prints per-unit times for each side, the sandbox's own accounting (child start, round trips
minus time inside the steps) and overhead / cold compile time (goal: under 5%).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class InProcess:
    """The Sandbox interface, running steps in this process (for comparison only)."""

    def __init__(self) -> None:
        from workers.sandbox.process import SandboxCost
        from workers.sandbox.steps import Steps

        self.steps, self.cost = Steps(), SandboxCost()

    def call(self, step: str, cwd: Path, limits: Any, deadline: float, **kwargs: Any) -> dict[str, Any]:
        from workers.sandbox.process import SandboxFailed
        from workers.sandbox.steps import USER_ERRORS

        try:
            return {**getattr(self.steps, step)(**kwargs), "output": ""}
        except USER_ERRORS as e:
            raise SandboxFailed(str(e)) from e

    def close(self) -> None:
        pass


def _side(name: str, job, root: Path, make_sandbox, costs: list) -> dict[str, float]:
    from scheduler.jobs import execute, run_units_in
    from storage import store_from_uri

    def runner(units, store, events):  # as run_in_process, with a sandbox of its own per job
        sandbox = make_sandbox()
        try:
            yield from run_units_in(sandbox, units, store, events)
        finally:
            costs.append(sandbox.cost)
            sandbox.close()

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / f"inductor-{name}")
    store = store_from_uri(str(root / f"store-{name}"))
    out: dict[str, float] = {}
    for run, status in (("cold", "compiled"), ("warm", "hit")):
        t0 = time.perf_counter()
        outcome = execute(job, store, runner)
        out[run] = time.perf_counter() - t0
        wrong = [(r.graph, r.status, r.error) for r in outcome.results if r.status != status]
        assert not wrong, f"{name} {run}: expected {status}: {wrong}"
        out[f"{run}_units"] = len(outcome.results)
        out[f"{run}_compile_s"] = outcome.stats.compile_s
    return out


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="farm-sandbox-bench-"))
    from farm.zoo import export_zoo
    from scheduler.spec import parse_job
    from workers.sandbox.process import Sandbox

    graphs = [str(p) for p in export_zoo(root / "zoo")]
    job = parse_job({"name": "sandbox", "graphs": graphs, "targets": ["aoti-cpu"]})
    # The precompiled header in /tmp, built in a throwaway process so that neither side builds it
    # and both start as fresh processes do: this one for the in-process side, the child for the other.
    farm = Path(sys.executable).with_name("farm")
    subprocess.run([str(farm), "compile", graphs[0], "--target", "aoti-cpu", "--store", str(root / "store-pch")],
                   check=True, capture_output=True, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root / "pch")})

    inproc = _side("inprocess", job, root, InProcess, [])
    costs: list = []
    boxed = _side("sandbox", job, root, Sandbox, costs)
    n = boxed["cold_units"]
    print(f"compared: the zoo job ({n} models x aoti-cpu), cold (fresh store and Inductor cache) and warm "
          f"(all hits), steps in a warm sandbox child vs the same steps in this process")
    for run in ("cold", "warm"):
        b, i = boxed[run], inproc[run]
        print(f"{run}: sandbox {b:7.2f} s ({b / n:.3f} s/unit), in process {i:7.2f} s ({i / n:.3f} s/unit), "
              f"difference {(b - i) / n * 1000:+.0f} ms/unit")
    for run, cost in zip(("cold", "warm"), costs):
        print(f"sandbox accounting, {run} job: child start {cost.start_s:.2f} s (once per job and worker; "
              f"{cost.warm_up_s:.2f} s of it importing what the first step needs in any process), "
              f"{cost.calls} round trips, {cost.overhead_s * 1000:.1f} ms outside the steps "
              f"({cost.overhead_s / max(cost.calls, 1) * 1000:.2f} ms per call)")
    cold_compile = boxed["cold"] / n
    for run, cost in zip(("cold", "warm"), costs):
        steady = cost.overhead_s / n
        extra_start = cost.start_s - cost.warm_up_s  # a new Python and torch's import: the sandbox's own
        per_unit = steady + extra_start / n  # amortized over the job's units on one worker
        print(f"{run}: per unit, round trips {steady * 1000:.1f} ms (/ cold compile = {steady / cold_compile:.4f}); "
              f"with the child's own start ({extra_start:.2f} s) spread over {n} units {per_unit * 1000:.0f} ms "
              f"(/ cold compile {cold_compile:.2f} s = {per_unit / cold_compile:.3f}; goal < 0.05); "
              f"counting all of the start {(steady + cost.start_s / n) / cold_compile:.3f}")


if __name__ == "__main__":
    main()
