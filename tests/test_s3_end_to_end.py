"""The user's path against a real S3 server: `farm compile --store s3://…`, then the artifacts
fetched back from S3 run in a fresh process and match eager: an AOTInductor package and an
ExecuTorch program (.pte)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from storage import store_from_uri
from storage.results import read_results

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def _farm(*args, env):
    return subprocess.run([sys.executable, "-m", "farm", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})


# In a fresh process, as a consumer would: the fetched artifact against the program run eagerly,
# at a batch and sequence both unlike the example (4, 16).
RUN_FETCHED = """
import sys, torch
from farm.client import load_compiled
from workers.sandbox.program import load_program
run = load_compiled(sys.argv[1])
eager = load_program(sys.argv[2], "encoder_block").module()
x = torch.randn(3, 11, 32)
got = run(x)
got = got[0] if isinstance(got, list) else got  # a .pte's outputs come as a list
torch.testing.assert_close(got, eager(x), atol=1e-4, rtol=1e-4)
print("ran", tuple(got.shape))
"""


def test_compile_into_s3_fetch_back_and_run(s3_server, s3_uri, zoo_dir, tmp_path):
    graphs = [str(zoo_dir / "encoder_block.pt2")]
    targets = ["-t", "aoti-cpu", "-t", "executorch:xnnpack"]
    first = _farm("compile", *graphs, *targets, "--store", s3_uri, env=s3_server.env())
    assert first.returncode == 0, first.stdout + first.stderr
    assert "2 compiled, 0 hits, 0 failed" in first.stdout
    # its output a pipe, as in CI: a line per unit compiled as it ends, not a progress bar redrawn
    for target in ("aoti-cpu", "executorch:xnnpack"):
        assert re.search(rf"^\[[12]/2\] encoder_block \({target}\): compiled in [\d.]+ s · ", first.stderr, re.M), first.stderr
    assert "ETA" not in first.stderr and "━" not in first.stderr, first.stderr

    store = store_from_uri(s3_uri)
    (job_id,) = store.job_ids()
    rows = {(r["graph"], r["target"]): r for r in read_results(store, job_id)}
    assert set(rows) == {("encoder_block", t) for t in ("aoti-cpu", "executorch:xnnpack")}

    for target, name in (("aoti-cpu", "encoder_block.pt2"), ("executorch:xnnpack", "encoder_block.pte")):
        dest = tmp_path / name
        fetched = _farm("fetch", rows["encoder_block", target]["key"][:16], str(dest), "--store", s3_uri,
                        env=s3_server.env())
        assert fetched.returncode == 0 and "verified" in fetched.stdout, fetched.stdout + fetched.stderr
        ran = subprocess.run([sys.executable, "-c", RUN_FETCHED, str(dest), str(zoo_dir / "encoder_block.pt2")],
                             capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert ran.returncode == 0 and "ran (3, 11, 32)" in ran.stdout, (target, ran.stdout + ran.stderr[-3000:])

    second = _farm("compile", *graphs, *targets, "--store", s3_uri, env=s3_server.env())
    assert second.returncode == 0 and "0 compiled, 2 hits, 0 failed" in second.stdout, second.stdout
    assert "hit rate 100% (2/2)" in second.stdout
    (again,) = set(store.job_ids()) - {job_id}
    rows = read_results(store, again)  # identities known from the first run: no program fetched from anywhere
    assert all(r["bytes_downloaded"] == 0 and r["bytes_cached"] == 0 for r in rows), rows


def test_fetch_of_unknown_key_says_what_to_do(s3_server, s3_uri, tmp_path):
    proc = _farm("fetch", "0" * 64, str(tmp_path / "x.pt2"), "--store", s3_uri, env=s3_server.env())
    assert proc.returncode == 2 and "no manifest for key" in proc.stderr
    assert not (tmp_path / "x.pt2").exists()


def test_bad_credentials_give_a_clear_error(s3_server, s3_uri, zoo_dir):
    env = {**s3_server.env(), "AWS_SECRET_ACCESS_KEY": "wrong"}
    proc = _farm("compile", str(zoo_dir / "mlp.pt2"), "--store", s3_uri, env=env)
    assert proc.returncode == 2
    assert s3_uri in proc.stderr and "wrong" not in proc.stderr + proc.stdout  # never echo secrets
