"""Temp dirs left by farm processes that were killed are found and removed; live ones are kept."""
from __future__ import annotations

import subprocess
import sys

from workers.sandbox import tempdirs


def test_dirs_of_dead_farm_processes_are_swept_and_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f"farm-unit-{int(dead.stdout)}-abc123"
    (orphan / "deep").mkdir(parents=True)
    (orphan / "deep" / "artifact.pt2").write_bytes(b"x" * 100)
    mine = tmp_path / f"{tempdirs.prefix('sandbox')}def456"
    mine.mkdir()
    other = tmp_path / "farm-gpu-locks"  # not a per-process dir: never touched
    other.mkdir()
    dead_here = tmp_path / f"farm-unit-{int(dead.stdout)}.{tempdirs._pid_namespace()}-ghi789"
    dead_here.mkdir()
    # a farm process in another PID namespace (a container sharing /tmp): its PIDs mean nothing here
    elsewhere = tmp_path / f"farm-sandbox-{int(dead.stdout)}.{tempdirs._pid_namespace() + 1}-jkl012"
    elsewhere.mkdir()
    assert tempdirs.sweep_orphans(tmp_path) == 2
    assert not orphan.exists() and not dead_here.exists() and mine.exists() and other.exists() and elsewhere.exists()
