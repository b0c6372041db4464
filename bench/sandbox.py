"""What the sandbox costs per unit: the zoo job through the real sandbox (a warm child
process, jailed and not: FARM_SANDBOX=jail|process) against the same steps run in this
process, in one run; and what the jail adds to a child's start and to a round trip.

Both sides run the same code (workers/sandbox/steps.py, archive checks included); only the process
boundary differs. The in-process side exists only here: the farm never loads a graph outside
its sandbox. Each side gets a fresh store and a fresh Inductor cache for its cold run, then
runs the job again for the warm run (all hits). The precompiled header in /tmp is built first
by a throwaway process; the in-process side runs first, in this fresh process, and the
sandbox side in fresh children, so each pays a process's first compile the same way.

    .venv/bin/python bench/sandbox.py

Prints per-unit times for each side, the sandbox's own accounting (child start, round trips
minus time inside the steps), overhead / cold compile time (goal: under 5%), and jail minus
process for a child's start (goal: +0.2 s or less) and a round trip (goal: +1 ms or less).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class InProcess:
    """The Sandbox interface, running steps in this process (for comparison only)."""

    def __init__(self) -> None:
        from workers.sandbox.process import SandboxCost
        from workers.sandbox.steps import Steps

        self.steps, self.cost = Steps(), SandboxCost()
        self.isolation, self.start_waited_s = None, 0.0

    @contextlib.contextmanager
    def workdir(self, kind: str = "unit") -> Iterator[Path]:
        with tempfile.TemporaryDirectory(prefix=f"farm-bench-{kind}-") as tmp:
            yield Path(tmp)

    def call(self, step: str, cwd: Path, limits: Any, deadline: float, device: str = "cpu", **kwargs: Any) -> dict[str, Any]:
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


def _starts(rounds: int = 4) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Child starts (to ready), jail and process alternating: a sandbox's first (its zygote
    imports torch), and the next job's (`renew`: a fork of that zygote)."""
    from workers.sandbox.process import Sandbox
    from workers.unit import UnitLimits

    first: dict[str, list[float]] = {"process": [], "jail": []}
    switch: dict[str, list[float]] = {"process": [], "jail": []}
    for _ in range(rounds):
        for mode in first:
            os.environ["FARM_SANDBOX"] = mode
            with Sandbox() as sandbox:
                sandbox.prestart(UnitLimits())
                first[mode].append(sandbox._wait_ready())
                sandbox.renew()
                switch[mode].append(sandbox._wait_ready())
    return first, switch


def _jail_pch(root: Path, graph: str) -> None:
    """The jail's precompiled headers are the node's, in the part of /tmp's Inductor dir that
    jailed children may write (workers/sandbox/env.py): build them in a throwaway jailed compile,
    as the process side's are built in /tmp, so that neither side's cold run builds them."""
    from scheduler.jobs import execute
    from scheduler.spec import parse_job
    from storage import store_from_uri

    os.environ["FARM_SANDBOX"], os.environ["TORCHINDUCTOR_CACHE_DIR"] = "jail", str(root / "pch-jail")
    execute(parse_job({"graphs": [graph], "targets": ["aoti-cpu"]}), store_from_uri(str(root / "store-pch-jail")))


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
                   check=True, capture_output=True,
                   env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root / "pch"), "FARM_SANDBOX": "process"})
    _jail_pch(root, graphs[0])

    inproc = _side("inprocess", job, root, InProcess, [])
    sides, costs = {}, {}
    for mode in ("process", "jail"):
        os.environ["FARM_SANDBOX"] = mode
        costs[mode] = []
        sides[mode] = _side(mode, job, root, Sandbox, costs[mode])
    n = sides["jail"]["cold_units"]
    print(f"compared: the zoo job ({n} models x aoti-cpu), cold (fresh store and Inductor cache) and warm "
          f"(all hits), steps in a warm sandbox child, jailed and as a plain process, vs the same steps in this process")
    for run in ("cold", "warm"):
        j, p, i = sides["jail"][run], sides["process"][run], inproc[run]
        print(f"{run}: jail {j:7.2f} s, process {p:7.2f} s, in process {i:7.2f} s; jail / process {j / p:.3f}, "
              f"jail - process {(j - p) / n * 1000:+.0f} ms/unit")
    for mode in ("process", "jail"):
        for run, cost in zip(("cold", "warm"), costs[mode]):
            print(f"{mode} sandbox, {run} job: child start {cost.start_s:.2f} s ({cost.warm_up_s:.2f} s of it importing "
                  f"what the first step needs in any process), {cost.calls} round trips, "
                  f"{cost.overhead_s / max(cost.calls, 1) * 1000:.2f} ms per call outside the steps")
    per_call = {m: sum(c.overhead_s for c in costs[m]) / max(sum(c.calls for c in costs[m]), 1) for m in costs}
    starts, switches = _starts()
    mean = {m: sum(v) / len(v) for m, v in starts.items()}
    print(f"child start, {len(starts['jail'])} each, alternating: jail {mean['jail']:.2f} s, process {mean['process']:.2f} s, "
          f"jail - process {mean['jail'] - mean['process']:+.2f} s (goal <= +0.2 s)")
    fork = {m: sum(v) / len(v) for m, v in switches.items()}
    print(f"the next job's fresh child (a fork of the sandbox's zygote, which imported torch once): jail "
          f"{fork['jail'] * 1000:.0f} ms, process {fork['process'] * 1000:.0f} ms, against the first child's start above")
    print(f"round trip outside the steps: jail {per_call['jail'] * 1000:.2f} ms, process {per_call['process'] * 1000:.2f} ms, "
          f"jail - process {(per_call['jail'] - per_call['process']) * 1000:+.2f} ms per call (goal <= +1 ms)")
    cold_compile = sides["jail"]["cold"] / n
    for run, cost in zip(("cold", "warm"), costs["jail"]):
        steady = cost.overhead_s / n
        per_unit = steady + (cost.start_s - cost.warm_up_s) / n  # the child's own start, amortized over the job
        print(f"{run}: jail sandbox per unit {per_unit * 1000:.0f} ms / cold compile {cold_compile:.2f} s = "
              f"{per_unit / cold_compile:.3f} (goal < 0.05)")


if __name__ == "__main__":
    main()
