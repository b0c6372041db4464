"""The README's two-node recipe, run as written (another port), as a newcomer would: a fresh home
(so `ray start --head` makes the token and `farm submit` finds it), no RAY_AUTH_TOKEN or
RAY_ADDRESS from the test session. It runs in PID and network namespaces of its own: the recipe's
`ray stop` stops its cluster and not the session's, and its cluster, which listens where stock Ray
decides (every interface), has no interface but a loopback of its own."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.sockets import free_port

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _recipe() -> str:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- recipe: two-node cluster -->\s*```bash\n(.*?)```\s*<!-- end recipe -->", text, re.S)
    assert block, "README.md lost its two-node recipe"
    return block.group(1)


def _isolated() -> tuple[list[str], str]:
    """PID and network namespaces of its own (root): `ray stop` sees only the recipe's processes,
    and what the recipe starts is reachable from nowhere (the script brings its loopback up)."""
    ip = shutil.which("ip") or shutil.which("ip", path="/usr/sbin:/sbin")  # sbin: not on every PATH
    if shutil.which("unshare") is None or ip is None:
        pytest.skip("needs `unshare` (util-linux) and `ip` (iproute2) to isolate the recipe's cluster")
    command = ["unshare", "-p", "-f", "--mount-proc", "-n"]
    probe = subprocess.run([*command, ip, "link", "set", "lo", "up"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make PID and network namespaces here (`unshare -p -n` needs root): {probe.stderr[:200]!r}")
    return command, ip


def test_the_readme_two_node_recipe_works_as_written(tmp_path):
    recipe = _recipe()
    assert "--address 127.0.0.1:6390" in recipe and recipe.strip().endswith("ray stop")
    port = str(free_port())
    isolated, ip = _isolated()
    script = f"set -euxo pipefail\n{ip} link set lo up\n" + recipe.replace("6390", port)
    home = tmp_path / "home"
    home.mkdir()
    venv_bin = str(Path(os.sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), PATH=f"{venv_bin}:{env['PATH']}", RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run([*isolated, "bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    out = proc.stdout + proc.stderr
    # both tails: a dying raylet's last logs fill the end of stdout, and the commands' trace is in stderr
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert (home / ".ray" / "auth_token").is_file()  # the token ray start made, which farm submit found
    assert re.search(r"2 compiled, 0 hits, 0 failed", out), out[-3000:]
    assert "Traceback" not in out
