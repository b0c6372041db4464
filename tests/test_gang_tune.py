"""The gang's autotune decision from gathered outcomes (the gang itself: tests/test_gang.py)."""
from __future__ import annotations

from workers.autotune.space import Measured
from workers.gang.tune import _slowest


def test_a_lockstep_candidate_takes_the_slowest_rank_and_fails_if_any_rank_failed():
    ok = [Measured("max_autotune", "compiled", "k0", None, 2.0, 0.1, 1e-6),
          Measured("max_autotune", "hit", "k1", None, 3.0, 0.2, 1e-5)]
    both = _slowest(ok, rank=0)
    assert (both.status, both.key, both.median_ms, both.spread_ms, both.max_abs_err) == ("compiled", "k0", 3.0, 0.2, 1e-5)
    broken = _slowest([ok[0], Measured("max_autotune", "failed", "k1", "verify: max error 0.3 > atol")], rank=0)
    assert not broken.usable and broken.error == "rank 1: verify: max error 0.3 > atol"
