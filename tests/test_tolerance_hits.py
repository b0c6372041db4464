"""A hit honours the job's tolerances: a manifest verified at looser ones is checked again (or
shown to be within them by its recorded error), never taken on trust."""
from __future__ import annotations

import pytest

from scheduler.spec import parse_job
from scheduler.jobs import execute
from tests.cli import farm

pytestmark = pytest.mark.slow


def _mlp_at(zoo_runs, zoo_dir, atol: float, rtol: float):
    store = zoo_runs[0]  # the zoo compiled at the default atol = rtol = 1e-4
    job = parse_job({"graphs": [str(zoo_dir / "mlp.pt2")], "targets": ["aoti-cpu"], "verify": {"atol": atol, "rtol": rtol}})
    outcome = execute(job, store)
    return store, outcome.results[0], outcome.job_id


def _recorded_error(zoo_runs) -> float:
    return next(r for r in zoo_runs[1].results if r.graph == "mlp").metrics["max_abs_err"]


def test_a_hit_within_the_recorded_error_needs_no_check(zoo_runs, zoo_dir):
    err = _recorded_error(zoo_runs)
    store, r, job_id = _mlp_at(zoo_runs, zoo_dir, atol=err * 2, rtol=err * 2)
    assert r.status == "hit" and "verify" not in r.timings, r.error
    assert "verified at atol=0.0001, rtol=0.0001" in r.note and "recorded max error" in r.note


def test_a_hit_under_stricter_tolerances_is_verified_again(zoo_runs, zoo_dir):
    err = _recorded_error(zoo_runs)
    store, r, job_id = _mlp_at(zoo_runs, zoo_dir, atol=err / 100, rtol=0.5)  # stricter atol: the recorded error is over it
    assert r.status == "hit" and "verify" in r.timings, r.error
    assert r.note.endswith("verified again here at this job's tolerances")
    assert "verified again here" in " ".join(farm("explain", "--job", job_id, "--store", store.uri).split())


def test_a_hit_that_fails_stricter_tolerances_fails_and_explain_says_why(zoo_runs, zoo_dir):
    err = _recorded_error(zoo_runs)
    store, r, job_id = _mlp_at(zoo_runs, zoo_dir, atol=err / 100, rtol=1e-9)
    assert r.status == "failed" and not r.retryable
    assert "verified at atol=0.0001, rtol=0.0001; this job asks" in r.error and "and it fails them" in r.error
    assert "verification failed" in r.error
    out = " ".join(farm("explain", "--job", job_id, "--store", store.uri).split())  # as one line, unwrapped
    assert "and it fails them" in out
