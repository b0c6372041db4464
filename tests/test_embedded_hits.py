"""`farm submit` on the embedded Ray starts no Ray for a job of hits: they are answered in the
submitting process, from the store (what `./dev demo`'s second run is)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from scheduler.jobs import execute
from scheduler.spec import parse_job
from storage import store_from_uri

SUBMIT = """
import json, sys
import ray
from farm.client import submit
handle = submit({"name": "again", "graphs": [sys.argv[1]], "targets": ["core-aten"]}, store=sys.argv[2])
print(json.dumps({"statuses": [r.status for r in handle.outcome.results], "ray": ray.is_initialized()}))
"""


def test_a_job_of_hits_is_answered_without_starting_ray(zoo_dir, tmp_path):
    store = str(tmp_path / "store")
    graph = str(zoo_dir / "mlp.pt2")
    first = execute(parse_job({"graphs": [graph], "targets": ["core-aten"]}), store_from_uri(store))
    assert [r.status for r in first.results] == ["compiled"], first.results[0].error
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", SUBMIT, graph, store], capture_output=True, text=True, env=env,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"statuses": ["hit"], "ray": False}
