"""A unit's log takes what the worker process prints while a step runs. Units of jobs that run at
once in threads (in-process jobs, a farm service's scheduler) leave the process's output and
Inductor's log as they found them."""
from __future__ import annotations

import logging
import os
import threading

from workers.unitlog import UnitLog


def _fd(n: int) -> tuple[int, int]:
    st = os.fstat(n)
    return st.st_dev, st.st_ino


def test_units_capturing_at_once_in_threads_leave_the_process_output_as_it_was():
    before = _fd(1), _fd(2)
    inductor = logging.getLogger("torch._inductor")
    state = inductor.level, inductor.propagate, inductor.handlers[:]
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    a, b = UnitLog("unit a"), UnitLog("unit b")

    def unit_a() -> None:
        with a.capture():
            os.write(2, b"printed while unit a ran\n")
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def unit_b() -> None:
        a_in.wait(10)
        with b.capture():
            b_in.set()
            a_out.wait(10)  # a ends first: b's capture outlives the one it began inside

    threads = [threading.Thread(target=unit_a), threading.Thread(target=unit_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert (_fd(1), _fd(2)) == before, "fd 1 or 2 was left on a unit's temp file"
    assert (inductor.level, inductor.propagate, inductor.handlers) == state, "Inductor's log was left on a unit's stream"
    assert "printed while unit a ran" in a.text()
