"""Where a benchmark run keeps its stores, caches and graphs: a temp dir removed as the run ends.
A run leaves a lot behind (a fan-out run's Inductor caches hold 2 GB of precompiled headers), and
benchmarks run again and again; set FARM_BENCH_KEEP=1 to keep it and look inside."""
from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path


def scratch_dir(prefix: str) -> Path:
    """A fresh temp dir, removed when this process exits (after Ray's own shutdown, which was
    registered later and so runs first) unless FARM_BENCH_KEEP is set."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    if os.environ.get("FARM_BENCH_KEEP"):
        print(f"keeping {root} (FARM_BENCH_KEEP)", file=sys.stderr)
    else:
        atexit.register(shutil.rmtree, root, True)
    return root
