"""The user's path against a real S3 server: `farm compile --store s3://…`, then the artifact
fetched back from S3 loads with aoti_load_package and matches eager."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from farm.zoo import export_model
from storage import store_from_uri
from storage.results import read_results

pytestmark = pytest.mark.slow


def _farm(*args, env):
    return subprocess.run([sys.executable, "-m", "farm", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})


def test_compile_into_s3_fetch_back_and_run(s3_server, s3_uri, zoo_dir, tmp_path):
    graphs = [str(zoo_dir / "mlp.pt2"), str(zoo_dir / "encoder_block.pt2")]
    first = _farm("compile", *graphs, "--store", s3_uri, env=s3_server.env())
    assert first.returncode == 0, first.stdout + first.stderr
    assert "2 compiled, 0 hits, 0 failed" in first.stdout

    store = store_from_uri(s3_uri)
    (job_id,) = store.job_ids()
    rows = {r["graph"]: r for r in read_results(store, job_id)}
    assert set(rows) == {"mlp", "encoder_block"}

    dest = tmp_path / "encoder_block.pt2"
    fetched = _farm("fetch", rows["encoder_block"]["key"], str(dest), "--store", s3_uri, env=s3_server.env())
    assert fetched.returncode == 0, fetched.stderr
    assert "verified" in fetched.stdout
    compiled = torch._inductor.aoti_load_package(str(dest))
    x = torch.randn(3, 11, 32)  # batch and sequence both unlike the example (4, 16)
    torch.testing.assert_close(compiled(x), export_model("encoder_block").module()(x), atol=1e-4, rtol=1e-4)

    second = _farm("compile", *graphs, "--store", s3_uri, env=s3_server.env())
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
